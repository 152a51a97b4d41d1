"""Writer-thread CPU per recorded id, in one process, without the rest of the recorder around it.

Realistic spans (as ``bench_scale.py`` makes them: ~8k-token trajectories over 2-5 model calls whose
prompt grows by the previous response and a 40-token observation, float32 log-probs as Python
floats, an agent span repeating every turn) are made by the real ``trace_op`` into a list, then fed
through exactly what the writer thread runs: ``encode_row`` with the trajectory prefix cache,
``StepBuffer``/``take_batch`` and ``PartialWriter.write`` (zstd Arrow IPC). Reports CPU-s per
million recorded ids (ids under keys ending in ``ids``, once per span that holds them, as
``bench_scale.py`` counts them), split by phase, and optionally a cProfile of the whole.

    python benchmarks/bench_writer.py [--trajectories 64] [--tokens 8000] [--batch-rows 64] [--profile]
    python benchmarks/bench_writer.py --against OLD_TREE    # side by side with another source tree
    python benchmarks/bench_writer.py --pool DIR/pool.json  # real Qwen3 ids (bench_scale.py --keep DIR)
    python benchmarks/bench_writer.py --idle-ms 30          # + the same work, idle 30 ms before each span
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from agent_workload import make_agent_loop


def make_events(
    trajectories: int, tokens: int, seed: int = 0, pool_file: str | None = None
) -> tuple[list[Any], int]:
    """The span events of ``trajectories`` agent loops, and the ids they record."""
    import rlreplay
    from rlreplay.recorder import api as recorder
    from rlreplay.recorder import writer

    events: list[Any] = []
    rec = writer.Recorder(writer.RecorderConfig(run_dir=Path(tempfile.mkdtemp())))
    rec.on_end = events.append  # type: ignore[method-assign]
    recorder._recorder, recorder._env_checked = rec, True
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    pool = (
        json.loads(Path(pool_file).read_text())
        if pool_file
        else nprng.integers(0, 151_000, 2_000_000).tolist()
    )

    run_loop = make_agent_loop(rlreplay, pool, rng, nprng)

    async def one(i: int) -> None:
        total = int(tokens * rng.uniform(0.8, 1.2))
        async with rlreplay.trajectory(step=0, sample_index=i // 4, rollout_n=i % 4):
            await run_loop(str(i), total, rng.randint(2, 5))

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(trajectories)))

    asyncio.run(main())
    recorder._recorder = None
    return events, sum(_ids(e) for e in events)


def _ids(event: Any) -> int:
    """Recorded ids as ``num_tokens`` counts them: lists under keys ending in ``ids``."""
    kwargs, result = event.kwargs, event.result
    lists = [*kwargs.items(), *(result.items() if type(result) is dict else ())]
    return sum(len(v) for k, v in lists if k.endswith("ids") and type(v) is list)


def write_all(events: list[Any], out: Path, batch_rows: int, idle_s: float = 0.0) -> dict[str, float]:
    """What the writer thread does with ``events``; CPU seconds per phase. ``idle_s``: the thread
    sleeps that long before each span (not timed), as the writer in a paced rollout wakes to a few."""
    from rlreplay.recorder import rows, writer
    from rlreplay.shards.live import PartialWriter

    config = writer.RecorderConfig(run_dir=out)
    prefixes = rows.PrefixCache()
    buf = rows.StepBuffer()
    writer = PartialWriter(out / "step=0")
    clock = time.process_time
    encode = batch = write = 0.0

    def check(problems: list) -> None:
        if problems:
            raise AssertionError(problems[0].message)

    for event in events:
        if idle_s:
            time.sleep(idle_s)
        t0 = clock()
        row, nbytes, problems = rows.encode_row(event, config, "w", prefixes)
        check(problems)
        buf.append(row, nbytes)
        t1 = clock()
        encode += t1 - t0
        if buf.rows >= batch_rows:
            b, problems = buf.take_batch()
            check(problems)
            t2 = clock()
            writer.write(b)
            t3 = clock()
            batch += t2 - t1
            write += t3 - t2
    if buf.rows:
        t1 = clock()
        b, problems = buf.take_batch()
        check(problems)
        t2 = clock()
        writer.write(b)
        batch += t2 - t1
        write += clock() - t2
    writer.close()
    return {"encode_row": encode, "take_batch": batch, "ipc write": write}


def measure(args: argparse.Namespace, idle_s: float = 0.0) -> tuple[int, int, dict[str, float]]:
    """(spans, recorded ids, best CPU-s per phase) of the rlreplay this process imports."""
    import pyarrow as pa

    pa.array([0.5])  # one-time imports, as the writer's warm-up pays them
    events, n_ids = make_events(args.trajectories, args.tokens, pool_file=args.pool)
    best: dict[str, float] | None = None
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            phases = write_all(events, Path(tmp), args.batch_rows, idle_s)
        if best is None or sum(phases.values()) < sum(best.values()):
            best = phases
    assert best is not None
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            profile = cProfile.Profile()
            profile.enable()
            write_all(events, Path(tmp), args.batch_rows)
            profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return len(events), n_ids, best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--batch-rows", type=int, default=64, help="rows per written batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--pool", help="real token ids (a JSON list, as bench_scale.py --keep writes pool.json)"
    )
    parser.add_argument("--against", help="another rlreplay source tree (an older commit's), side by side")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="also time the same work with the thread idle this long before each span, side by side",
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args)))
        return
    columns = {}
    if args.against:
        argv = [sys.executable, __file__, "--json", *sys.argv[1:]]
        argv.remove("--against")
        argv.remove(args.against)
        env = {**os.environ, "PYTHONPATH": str(Path(args.against).resolve())}
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        columns[args.against] = json.loads(out.strip().splitlines()[-1])[2]
    spans, n_ids, columns["this tree"] = measure(args)
    if args.idle_ms:
        columns[f"{args.idle_ms:g} ms idle before each span"] = measure(args, args.idle_ms / 1000)[2]
    names = list(columns)
    print(f"{spans} spans, {n_ids:,} recorded ids, {args.batch_rows} rows per batch, best of {args.repeat}")
    ratios = ([f"{args.against} / this tree"] if args.against else []) + (
        ["idle / this tree"] if args.idle_ms else []
    )
    print("| CPU-s per million recorded ids | " + " | ".join(names + ratios) + " |")
    print("|---|" + "---:|" * (len(names) + len(ratios)))
    for phase in [*columns["this tree"], "total"]:
        values = {n: sum(c.values()) if phase == "total" else c[phase] for n, c in columns.items()}
        cells = [f"{v / n_ids * 1e6:.3f}" for v in values.values()]
        base = values["this tree"] or float("nan")
        if args.against:
            cells.append(f"{values[args.against] / base:.2f}x")
        if args.idle_ms:
            cells.append(f"{values[names[-1]] / base:.2f}x")
        print(f"| {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
