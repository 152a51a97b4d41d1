"""Watch benchmark: ``rlreplay watch`` beside a job that ``rlreplay record`` records, against
``rlreplay audit --step S`` on the same steps.

The job is the tests' generic job (``tests/watch/watch_job.py``: per trajectory two model calls and
a tool call; from the middle step on, half the rollouts repeat a 4-gram and their tool fails).
For each step: the delay from its newest shard's seal (the shard file's mtime) to watch's line for
it, the CPU time watch spent on it (its ``cpu_s``: the step's listing, every audit check, the
mismatch figures, the trend checks), and, once the run ended, the wall and CPU time of a fresh
``rlreplay audit RUN --step S --json`` process on the same step (start-up included: what a user
polling with ``audit`` would pay per step). Watch's own polling interval bounds its delay from below.
The watch process's whole CPU time and peak memory (maximum resident set size) close the report.

    python benchmarks/bench_watch.py                                  # 6 steps of 16 x 8
    python benchmarks/bench_watch.py --steps 4 --samples 4 --rollouts 4 --interval 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "watch" / "watch_job.py"


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.2, help="watch --interval")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")}
    rlreplay = [sys.executable, "-m", "rlreplay"]
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        run, control = Path(tmp) / "run", Path(tmp) / "control"
        control.mkdir()
        (control / "stop").touch()  # the job ends after its last step
        job = [sys.executable, str(JOB), str(args.steps), str(args.steps // 2), str(control)]
        record = subprocess.Popen(
            [*rlreplay, "record", "--out", str(run), "--", *job, str(args.samples), str(args.rollouts)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not (run / "run.json").exists():
            time.sleep(0.02)
        watch = subprocess.Popen(
            [*rlreplay, "watch", str(run), "--json", "--interval", str(args.interval)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert watch.stdout is not None
        out = watch.stdout.read()
        _, status, usage = os.wait4(watch.pid, 0)  # the watch process's own CPU and peak memory
        watch.returncode = os.waitstatus_to_exitcode(status)
        watch_cpu, watch_peak_mb = usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024
        record.wait()
        events = [json.loads(line) for line in out.splitlines()]
        steps = [e for e in events if e["event"] == "step"]
        alerts = [e for e in events if e["event"] == "alert"]
        rows = []
        for e in steps:
            before, start = child_cpu(), time.perf_counter()
            audit = subprocess.run(
                [*rlreplay, "audit", str(run), "--step", str(e["step"]), "--json"],
                env=env,
                capture_output=True,
                text=True,
            )
            wall, cpu = time.perf_counter() - start, child_cpu() - before
            assert audit.returncode in (0, 1), audit.stderr
            rows.append((e["step"], e["trajectories"], e["delay_s"], e["cpu_s"], wall, cpu))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; watch exit {watch.returncode}, ", end="")
    print(f"{len(alerts)} alerts at steps {sorted({a['step'] for a in alerts})}")
    print("| step | trajectories | watch: seal to line | watch: CPU for the step ", end="")
    print("| audit --step: wall | audit --step: CPU |")
    print("|---:|---:|---:|---:|---:|---:|")
    for step, n, delay, cpu, wall, audit_cpu in rows:
        print(f"| {step} | {n} | {delay:.2f} s | {cpu:.3f} s | {wall:.2f} s | {audit_cpu:.2f} s |")
    med = statistics.median
    print(
        f"| median | | {med(r[2] for r in rows):.2f} s | {med(r[3] for r in rows):.3f} s "
        f"| {med(r[4] for r in rows):.2f} s | {med(r[5] for r in rows):.2f} s |"
    )
    print(
        f"watch process, whole run: {watch_cpu:.2f} s CPU for {len(rows)} steps (start-up included), "
        f"peak memory {watch_peak_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
