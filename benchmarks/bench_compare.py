"""Compare benchmark: ``rlreplay compare`` of two 200 x 1,024-trajectory runs, time and peak memory,
against the same comparison over the span files with DuckDB, and a plain pyarrow read of every
span file (the floor: a columnar scan of both runs).

The runs: ``agent_workload.py``'s agent loop (real Qwen3 ids, 1,000-3,000 tokens, 2-5 model calls
with a tool call between them) recorded with the real recorder for BASE_STEPS steps of PER_STEP
trajectories, twice with the same seeds (A and B: equal content, their own span ids), then each
step's shards written again for STEPS steps (new trajectory ids a step). In B, every CHANGE_EVERY-th
trajectory has one token id of its last model call changed.

    python benchmarks/bench_compare.py                                  # 200 x 1,024
    python benchmarks/bench_compare.py --steps 20 --base-steps 1        # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_workload import make_agent_loop
from bench_query import as_step
from synthetic_run import plant_token_change  # tests/ (put on the path by bench_query)

from rlreplay.shards.layout import partition_dir
from rlreplay.shards.seal import write_sealed

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
took = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
sys.stdout.write(f"{took} {peak} {proc.returncode}\\n")
sys.stdout.buffer.write(proc.stdout)
"""


def measure(argv: list[str], cwd: Path = ROOT) -> tuple[float, float, int, bytes]:
    """(seconds, peak MB, exit code, stdout) of ``argv`` as its own process, started in ``cwd``."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv], capture_output=True, check=True, cwd=cwd
    ).stdout
    head, _, body = out.partition(b"\n")
    took, rss_kb, rc = head.split()
    return float(took), int(rss_kb) / 1024, int(rc), body


def record(run_dir: Path, steps: int, per_step: int) -> Path:
    """agent_workload's loop recorded with the real recorder (the same seeds give the same run)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_scale import token_pool

    import rlreplay

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import qwen_tokenizer_dir

    pool = token_pool(qwen_tokenizer_dir(), 400_000)
    rng, nprng = random.Random(0), np.random.default_rng(0)
    rlreplay.init(run_dir, experiment="bench", worker="w0")
    run_loop = make_agent_loop(rlreplay, pool, rng, nprng)

    async def one(step: int, i: int) -> None:
        async with rlreplay.trajectory(step=step, sample_index=i // 8, rollout_n=i % 8, name="agent_loop"):
            await run_loop(f"{step}-{i}", rng.randrange(1_000, 3_000), rng.randrange(2, 6))

    async def go() -> None:
        for step in range(steps):
            await asyncio.gather(*(one(step, i) for i in range(per_step)))

    asyncio.run(go())
    rlreplay.close()
    from rlreplay.format import manifest

    manifest.update_manifest(run_dir, tokenizer=str(qwen_tokenizer_dir()))
    return run_dir


def replicate(base: Path, out: Path, steps: int, change_every: int = 0) -> int:
    """``base``'s steps written again as ``steps`` steps (new trajectory ids a step); returns the
    trajectories changed."""
    import rlreplay

    run = rlreplay.open_run(base)
    base_steps = sorted(int(s) for s in run.step_partitions())
    changed = 0
    for step in range(steps):
        table = run.spans(step=base_steps[step % len(base_steps)])
        if change_every:
            table, n = plant_token_change(table, change_every)
            changed += n
        table = as_step(table, step)
        folder = partition_dir(out, step, "w0")
        folder.mkdir(parents=True, exist_ok=True)
        write_sealed(table, folder / f"part-bench-{step}.parquet")
    shutil.copy(base / "run.json", out / "run.json")
    return changed


def build_pair(
    root: Path, steps: int, base_steps: int, per_step: int, change_every: int
) -> tuple[Path, Path, int]:
    base_a, base_b = root / "base-a", root / "base-b"
    for base in (base_a, base_b):
        if not (base / "run.json").exists():  # a kept directory's recordings are used again
            record(base, base_steps, per_step)
    run_a, run_b = root / f"a-{steps}", root / f"b-{steps}"
    noted = root / f"b-{steps}-changed.txt"  # a kept pair is used again
    if noted.exists():
        return run_a, run_b, int(noted.read_text())
    for run in (run_a, run_b):
        shutil.rmtree(run, ignore_errors=True)
    replicate(base_a, run_a, steps)
    changed = replicate(base_b, run_b, steps, change_every)
    noted.write_text(str(changed))
    for run in (run_a, run_b):  # the first listing writes the run index
        subprocess.run(
            [sys.executable, "-m", "rlreplay", "ls", str(run), "--limit", "1"],
            check=True,
            capture_output=True,
        )
    return run_a, run_b, changed


DUCKDB = """
import glob, json, resource, sys, time
import duckdb
a, b = sys.argv[1], sys.argv[2]
t = time.perf_counter()
con = duckdb.connect()
con.execute("SET enable_progress_bar = false")
# each trajectory's spans in order, as one string: span ids (which differ between runs) blanked
body = '''
  select step, sample_index, rollout_n, validate,
         md5(string_agg(name || kind || coalesce(error, '')
             || coalesce(regexp_replace(inputs, '"[0-9a-f]{{16}}"', '""', 'g'), '')
             || coalesce(regexp_replace(output, '"[0-9a-f]{{16}}"', '""', 'g'), '')
             || coalesce(cast(token_ids as varchar), '') || coalesce(cast(token_logprobs as varchar), ''),
             '|' order by start_ns)) as body
  from read_parquet('{run}/spans/{part}/*/*.parquet', hive_partitioning = false)
  where kind != 'signals' group by all'''
# a step at a time, as compare reads them: the whole run at once holds every span's text in memory
same = total = 0
for part in sorted(p.rsplit("/", 1)[1] for p in glob.glob(f"{a}/spans/step=*")):
    s, n = con.execute(
        f"select count(*) filter (where a.body = b.body), count(*) from ({body.format(run=a, part=part)}) a "
        f"join ({body.format(run=b, part=part)}) b using (step, sample_index, rollout_n, validate)"
    ).fetchone()
    same, total = same + s, total + n
took = time.perf_counter() - t
print(json.dumps({"s": took, "same": same, "pairs": total}))
"""

SCAN = """
import glob, json, sys, time
import pyarrow.parquet as pq
t = time.perf_counter()
rows = 0
for run in sys.argv[1:]:
    for path in sorted(glob.glob(f"{run}/spans/*/*/*.parquet")):
        rows += pq.read_table(path).num_rows  # one file at a time, every column
print(json.dumps({"s": time.perf_counter() - t, "rows": rows}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--base-steps", type=int, default=2)
    parser.add_argument("--change-every", type=int, default=100)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rlreplay-bench-compare-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        run_a, run_b, changed = build_pair(
            root, args.steps, args.base_steps, args.per_step, args.change_every
        )
        size = sum(f.stat().st_size for f in run_a.rglob("*.parquet")) / 2**20
        print(
            f"built two runs of {args.steps} x {args.per_step} ({size:.0f} MB of span files each) in "
            f"{time.perf_counter() - t:.0f} s; {changed} trajectories changed in B",
            flush=True,
        )
        took, peak, rc, out = measure(
            [sys.executable, "-m", "rlreplay", "compare", str(run_a), str(run_b), "--json"]
        )
        assert rc == 0, rc
        pairs = [json.loads(line) for line in out.splitlines()]
        same = sum(p["same"] for p in pairs)
        print(f"rlreplay compare: {took:.1f} s, peak {peak:.0f} MB, {same} same of {len(pairs)}", flush=True)
        d_took, d_peak, rc, d_out = measure([sys.executable, "-c", DUCKDB, str(run_a), str(run_b)])
        duck = json.loads(d_out)
        print(
            f"DuckDB: {duck['s']:.1f} s in-process ({d_took:.1f} s process), peak {d_peak:.0f} MB, "
            f"{duck['same']} same of {duck['pairs']}",
            flush=True,
        )
        s_took, s_peak, rc, s_out = measure([sys.executable, "-c", SCAN, str(run_a), str(run_b)])
        scan = json.loads(s_out)
        print(f"pyarrow read of both runs' span files: {scan['s']:.1f} s, peak {s_peak:.0f} MB", flush=True)
        n = args.steps * args.per_step
        print()
        print("| | rlreplay compare | DuckDB | pyarrow read of the span files |")
        print("|---|---:|---:|---:|")
        print(
            f"| time ({args.steps} x {args.per_step} pairs) | {took:.1f} s | {d_took:.1f} s "
            f"| {s_took:.1f} s |"
        )
        print(
            f"| per pair | {took / n * 1e6:.0f} µs | {d_took / n * 1e6:.0f} µs | {s_took / n * 1e6:.0f} µs |"
        )
        print(f"| peak memory | {peak:.0f} MB | {d_peak:.0f} MB | {s_peak:.0f} MB |")
        print(f"| pairs found same (right: {n - changed:,}) | {same:,} | {duck['same']:,} | – |")
        print(f"| rlreplay / peer | | {took / d_took:.2f}x | {took / s_took:.2f}x |")
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
