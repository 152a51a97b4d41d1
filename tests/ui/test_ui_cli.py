"""``rlreplay ui`` as a command: prints its URL, serves the run, binds 127.0.0.1 unless told."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

SAMPLE = Path(__file__).parents[2] / "sample_runs" / "verl-toolagent-smollm2"
RLREPLAY = str(Path(sys.executable).with_name("rlreplay"))


def _trajectories_on_disk() -> int:
    shards = SAMPLE.glob("spans/step=*/worker=*/part-*.parquet")
    return len(
        {t for p in shards for t in pq.read_table(p, columns=["trajectory_id"])["trajectory_id"].to_pylist()}
    )


def _start(*args: str, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k != "RLREPLAY_DIR"}
    proc = subprocess.Popen(
        [RLREPLAY, "ui", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"rlreplay ui exited {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, line


def _stop(proc: subprocess.Popen) -> str:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return err


def test_ui_serves_the_run_on_loopback() -> None:
    proc, line = _start(str(SAMPLE), "--port", "0", "--no-open")
    try:
        assert line.startswith("rlreplay ui: http://127.0.0.1:")
        url = line.split()[2]
        with urllib.request.urlopen(url, timeout=30) as resp:
            page = resp.read().decode()
            assert resp.url.endswith(f"/r/{SAMPLE.name}/")
        total = _trajectories_on_disk()
        assert f'<div class="big" id="total">{total}</div>' in page  # every trajectory of the run
    finally:
        err = _stop(proc)
    assert "warning" not in err


def test_ui_without_a_run_serves_the_runs_folder(tmp_path: Path) -> None:
    shutil.copytree(SAMPLE, tmp_path / "rlreplay-runs" / "first")
    shutil.copytree(SAMPLE, tmp_path / "rlreplay-runs" / "second")
    proc, line = _start("--port", "0", cwd=tmp_path)
    try:
        with urllib.request.urlopen(line.split()[2], timeout=30) as resp:
            page = resp.read().decode()
        assert 'href="/r/first/"' in page and 'href="/r/second/"' in page
    finally:
        _stop(proc)


def test_ui_warns_when_listening_beyond_this_machine() -> None:
    proc, line = _start(str(SAMPLE), "--host", "0.0.0.0", "--port", "0", "--no-open")
    err = _stop(proc)
    assert line.startswith("rlreplay ui: http://0.0.0.0:")
    assert "warning: listening on 0.0.0.0" in err


def test_ui_bad_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [RLREPLAY, "ui", str(tmp_path / "missing"), "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "missing" in result.stderr and "Traceback" not in result.stderr


def test_ui_port_in_use_is_one_line_and_exit_2() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run(
            [RLREPLAY, "ui", str(SAMPLE), "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2
    assert result.stderr.startswith(f"rlreplay: error: cannot listen on 127.0.0.1:{port}")
    assert result.stderr.count("\n") == 1
