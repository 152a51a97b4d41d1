"""``--engine``: what it refuses in one line (no cluster, a cluster not there, an unknown engine),
and how a run is cut into parts (consecutive steps, by the bytes of their span files)."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
from support import free_port, rlreplay_proc

SHOWCASE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-arith-smollm2"


_rlreplay = partial(rlreplay_proc, drop=("RAY_ADDRESS",))


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--engine", "ray"], {}, "--engine ray: no Ray cluster named: pass --ray-address"),
        (
            ["--engine", "ray"],
            {"RAY_ADDRESS": "127.0.0.1:{port}"},
            "no Ray cluster reachable at 127.0.0.1:{port}",
        ),
        (
            ["--engine", "ray", "--ray-address", "127.0.0.1:{port}"],
            {},
            "no Ray cluster reachable at 127.0.0.1",
        ),
        (["--engine", "spark"], {}, "--engine 'spark': one of local, ray"),
        (["--ray-address", "127.0.0.1:1"], {}, "--ray-address goes with --engine ray"),
    ],
)
def test_an_engine_that_cannot_run_is_one_line(args: list[str], env: dict[str, str], said: str) -> None:
    port = str(free_port())
    args = [a.replace("{port}", port) for a in args]
    env = {k: v.replace("{port}", port) for k, v in env.items()}
    for command in (["audit"], ["mismatch"], ["ls", "--grep", "1"], ["export", "--out", "x.jsonl"]):
        proc = _rlreplay(command[0], str(SHOWCASE), *command[1:], *args, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and proc.stdout == "", (command, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("rlreplay: error: "), (command, proc.stderr)
        assert said.replace("{port}", port) in lines[0], (command, lines[0])


def test_parts_are_consecutive_steps_sized_by_bytes(tmp_path: Path) -> None:
    import numpy as np

    from rlreplay.engine import plan
    from rlreplay.read.open import open_run

    run = open_run(shutil.copytree(SHOWCASE, tmp_path / "run"))
    listing = run.trajectories()
    steps = listing["step"].to_pylist()
    size = {}
    for step in sorted(set(steps)):
        size[step] = sum(
            p.stat().st_size for p in (tmp_path / "run" / "spans" / f"step={step}").rglob("*.parquet")
        )
    for target in (1, max(size.values()), 2 * max(size.values()), sum(size.values())):
        parts = [p.rows for p in plan(run, listing, target, cut=False)]
        assert np.array_equal(np.concatenate(parts), np.arange(listing.num_rows))  # every row, in order
        for rows in parts:
            held = sorted({steps[r] for r in rows})
            assert sum(size[s] for s in held) <= target or len(held) == 1
            assert {r for r, s in enumerate(steps) if s in held} == set(rows.tolist())  # whole steps
        if target == 1:
            assert len(parts) == len(size)
        if target == sum(size.values()):
            assert len(parts) == 1


def test_a_step_larger_than_a_part_is_cut_between_samples(tmp_path: Path) -> None:
    """A step of more bytes than a part: pieces of consecutive rows, about the part's size each,
    never two pieces holding rollouts of one sample; the step's first piece owns its files."""
    import numpy as np

    from rlreplay.engine import plan
    from rlreplay.read.open import open_run

    run = open_run(shutil.copytree(SHOWCASE, tmp_path / "run"))
    listing = run.trajectories()
    steps = listing["step"].to_pylist()
    samples = list(zip(steps, listing["sample_index"].to_pylist()))
    size = {
        s: sum(p.stat().st_size for p in (tmp_path / "run" / "spans" / f"step={s}").rglob("*.parquet"))
        for s in set(steps)
    }
    for target in (1, min(size.values()) // 3):
        parts = plan(run, listing, target)
        assert np.array_equal(np.concatenate([p.rows for p in parts]), np.arange(listing.num_rows))
        held_by: dict = {}
        for k, part in enumerate(parts):
            assert np.array_equal(part.rows, np.arange(part.rows[0], part.rows[-1] + 1))  # consecutive
            assert len({steps[r] for r in part.rows}) == 1 and part.owner is not None
            for r in part.rows:
                held_by.setdefault(samples[r], set()).add(k)
        assert all(len(ks) == 1 for ks in held_by.values())  # a sample's rollouts in one piece
        for step in size:  # each step: its first piece owns it
            owners = [p.owner for p in parts if steps[p.rows[0]] == step]
            assert owners[0] is True and not any(owners[1:]) and len(owners) > 1
        per_sample = len(held_by)
        if target == 1:  # a piece a sample
            assert len(parts) == per_sample
        else:  # about 3 pieces a step (cut only between samples)
            assert len(size) * 3 <= len(parts) < per_sample
    whole = plan(run, listing, max(size.values()))
    assert [p.owner for p in whole] == [None] * len(size)  # no step larger: whole steps


def test_workers_without_rlreplay_are_one_line_naming_it(tmp_path: Path) -> None:
    """A one-node Ray cluster whose workers cannot import rlreplay (as where it is not installed)."""
    from ray.cluster_utils import Cluster

    blocked = Path(__file__).resolve().parents[1] / "blocked_imports"
    without = {"PYTHONPATH": str(blocked), "RLREPLAY_README_BLOCKED": "rlreplay"}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, "env_vars": without}
    )
    try:
        cluster.wait_for_nodes()
        proc = _rlreplay("audit", str(SHOWCASE), "--engine", "ray", "--ray-address", cluster.address)
    finally:
        cluster.shutdown()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith("rlreplay: error: --engine ray: the cluster's workers cannot import rlreplay")


@pytest.mark.parametrize("by", ["step", "token", "position", "probability", "rollout", "worker"])
def test_mismatch_pieces_made_apart_fold_into_the_same_report(by: str, tmp_path: Path) -> None:
    """Each part of the run digested on its own (as a Ray task does), its rows numbered back into
    the listing, then folded in order: every figure of the report as the one-pass report's."""
    import orjson
    import pyarrow as pa

    from rlreplay.engine import plan
    from rlreplay.format import arrow_ops as ops
    from rlreplay.mismatch.report import LISTING_COLUMNS, compute, digest
    from rlreplay.mismatch.tokens import Counts
    from rlreplay.read.open import open_run

    run = open_run(shutil.copytree(SHOWCASE, tmp_path / "run"))
    listing = run.trajectories().select(LISTING_COLUMNS)
    whole = compute(run, listing, by=by)
    counts, pieces = Counts(), []
    for rows in (p.rows for p in plan(run, listing, 1, cut=False)):  # a part a step
        for piece in digest(run, ops.take(listing, pa.array(rows)), by, None, counts):
            piece.rows = rows[piece.rows]
            pieces.append(piece)
    apart = compute(run, listing, by=by, pieces=pieces, counts=counts)

    def said(report) -> bytes:
        parts = (report.steps, report.buckets, report.worst_rollouts, report.worst_tokens, report.notes)
        return orjson.dumps(parts, option=orjson.OPT_SERIALIZE_NUMPY)

    assert len(plan(run, listing, 1, cut=False)) == 6 and said(apart) == said(whole)
    assert orjson.dumps(apart.largest_gaps.tolist()) == orjson.dumps(whole.largest_gaps.tolist())


@pytest.mark.parametrize("by", ["step", "token", "position", "probability", "entropy", "turn", "rollout"])
@pytest.mark.parametrize("target", [1, 14_000])
def test_mismatch_pieces_of_steps_cut_between_samples_fold_into_the_same_report(
    by: str, target: int, tmp_path: Path
) -> None:
    """Steps cut into pieces (a piece a sample, or 3-4 a step), each digested on its own as a Ray
    task does, folded in order: every figure of the report as the one-pass report's, the |Δ|
    percentile and the token buckets' sums included, float for float."""
    import orjson
    import pyarrow as pa

    from rlreplay.engine import plan
    from rlreplay.format import arrow_ops as ops
    from rlreplay.mismatch.report import LISTING_COLUMNS, compute, digest, kept_too_few, same_step
    from rlreplay.mismatch.tokens import Counts
    from rlreplay.read.open import open_run

    run = open_run(shutil.copytree(SHOWCASE, tmp_path / "run"))
    listing = run.trajectories().select(LISTING_COLUMNS)
    whole = compute(run, listing, by=by)
    parts = plan(run, listing, target)
    assert len(parts) >= 3 * 6 and all(p.owner is not None for p in parts)
    counts, pieces = Counts(), []
    for p in parts:
        for piece in digest(run, ops.take(listing, pa.array(p.rows)), by, None, counts, keep=0):
            piece.rows = p.rows[piece.rows]
            pieces.append(piece)
    steps: list[list] = []
    for piece in pieces:
        if steps and same_step(steps[-1][0].step, piece.step):
            steps[-1].append(piece)
        else:
            steps.append([piece])
    assert len(steps) == 6 and not any(kept_too_few(s) for s in steps)
    assert all(not piece.splits[False][0].whole for piece in pieces)  # each kept a part of its |Δ|
    apart = compute(run, listing, by=by, pieces=pieces, counts=counts)

    def said(report) -> bytes:
        parts = (report.steps, report.buckets, report.worst_rollouts, report.worst_tokens, report.notes)
        return orjson.dumps(parts, option=orjson.OPT_SERIALIZE_NUMPY)

    assert said(apart) == said(whole)
    assert orjson.dumps(apart.largest_gaps.tolist()) == orjson.dumps(whole.largest_gaps.tolist())
