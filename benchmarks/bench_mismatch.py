"""Mismatch benchmark: ``rlreplay mismatch RUN --json`` over a whole run of STEPS x PER_STEP
trajectories of ~2,000 response tokens, time and peak memory, against DuckDB computing the same
per-step aggregates from the same span files (the numbers are checked equal).

The run: one step of PER_STEP trajectories recorded with the real recorder through the generic
API, as the README tells a user to record the trainer's per-token log-probs (an agent span whose
output holds response_ids, response_mask and response_logprobs: three model turns with two tool
turns between them; ``record_signals(..., output={"old_log_probs": ...})``), then that step's spans
written again as STEPS steps over two workers (new trajectory ids a step), as bench_compare.py
writes its runs. Peak memory is each process's maximum resident set size.

    python benchmarks/bench_mismatch.py                              # 200 x 1,024 (the issue's size)
    python benchmarks/bench_mismatch.py --steps 10 --per-step 256    # smaller
    python benchmarks/bench_mismatch.py --keep DIR                   # keep (or reuse) the run in DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_query import as_step  # tests/ on the path

from rlreplay.shards.layout import partition_dir
from rlreplay.shards.seal import write_sealed

ROOT = Path(__file__).resolve().parent.parent
TOKENS = (1_800, 2_200)  # response length, uniform
TOOL_TOKENS = 40  # each of the two tool turns
WORKERS = ("w0", "w1")


def record_step(run_dir: Path, per_step: int, seed: int = 0, tokens: tuple[int, int] = TOKENS) -> None:
    """One step of ``per_step`` trajectories of ``tokens`` response tokens (uniform) recorded with the
    real recorder (generic API)."""
    import rlreplay
    from rlreplay.recorder.signals import record_signals

    rng = np.random.default_rng(seed)

    @rlreplay.trace_op(name="AgentLoop.run", kind="agent")
    async def agent(n: int) -> dict:
        ids = rng.integers(10, 150_000, n).tolist()
        mask = np.ones(n, dtype=np.int64)
        third = n // 3
        mask[third : third + TOOL_TOKENS] = 0
        mask[2 * third : 2 * third + TOOL_TOKENS] = 0
        logprobs = np.where(mask == 1, -rng.exponential(0.7, n), 0.0).astype(np.float32)
        return {
            "prompt_ids": rng.integers(10, 150_000, 256).tolist(),
            "response_ids": ids,
            "response_mask": mask.tolist(),
            "response_logprobs": logprobs.tolist(),
        }

    async def one(i: int) -> None:
        n = int(rng.integers(*tokens))
        async with rlreplay.trajectory(step=0, sample_index=i // 8, rollout_n=i % 8) as traj:
            out = await agent(n)
        rollout = np.asarray(out["response_logprobs"], dtype=np.float64)
        trainer = (rollout + rng.normal(0.0, 0.02, n)).astype(np.float32)
        record_signals(
            traj.id,
            step=0,
            sample_index=i // 8,
            rollout_n=i % 8,
            validate=False,
            reward=float(rng.random() > 0.5),
            output={"old_log_probs": trainer.tolist()},
        )

    rlreplay.init(run_dir, experiment="bench-mismatch", worker="w0")
    for i in range(per_step):
        asyncio.run(one(i))
    rlreplay.close()


def run_name(steps: int, per_step: int, tokens: tuple[int, int] = TOKENS) -> str:
    return f"run-{steps}x{per_step}" + ("" if tokens == TOKENS else f"x{tokens[0]}-{tokens[1]}")


def build_run(root: Path, steps: int, per_step: int, tokens: tuple[int, int] = TOKENS) -> Path:
    """The recorded step written again as ``steps`` steps over two workers."""
    import rlreplay

    template_dir = root / "template"
    record_step(template_dir, per_step, tokens=tokens)
    template = rlreplay.open_run(template_dir).spans(step=0)
    # two workers: a trajectory's spans stay together
    odd = pc.equal(pc.utf8_slice_codeunits(template["trajectory_id"], 31), "1")
    for digit in "3579bdf":
        odd = pc.or_(odd, pc.equal(pc.utf8_slice_codeunits(template["trajectory_id"], 31), digit))
    worker = pc.if_else(odd, WORKERS[1], WORKERS[0])
    template = template.set_column(template.column_names.index("worker"), "worker", worker)
    run_dir = root / run_name(steps, per_step, tokens)
    for step in range(steps):
        table = as_step(template, step)
        for name in WORKERS:
            folder = partition_dir(run_dir, step, name)
            folder.mkdir(parents=True, exist_ok=True)
            write_sealed(table.filter(pc.equal(table["worker"], name)), folder / f"part-bench-{step}.parquet")
    shutil.copy(template_dir / "run.json", run_dir / "run.json")
    shutil.rmtree(template_dir)
    return run_dir


MEASURE = """
import resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
took = time.perf_counter() - t
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
sys.stdout.write(f"{took} {usage.ru_utime + usage.ru_stime} {usage.ru_maxrss} {proc.returncode}\\n")
sys.stdout.buffer.write(proc.stdout)
"""


def measure(argv: list[str]) -> tuple[float, float, float, int, bytes]:
    """(wall seconds, CPU seconds, peak MB, exit code, stdout) of ``argv`` as its own process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv], capture_output=True, check=True, cwd=ROOT
    ).stdout
    head, _, body = out.partition(b"\n")
    took, cpu, rss_kb, rc = head.split()
    return float(took), float(cpu), int(rss_kb) / 1024, int(rc), body


# --- the same per-step aggregates, straight in DuckDB over the span files ------------------------

DUCKDB_SQL = """
WITH a AS (
    SELECT trajectory_id, step, validate, token_masks AS mask, token_logprobs AS roll
    FROM read_parquet('{files}') WHERE kind = 'agent'),
s AS (
    SELECT trajectory_id, arg_max(token_logprobs, end_ns) AS old
    FROM read_parquet('{files}') WHERE kind = 'signals' AND len(token_logprobs) > 0
    GROUP BY trajectory_id),
tok AS (
    SELECT a.step, a.validate, a.trajectory_id, unnest(a.mask) AS m, unnest(a.roll) AS r, unnest(s.old) AS o
    FROM a JOIN s USING (trajectory_id)),
c AS (
    SELECT step, validate, trajectory_id, o::DOUBLE AS o, r::DOUBLE AS r, o::DOUBLE - r::DOUBLE AS lr
    FROM tok WHERE m = 1),
per_token AS (
    SELECT step, validate, count(*) AS tokens,
        -sum(lr) / (count(*) + 1e-8) AS kl,
        sum(exp(lr) - lr - 1) / (count(*) + 1e-8) AS k3_kl,
        sum(exp(2 * least(greatest(lr, -20), 20))) / (count(*) + 1e-8) - 1 AS chi2_token,
        avg(abs(lr)) AS logprob_diff_mean,
        quantile_cont(abs(lr), 0.99) AS logprob_diff_p99,
        max(abs(lr)) AS logprob_diff_max,
        avg(exp(abs(lr))) AS token_mult_prob_error,
        count(*) FILTER (lr > ln(2)) / (count(*) + 1e-8) AS tis_token_frac_high,
        count(*) FILTER (lr < ln(0.5) OR lr > ln(5)) / (count(*) + 1e-8) AS icepop_token_frac_out
    FROM c GROUP BY step, validate),
seq AS (
    SELECT step, validate, trajectory_id, count(*) AS n, sum(o) AS so, sum(r) AS sr, sum(lr) AS slr,
        max(abs(lr)) AS mx
    FROM c GROUP BY step, validate, trajectory_id),
per_seq AS (
    SELECT step, validate, count(*) AS sequences,
        avg(exp(-so / (n + 1e-8))) AS training_ppl,
        avg(exp(-sr / (n + 1e-8))) AS rollout_ppl,
        avg(sr / (n + 1e-8) - so / (n + 1e-8)) AS log_ppl_diff,
        avg(exp(2 * least(greatest(slr, -20), 20))) - 1 AS chi2_seq,
        quantile_cont(mx, 0.5) AS seq_logprob_diff_max_p50,
        quantile_cont(mx, 0.9) AS seq_logprob_diff_max_p90,
        quantile_cont(mx, 0.99) AS seq_logprob_diff_max_p99
    FROM seq GROUP BY step, validate)
SELECT * FROM per_token JOIN per_seq USING (step, validate) ORDER BY step, validate
"""
DUCKDB_SCRIPT = """
import json, sys
import duckdb
con = duckdb.connect()
con.execute("SET enable_progress_bar = false")  # it draws on stdout
cursor = con.execute(sys.argv[1])
names = [d[0] for d in cursor.description]
for row in cursor.fetchall():
    print(json.dumps(dict(zip(names, row))))
"""


def same_numbers(ours: list[dict], theirs: list[dict]) -> int:
    """Check DuckDB's numbers equal rlreplay's; returns the numbers compared."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    compared = 0
    for a, b in zip(ours, theirs):
        assert (a["step"], a["validate"]) == (b["step"], b["validate"])
        for name, value in b.items():
            if name in ("step", "validate"):
                continue
            assert math.isclose(a[name], value, rel_tol=1e-6, abs_tol=1e-9), (a["step"], name, a[name], value)
            compared += 1
    return compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--keep", type=Path, help="build the run here (or use the one already there)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    run_dir = root / f"run-{args.steps}x{args.per_step}"
    try:
        if not run_dir.exists():
            root.mkdir(parents=True, exist_ok=True)
            run_dir = build_run(root, args.steps, args.per_step)
        files = sorted(run_dir.glob("spans/*/*/*.parquet"))
        size = sum(f.stat().st_size for f in files)
        sql = DUCKDB_SQL.format(files=f"{run_dir}/spans/*/*/*.parquet")
        # one untimed pass: the files in the page cache for both
        measure([sys.executable, "-m", "rlreplay", "mismatch", str(run_dir), "--json"])
        ours_s, ours_cpu, ours_mb, rc, out = measure(
            [sys.executable, "-m", "rlreplay", "mismatch", str(run_dir), "--json"]
        )
        assert rc == 0, rc
        theirs_s, theirs_cpu, theirs_mb, rc, duck = measure([sys.executable, "-c", DUCKDB_SCRIPT, sql])
        assert rc == 0, rc
        ours = [json.loads(line) for line in out.splitlines()]
        theirs = [json.loads(line) for line in duck.splitlines()]
        compared = same_numbers(ours, theirs)
        tokens = sum(r["tokens"] for r in ours)
        print(
            f"run: {args.steps} steps x {args.per_step} trajectories, {tokens:,} model tokens, "
            f"{len(files)} span files, {size / 1e6:,.0f} MB; {compared} numbers equal in both"
        )
        print(
            "| whole run, per step | rlreplay mismatch --json | DuckDB, same aggregates | DuckDB / rlreplay |"
        )
        print("|---|---:|---:|---:|")
        print(f"| time | {ours_s:.1f} s | {theirs_s:.1f} s | {theirs_s / ours_s:.2f}x |")
        print(
            f"| CPU (user + system) | {ours_cpu:.1f} s | {theirs_cpu:.1f} s | {theirs_cpu / ours_cpu:.2f}x |"
        )
        print(f"| peak memory | {ours_mb:,.0f} MB | {theirs_mb:,.0f} MB | {theirs_mb / ours_mb:.2f}x |")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
