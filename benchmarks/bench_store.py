"""Storage benchmark: `ls --step K` time as a run grows, and bytes per token id vs JSON lines.

Each step is the shipped sample run's step 5 (real Qwen token ids) replicated to a few hundred
trajectories, written as sealed shards exactly as the recorder seals them.

    python benchmarks/bench_store.py [--steps 10,100,1000] [--replicas 8]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import zstandard

import rlreplay
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.shards.layout import partition_dir
from rlreplay.shards.live import live_options
from rlreplay.shards.seal import write_sealed

SAMPLE_RUN = Path(__file__).resolve().parent.parent / "sample_runs" / "gsm8k-grpo-qwen3"


def step_template(sample_run: Path, replicas: int) -> pa.Table:
    """One step of spans, replicated with distinct sample indices and trajectory ids."""
    base = rlreplay.open_run(sample_run).spans(step=5)
    parts = []
    for r in range(replicas):
        offset = r * 1000
        ids = pc.binary_join_element_wise(
            pa.scalar(f"{r:04x}"), pc.utf8_slice_codeunits(base["trajectory_id"], 4), ""
        )
        part = base.set_column(base.schema.get_field_index("trajectory_id"), "trajectory_id", ids)
        part = part.set_column(
            part.schema.get_field_index("sample_index"),
            "sample_index",
            pc.add(part["sample_index"], offset),
        )
        parts.append(part)
    return pa.concat_tables(parts).cast(SPAN_SCHEMA)


def build_run(root: Path, template: pa.Table, steps: int) -> Path:
    run_dir = root / f"run-{steps}"
    workers = sorted(set(template["worker"].to_pylist()))
    by_worker = {w: template.filter(pc.equal(template["worker"], w)) for w in workers}
    for step in range(steps):
        for worker, table in by_worker.items():
            stepped = table.set_column(
                table.schema.get_field_index("step"), "step", pa.array([step] * table.num_rows, pa.int64())
            )
            folder = partition_dir(run_dir, step, worker)
            folder.mkdir(parents=True, exist_ok=True)
            write_sealed(stepped, folder / f"part-bench-{step}.parquet")
    (run_dir / "run.json").write_text('{"format_version": 1}')
    return run_dir


def time_ls(run_dir: Path, step: int, repeats: int = 5) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        rows = rlreplay.open_run(run_dir).trajectories(step=step)
        samples.append(time.perf_counter() - start)
        assert rows.num_rows and set(rows["step"].to_pylist()) == {step}
    return statistics.median(samples)


def time_full_scan(run_dir: Path, step: int) -> float:
    """The same question without partition pruning: a filtered scan over every file."""
    start = time.perf_counter()
    dataset = ds.dataset(str(run_dir / "spans"), format="parquet", schema=SPAN_SCHEMA)
    dataset.to_table(columns=["trajectory_id", "step"], filter=ds.field("step") == step)
    return time.perf_counter() - start


def time_cli(run_dir: Path, step: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rlreplay", "ls", str(run_dir), "--step", str(step), "--json"],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def jsonl(table: pa.Table) -> bytes:
    """The same spans as JSON lines, payloads as nested JSON (what a JSONL trace log holds)."""
    out = io.BytesIO()
    for row in table.to_pylist():
        for key in ("inputs", "output", "attributes"):
            row[key] = orjson.loads(row[key]) if row[key] else None
        out.write(orjson.dumps(row) + b"\n")
    return out.getvalue()


def ipc_stream_bytes(table: pa.Table) -> int:
    sink = pa.BufferOutputStream()
    options = live_options()
    with pa.ipc.new_stream(sink, SPAN_SCHEMA, options=options) as writer:
        for batch in table.to_batches(max_chunksize=64):  # about one trajectory group per batch
            writer.write_batch(batch)
    return sink.getvalue().size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", default="10,100,1000")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--sample-run", type=Path, default=SAMPLE_RUN)
    args = parser.parse_args()
    template = step_template(args.sample_run, args.replicas)
    trajectories = len(set(template["trajectory_id"].to_pylist()))
    workers = len(set(template["worker"].to_pylist()))
    print(f"per step: {trajectories} trajectories, {template.num_rows} spans, {workers} workers")

    with tempfile.TemporaryDirectory(prefix="rlreplay-bench-") as tmp:
        print(
            f"\n{'steps':>6} {'files':>6} {'build s':>8} {'ls --step K (lib)':>18} {'ls --step K (CLI)':>18} "
            f"{'unpruned scan':>14} {'scan/ls':>8}"
        )
        for steps in [int(s) for s in args.steps.split(",")]:
            start = time.perf_counter()
            run_dir = build_run(Path(tmp), template, steps)
            built = time.perf_counter() - start
            step = steps // 2
            lib = time_ls(run_dir, step)
            cli = time_cli(run_dir, step)
            scan = time_full_scan(run_dir, step)
            files = sum(1 for _ in (run_dir / "spans").rglob("*.parquet"))
            print(
                f"{steps:>6} {files:>6} {built:>8.1f} {lib * 1e3:>15.1f} ms {cli * 1e3:>15.1f} ms "
                f"{scan * 1e3:>11.1f} ms {scan / lib:>7.1f}x"
            )

    # Sizes on distinct data: the whole sample run as the recorder wrote it (no replicas).
    spans = rlreplay.open_run(args.sample_run).spans()
    sealed = sum(p.stat().st_size for p in args.sample_run.rglob("*.parquet"))
    tokens = int(pc.sum(spans["num_tokens"]).as_py())
    blob = jsonl(spans)
    raw_jsonl = len(blob)
    zstd_jsonl = len(zstandard.ZstdCompressor(level=3).compress(blob))
    live = ipc_stream_bytes(spans)
    print(f"\nthe sample run: {spans.num_rows} spans, {tokens:,} token ids")
    print(f"{'format':<34} {'bytes':>12} {'bytes/token':>12} {'JSONL / format':>15}")
    for name, size in [
        ("JSON lines", raw_jsonl),
        ("JSON lines + zstd 3", zstd_jsonl),
        ("live Arrow IPC stream (zstd 1)", live),
        ("sealed Parquet (zstd 3)", sealed),
    ]:
        print(f"{name:<34} {size:>12,} {size / tokens:>12.3f} {raw_jsonl / size:>14.1f}x")


if __name__ == "__main__":
    main()
