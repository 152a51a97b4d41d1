"""Replaying one recorded step of the verl sample job against running it live.

The job is ``sample_runs/make_verl_run.py --job``: verl 0.9.1's real AgentLoopWorker, tool agent
loop, reward loop and GRPO advantage on CPU, with SmolLM2-135M answering in the process. Step 1 is
recorded live (``rlreplay record``), then run again under ``rlreplay replay SRC --serve llm``
(model calls served from the recording; parsers, tools and rewards live) and ``--serve agent``
(whole agent loops served). The job prints its own timings (``rollout_s``: the step's
``generate_sequences`` through ``compute_advantage``) and how many calls reached the model
(``generate_calls``); the wall time is the whole command, verl's imports and set-up included.

    python benchmarks/bench_replay_verl.py                     # 8 questions x 4 rollouts
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "sample_runs" / "make_verl_run.py"


def run(argv: list[str]) -> tuple[float, dict[str, float]]:
    """(wall seconds, the job's JOB line as numbers) of a command."""
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[:6])} ...: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JOB "))
    return took, {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlreplay-bench-replay-verl-"))
    job = [sys.executable, str(SCRIPT), "--job", "--steps=1", f"--questions={args.questions}"]
    job += [f"--n={args.n}", "--val-questions=0", f"--workdir={root / 'work'}"]
    rlreplay = [sys.executable, "-m", "rlreplay"]
    try:
        rows = []
        live = run([*rlreplay, "record", "--framework", "verl", "--out", str(root / "live"), "--", *job])
        rows.append(("live (recorded)", *live))
        for serve in ("llm", "agent"):
            out = root / f"replay-{serve}"
            argv = [*rlreplay, "replay", str(root / "live"), "--serve", serve, "--out", str(out), "--", *job]
            rows.append((f"replayed, --serve {serve}", *run(argv)))
        print(f"one step, {args.questions} questions x {args.n} rollouts")
        print("| | wall time (command) | step (rollout_s) | calls reaching the model | step / live |")
        print("|---|---:|---:|---:|---:|")
        base = rows[0][2]["rollout_s"]
        for name, wall, job_line in rows:
            calls = int(job_line["generate_calls"])
            step = job_line["rollout_s"]
            print(f"| {name} | {wall:.1f} s | {step:.2f} s | {calls} | {step / base:.2f}x |")
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
