"""``rlreplay watch --json`` started beside a job that ``rlreplay record`` records: what it printed,
and whether the job was still running when the first alert (or a chosen step) was printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = Path(__file__).parent / "watch" / "watch_job.py"


@dataclass
class Watched:
    #: the JSON lines watch printed, in order
    events: list[dict[str, Any]]
    #: whether the recorded job was still running when the first alert (or the awaited step) came
    running_then: bool
    watch_code: int
    watch_stderr: str
    record_code: int

    @property
    def steps(self) -> list[int]:
        return [e["step"] for e in self.events if e["event"] == "step"]

    @property
    def alerts(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "alert"]


def faulty_ids(control: Path) -> dict[int, dict[str, bool]]:
    """Per step, each trajectory id and whether the job made it faulty (as the job noted it)."""
    out: dict[int, dict[str, bool]] = {}
    for path in control.glob("ids-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[int(path.stem.removeprefix("ids-"))] = {r["id"]: r["faulty"] for r in rows}
    return out


def watch_beside(
    run: str,
    control: Path,
    steps: int,
    fault_step: int,
    env: dict[str, str] | None = None,
    until_step: int | None = None,
    watch_args: tuple[str, ...] = (),
    timeout: float = 120.0,
) -> Watched:
    """Record the generic job into ``run`` and watch it at once; let the job end once watch printed
    an alert (or the step event of ``until_step``)."""
    control.mkdir(parents=True, exist_ok=True)
    env = env or {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")}
    job = [sys.executable, str(JOB), str(steps), str(fault_step), str(control)]
    record = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "record", "--out", run, "--", *job],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while not any(control.glob("ids-*.jsonl")):  # the run exists once the job records
            assert record.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        return watch_job(record, run, env, until_step, watch_args, timeout, (control / "stop").touch)
    finally:
        (control / "stop").touch()
        if record.poll() is None:
            record.kill()


def watch_job(
    job: subprocess.Popen,
    run: str,
    env: dict[str, str],
    until_step: int | None = None,
    watch_args: tuple[str, ...] = (),
    timeout: float = 120.0,
    then: Callable[[], Any] | None = None,
) -> Watched:
    """``rlreplay watch RUN --json`` beside the running ``job`` until the job and the watch end;
    ``then`` is called once watch printed an alert (or the step event of ``until_step``)."""
    deadline = time.monotonic() + timeout
    watch = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "watch", run, "--json", "--interval", "0.2", *watch_args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        events: list[dict[str, Any]] = []
        seen = threading.Event()

        def read() -> None:
            assert watch.stdout is not None
            for line in watch.stdout:
                event = json.loads(line)
                events.append(event)
                if event["event"] == "alert" or (until_step is not None and event.get("step") == until_step):
                    seen.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen.wait(max(0.0, deadline - time.monotonic()))
        running_then = seen.is_set() and job.poll() is None
        if then is not None:
            then()
        job_code = job.wait(max(1.0, deadline - time.monotonic()))
        watch_code = watch.wait(max(1.0, deadline - time.monotonic()))
        reader.join(timeout)
        assert watch.stderr is not None
        return Watched(events, running_then, watch_code, watch.stderr.read(), job_code)
    finally:
        if watch.poll() is None:
            watch.kill()
