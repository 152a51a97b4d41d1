"""Spans a calling thread encodes itself (queue full, policy=spill) are stored as the writer stores
them: a model call's prompt that repeats the trajectory's earlier ids is kept as a reference, in the
same live file as the writer's rows, and reads back exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import rlreplay
from rlreplay.recorder.api import get_recorder


def _record(run_dir: Path, max_queue_mb: float) -> tuple[dict[str, int], list[list[int]]]:
    rng = np.random.default_rng(7)

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids: list[int]) -> dict:
        return {"token_ids": rng.integers(0, 151_000, 300).tolist()}

    prompts = []
    rlreplay.init(run_dir, worker="w", max_queue_mb=max_queue_mb, policy="spill")
    for i in range(6):
        with rlreplay.trajectory(step=0, sample_index=i):
            context = rng.integers(0, 151_000, 2_000).tolist()
            for _ in range(5):
                prompts.append(list(context))
                out = generate(context)
                context = context + out["token_ids"] + rng.integers(0, 151_000, 40).tolist()
    rec = get_recorder()
    assert rlreplay.flush()
    counters = dict(rec.counters)
    rlreplay.close()
    return counters, prompts


def _stored_ids(run_dir: Path) -> tuple[int, int]:
    """(ids stored in the token_ids column, ids recorded) over the run's sealed shards."""
    stored = recorded = 0
    for path in (run_dir / "spans").rglob("*.parquet"):
        table = pq.read_table(path, columns=["token_ids", "num_tokens"])
        stored += sum(len(v) for v in table["token_ids"].to_pylist() if v)
        recorded += sum(table["num_tokens"].to_pylist())
    return stored, recorded


def test_spilled_spans_share_prompts_like_queued_ones(tmp_path: Path) -> None:
    queued, prompts = _record(tmp_path / "queued", 64)
    spilled, prompts_again = _record(tmp_path / "spilled", 0.001)  # ~1 KB: every later span spills
    assert prompts == prompts_again
    assert queued["spilled"] == 0 and spilled["spilled"] >= 30
    assert spilled["spans"] + spilled["spilled"] == queued["spans"] == 36
    assert spilled["lost"] == spilled["dropped"] == spilled["encode_errors"] == 0

    stored_q, recorded_q = _stored_ids(tmp_path / "queued")
    stored_s, recorded_s = _stored_ids(tmp_path / "spilled")
    assert recorded_s == recorded_q
    assert stored_q < recorded_q / 2  # the growing prompts are references
    assert stored_s <= stored_q * 1.05

    run = rlreplay.open_run(tmp_path / "spilled")
    read = [
        span.inputs["prompt_ids"]
        for row in run.trajectories().to_pylist()
        for span in run.trajectory(row["id"]).spans
        if span.kind == "llm"
    ]
    assert sorted(read) == sorted(prompts)
    # one live file per step and process, whichever thread encoded the rows
    assert len(list((tmp_path / "spilled" / "spans").rglob("*.parquet"))) == 1
