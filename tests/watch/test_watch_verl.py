"""``rlreplay watch`` beside the real verl job on CPU (``sample_runs/make_verl_run.py``, verl's agent
loop, rewards and GRPO advantages) whose calculator tool starts failing at step 3 in half the
rollouts: the alert comes for step 3 or 4, names those rollouts only, while the job still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from watch_live import watch_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "sample_runs" / "make_verl_run.py"
#: steps 1..STEPS; the tool fails from FAULT_STEP on in rollout 1 of every prompt (n = 2). Two
#: healthy steps set the watch's baseline (``rlreplay.watch.BASELINE_STEPS``); the alert for the
#: first faulty step comes while the last one runs. With 3 prompts a step (6 rollouts, 3 failing)
#: the jump is far past chance at the healthy steps' rate (p < 0.002 against ``alert_p`` 0.01).
STEPS = 4
FAULT_STEP = 3
PROMPTS = (1000, 1001, 1002)


@pytest.mark.timeout(1500)
def test_watch_alerts_on_a_failing_tool_in_a_real_verl_job(tmp_path: Path) -> None:
    run, events = tmp_path / "run", tmp_path / "events.jsonl"
    plant = ",".join(f"{s}:{p}:1=tool_error" for s in range(FAULT_STEP, STEPS + 1) for p in PROMPTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")}
    job = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--task=arith",
            f"--steps={STEPS}",
            f"--questions={len(PROMPTS)}",
            f"--prompts={len(PROMPTS)}",
            "--n=2",
            "--val-questions=0",
            f"--plant={plant}",
            f"--events={events}",
            f"--out={run}",
        ],
        env={**env, "PYTHONWARNINGS": "ignore"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not (run / "run.json").exists():
            assert job.poll() is None, "the verl job ended before recording"
            time.sleep(0.2)
        watched = watch_job(job, str(run), env, timeout=1400)
    finally:
        if job.poll() is None:
            job.kill()
    assert watched.record_code == 0
    assert watched.steps == list(range(1, STEPS + 1)), watched.watch_stderr
    assert watched.running_then  # the first alert came while the job still ran
    assert watched.watch_code == 1, watched.watch_stderr
    listed = subprocess.run(
        [sys.executable, "-m", "rlreplay", "ls", str(run), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    key = {
        r["id"]: (r["step"], r["sample_index"], r["rollout_n"])
        for r in map(json.loads, listed.stdout.split("\n")[:-1])
    }
    failed = set()
    for line in events.read_text().splitlines():  # what the job itself noted: the tool calls that failed
        e = json.loads(line)
        if e["check"] == "tool_error":
            failed.add((e["step"], e["sample_index"], e["rollout_n"]))
    assert failed == {(s, p, 1) for s in range(FAULT_STEP, STEPS + 1) for p in PROMPTS}
    assert not [a for a in watched.alerts if a["step"] < FAULT_STEP]
    first = watched.alerts[0]
    assert first["step"] in (FAULT_STEP, FAULT_STEP + 1)
    for alert in watched.alerts:
        if alert["step"] in (FAULT_STEP, FAULT_STEP + 1):
            named = {key[i] for i in alert["trajectories"]}
            assert named and named <= failed, alert  # no healthy rollout named
    tool = [a for a in watched.alerts if a["check"] == "tool_error"]
    assert tool and {key[i] for i in tool[0]["trajectories"]} == {(tool[0]["step"], p, 1) for p in PROMPTS}
