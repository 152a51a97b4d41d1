"""The recording process's life: a child forked while the writer is busy records normally and exits
promptly; the first trajectories reach disk as fast as later ones (a worker killed right after them
keeps them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import rlreplay
from rlreplay.read.summary import recover

FORK = textwrap.dedent(
    """
    import json, os, sys, time
    import rlreplay
    from rlreplay.recorder import get_recorder

    run_dir, forks = sys.argv[1], int(sys.argv[2])
    rlreplay.init(run_dir, worker="parent")

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": prompt_ids[::-1]}

    children = []
    for c in range(forks):
        # the writer is busy: starting up right after init, then writing and sealing big steps
        for i in range(0 if c == 0 else 20):
            with rlreplay.trajectory(step=c, sample_index=i):
                generate(list(range(20_000)))
        pid = os.fork()
        if pid == 0:
            started = time.monotonic()
            recorder = get_recorder()
            for i in range(150):
                with rlreplay.trajectory(step=1000 + c, sample_index=i):
                    generate(list(range(50)))
            rlreplay.close()
            print(json.dumps({"exit_s": time.monotonic() - started, **recorder.counters}), flush=True)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    rlreplay.close()
    """
)


def test_child_forked_while_the_writer_is_busy_records_and_exits_promptly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FORK, str(run_dir), "5"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    try:
        reports = [json.loads(line) for line in proc.stdout.splitlines()]
    except ValueError as exc:
        raise AssertionError(f"unexpected output: {proc.stdout!r} {proc.stderr!r}") from exc
    assert len(reports) == 5
    for report in reports:
        assert report["spans"] == 300 and report["lost"] == 0, report
        assert report["exit_s"] < 20, report  # a stuck writer made close() wait its 60 s timeout
    run = rlreplay.open_run(run_dir)
    for c in range(5):
        assert run.trajectories(step=1000 + c).num_rows == 150


FIRST = textwrap.dedent(
    """
    import sys
    import rlreplay

    rlreplay.init(sys.argv[1], worker="w0")

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": prompt_ids[::-1]}

    for i in range(64):
        with rlreplay.trajectory(step=0, sample_index=i):
            generate(list(range(200)))
    print("FINISHED", flush=True)
    sys.stdin.read()
    """
)


def test_worker_killed_just_after_its_first_trajectories_keeps_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", FIRST, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    time.sleep(0.1)  # later batches reach disk within a few ms; the first one took 0.3-2 s
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert line.strip() == "FINISHED", proc.stderr.read() if proc.stderr else ""
    recover(run_dir)
    table = rlreplay.open_run(run_dir).trajectories(step=0)
    assert sorted(table["sample_index"].to_pylist()) == list(range(64))
    assert set(table["status"].to_pylist()) == {"ok"}
