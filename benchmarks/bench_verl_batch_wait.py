"""What waiting for a batch to reach disk costs ``AgentLoopWorker.generate_sequences``: verl's real
worker (tool agent loop, Hermes parser, calculator tool, scripted LLM client on CPU; 8 prompts x 2
rollouts per batch) recorded by rlreplay, with the wait and with it switched off, interleaved.

    .venv/bin/python benchmarks/bench_verl_batch_wait.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, os, statistics, sys, tempfile, time
import verl_parts
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from rlreplay import recorder
from rlreplay.recorder import writer

workdir = tempfile.mkdtemp()
model_dir = verl_parts.make_model_dir(os.path.join(workdir, "model"))
tools = verl_parts.write_tool_yaml(os.path.join(workdir, "tools.yaml"))
config = verl_parts.build_config(model_dir, tools, backend="rlreplay")
worker = AgentLoopWorker(config, llm_client=verl_parts.ScriptedLLMClient(config, model_dir))
wait = writer.Recorder.wait_written
times = {"batch waits until written": [], "no wait": []}

async def main():
    for step in range(int(sys.argv[1]) + 1):
        for mode in times:
            writer.Recorder.wait_written = wait if mode != "no wait" else (lambda self, timeout=0: True)
            started = time.perf_counter()
            await worker.generate_sequences(verl_parts.make_batch(list(range(8)), 2, step, False))
            if step:  # the first round warms up
                times[mode].append(time.perf_counter() - started)

asyncio.run(main())
base = statistics.median(times["no wait"])
print("| generate_sequences (16 trajectories) | median ms | / no wait |")
print("|---|---:|---:|")
for mode, values in times.items():
    print(f"| {mode} | {statistics.median(values) * 1000:.1f} | {statistics.median(values) / base:.2f}x |")
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    from rlreplay.cli.launch import child_env

    env = child_env(Path(tempfile.mkdtemp()) / "run", None)
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests" / "verl_scripts")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(args.rounds)], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    print(proc.stdout[proc.stdout.index("| generate_sequences") :], end="")


if __name__ == "__main__":
    main()
