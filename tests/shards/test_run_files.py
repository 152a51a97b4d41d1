"""run.json and the counters files: created atomically, and a malformed one never stops a command
or a recording process (one warning naming the file; the rest of the run keeps working)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.format import manifest


def _init_at_signal(run_dir: str, go: multiprocessing.synchronize.Event) -> None:
    go.wait()
    try:
        rlreplay.init(run_dir, experiment="race")
        rlreplay.close()
    except BaseException as exc:
        print(f"init raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    os._exit(0)


def test_concurrent_init_into_a_new_run_never_fails(tmp_path: Path) -> None:
    import pyarrow as pa

    pa.array([0])  # pay pyarrow's one-time imports once, here, rather than in each child
    run_dir = tmp_path / "run"
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_init_at_signal, args=(str(run_dir), go)) for _ in range(120)]
    for proc in procs:
        proc.start()
    go.set()
    for proc in procs:
        proc.join(60)
    assert [p.exitcode for p in procs] == [0] * 120
    data = json.loads((run_dir / "run.json").read_text())
    assert data["experiment"] == "race" and data["format_version"] == manifest.FORMAT_VERSION
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


RECORD = textwrap.dedent(
    """
    import rlreplay

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": prompt_ids[::-1]}

    for i in range(20):
        with rlreplay.trajectory(step=1, sample_index=i):
            generate(list(range(i, i + 30)))
    rlreplay.close()
    """
)


def _record_with_env(run_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLREPLAY_DIR": str(run_dir), "RLREPLAY_WORKER": "w0"}
    return subprocess.run(
        [sys.executable, "-c", RECORD], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("content", [b"", b'{"run_id": "abc", "experi'])
def test_unusable_run_json_neither_stops_recording_nor_commands(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_bytes(content)  # e.g. what a full disk left behind
    assert main(["info", str(run_dir), "--json"]) == 0
    assert "run.json" in capsys.readouterr().err

    proc = _record_with_env(run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "run.json" in proc.stderr  # said once, naming the file
    run = rlreplay.open_run(run_dir)
    assert run.spans().num_rows == 40
    assert run.counters()["spans"] == 40 and run.counters()["lost"] == 0
    assert json.loads((run_dir / "run.json").read_text())["format_version"] == manifest.FORMAT_VERSION
    if content:  # what was there is kept, not overwritten
        (kept,) = (run_dir / "_quarantine").iterdir()
        assert kept.read_bytes() == content


@pytest.mark.parametrize(
    "text, named",
    [
        ("[1, 2]", "list"),
        ('"a string"', "str"),
        ("null", "NoneType"),
        ('{"format_version": null, "experiment": "x"}', "format_version"),
        ('{"format_version": 1e400}', "format_version"),
        ('{"format_version": "2"}', "format_version"),
        ('{"command": 12, "recovered_shards": "many"}', "command"),
        ("[" * 100_000, "JSON"),
    ],
)
def test_malformed_run_json_is_named_and_the_run_still_reads(
    run_copy: Path, text: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (run_copy / "run.json").write_text(text)
    for command in (["ls", "--json"], ["info", "--json"], ["recover"]):
        capsys.readouterr()
        assert main([command[0], str(run_copy), *command[1:]]) == 0, command
        out, err = capsys.readouterr()
        assert out.strip()
        warnings = [line for line in err.splitlines() if "run.json" in line]
        if command[0] != "recover":
            assert len(warnings) >= 1 and named in " ".join(warnings), err
        assert "Traceback" not in err
    assert main(["info", str(run_copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spans"] > 0


@pytest.mark.parametrize("text", ["[1, 2]", "null", '{"spans": "abc"}', '{"lost": 1e400}', "{oops"])
def test_malformed_worker_counters_are_named_and_skipped(
    run_copy: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = json.loads(next((run_copy / "_workers").glob("*.json")).read_text())
    (run_copy / "_workers" / "bad.json").write_text(text)
    assert main(["info", str(run_copy), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "bad.json" in err and "Traceback" not in err
    assert json.loads(out)["spans"] >= good["spans"] > 0
    assert main(["ls", str(run_copy)]) == 0


def test_safe_run_path_refuses_what_escapes_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "spans").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run_dir / "_uploads").symlink_to(outside)
    assert manifest.safe_run_path(run_dir, "spans", "step=1") == run_dir / "spans" / "step=1"
    for parts in (("_uploads", "ledger.json"), ("..", "x"), ("/etc/passwd",)):
        with pytest.raises(manifest.UnsafePathError):
            manifest.safe_run_path(run_dir, *parts)
    linked = tmp_path / "linked-run"
    linked.symlink_to(run_dir)  # the run directory itself may be a link
    assert manifest.safe_run_path(linked, "spans") == linked / "spans"
