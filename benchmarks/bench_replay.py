"""Replay and compare: serving one recorded step against running it live, and ``compare`` over two runs
against the same comparison done with DuckDB over the span files.

usage: python benchmarks/bench_replay.py [--steps 20] [--per-step 256] [--replay-trajectories 1024]

- replay: a generic-API agent loop (an agent op, two model calls, a parser and a tool per
  trajectory; the model is instant, so the figure is rlreplay's own cost) recorded once, then run
  again with ``rlreplay.replay(serve=("llm",))``; wall time of each and the model calls that reached
  the engine.
- compare: two runs of STEPS x PER_STEP trajectories, B with one model reply changed in every 10th
  trajectory. ``compare_runs`` (pairs, same or not, first difference) against one DuckDB query that
  groups each trajectory's spans in order into one string and joins A and B on the keys (same or
  not only). Wall time and peak RSS growth, each in a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rlreplay

ENGINE_CALLS = [0]


@rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
async def generate(prompt_ids: list[int], sampling_params: dict) -> dict:
    ENGINE_CALLS[0] += 1
    rng = random.Random(f"{sampling_params['seed']}:{len(prompt_ids)}:{prompt_ids[-1]}")
    ids = [rng.randint(10, 30000) for _ in range(64)]
    return {"token_ids": ids, "log_probs": [-0.5] * len(ids), "stop_reason": "stop"}


@rlreplay.trace_op(name="ToolParser.extract_tool_calls", kind="parser")
async def parse(token_ids: list[int]) -> list:
    return [{"name": "calc", "arguments": {"x": token_ids[-1]}}]


@rlreplay.trace_op(name="CalcTool.execute", kind="tool")
async def execute(parameters: dict) -> dict:
    return {"text": f"result={parameters['x'] * 2}"}


@rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
async def agent(sample: int, seed: int) -> dict:
    prompt = [1, *range(100 + sample % 50, 164 + sample % 50)]
    response: list[int] = []
    for turn in range(2):
        out = await generate(prompt + response, {"seed": seed if turn == 1 else 0})
        response += out["token_ids"]
        result = await execute((await parse(out["token_ids"]))[0]["arguments"])
        response += [3, len(result["text"]), 4]
    return {"prompt_ids": prompt, "response_ids": response, "reward_score": float(response[-5] % 2)}


def run_loop(steps: int, per_step: int, changed_every: int = 0) -> None:
    async def go() -> None:
        for step in range(steps):
            for sample in range(per_step):
                seed = 1 if changed_every and sample % changed_every == 0 else 0
                async with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=0):
                    await agent(sample, seed)

    asyncio.run(go())


def record(run_dir: Path, steps: int, per_step: int, changed_every: int = 0) -> float:
    rlreplay.init(run_dir, worker="bench")
    start = time.perf_counter()
    run_loop(steps, per_step, changed_every)
    elapsed = time.perf_counter() - start
    rlreplay.close()
    return elapsed


def bench_replay(base: Path, n: int) -> dict:
    live = record(base / "live", 1, n)
    calls_live = ENGINE_CALLS[0]
    rlreplay.init(base / "replayed", worker="bench")
    with rlreplay.replay(base / "live", serve=("llm",)):
        start = time.perf_counter()
        run_loop(1, n)
        served = time.perf_counter() - start
    rlreplay.close()
    return {
        "live_s": live,
        "replay_s": served,
        "engine_live": calls_live,
        "engine_replay": ENGINE_CALLS[0] - calls_live,
    }


COMPARE = """
import sys, time, resource, json
a, b = sys.argv[1], sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if sys.argv[3] == "rlreplay":
    import rlreplay
    from rlreplay.compare import compare_runs
    from rlreplay.read.run import skip_pandas
    skip_pandas()  # as the CLI does
    pairs = list(compare_runs(rlreplay.open_run(a), rlreplay.open_run(b)))
    same = sum(p.same for p in pairs)
else:
    import duckdb
    con = duckdb.connect()
    body = '''
      select step, sample_index, rollout_n, validate,
             string_agg(name || kind || coalesce(inputs, '') || coalesce(output, '')
                        || coalesce(cast(token_ids as varchar), ''), '|' order by start_ns) as body
      from read_parquet('{run}/spans/*/*/*.parquet', union_by_name=true)
      where kind != 'signals' group by all'''
    same, total = con.execute(
        f"select count(*) filter (where a.body = b.body), count(*) from ({body.format(run=a)}) a "
        f"join ({body.format(run=b)}) b using (step, sample_index, rollout_n, validate)"
    ).fetchone()
    pairs = range(total)
elapsed = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": elapsed, "rss_mb": (peak - before) / 1024, "pairs": len(pairs), "same": same}))
"""


def bench_compare(base: Path, steps: int, per_step: int) -> dict:
    record(base / "a", steps, per_step)
    record(base / "b", steps, per_step, changed_every=10)
    out = {}
    for side in ("rlreplay", "duckdb"):
        proc = subprocess.run(
            [sys.executable, "-c", COMPARE, str(base / "a"), str(base / "b"), side],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise SystemExit(f"{side}: {proc.stderr[-2000:]}")
        out[side] = json.loads(proc.stdout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-step", type=int, default=256)
    parser.add_argument("--replay-trajectories", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        replay = bench_replay(base, args.replay_trajectories)
        print(
            f"replay of one step ({args.replay_trajectories} trajectories): live {replay['live_s']:.2f} s "
            f"({replay['engine_live']} engine calls), replay {replay['replay_s']:.2f} s "
            f"({replay['engine_replay']} engine calls); "
            f"replay / live {replay['replay_s'] / replay['live_s']:.2f}x"
        )
        result = bench_compare(base, args.steps, args.per_step)
        r, d = result["rlreplay"], result["duckdb"]
        print(
            f"compare {args.steps} x {args.per_step} trajectories: rlreplay {r['s']:.2f} s, "
            f"+{r['rss_mb']:.0f} MB ({r['same']} same of {r['pairs']}); DuckDB {d['s']:.2f} s, "
            f"+{d['rss_mb']:.0f} MB ({d['same']} same of {d['pairs']}); "
            f"rlreplay / DuckDB {r['s'] / d['s']:.2f}x"
        )
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
