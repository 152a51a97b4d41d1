"""The writer's per-trajectory prefix index is let go when a trajectory ends, also when its root span
was written by the calling thread (queue full) or dropped, so it never holds ended trajectories."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import rlreplay
from rlreplay.recorder.api import get_recorder


@pytest.mark.parametrize("policy", ["spill", "drop"])
def test_prefixes_of_trajectories_whose_root_did_not_queue_are_dropped(tmp_path: Path, policy: str) -> None:
    rng = np.random.default_rng(0)

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids: list[int]) -> dict:
        return {"token_ids": rng.integers(0, 151_000, 200).tolist()}

    @rlreplay.trace_op(kind="agent")
    def loop() -> None:  # called outside a trajectory: its own span is the root
        generate(rng.integers(0, 151_000, 500).tolist())

    run_dir = tmp_path / "run"
    # a queue of ~1 KB: while the writer sleeps between cycles, every later span finds it full
    rlreplay.init(run_dir, worker="w", max_queue_mb=0.001, policy=policy)
    rec = get_recorder()
    assert rec is not None
    for i in range(4):
        with rlreplay.trajectory(step=0, sample_index=i):
            generate(rng.integers(0, 151_000, 500).tolist())
        loop()
    flushed = rlreplay.flush()
    counted = rec.counters["spilled"] + rec.counters["dropped"]
    assert counted > 0  # some roots did not go through the queue
    assert flushed == (rec.counters["dropped"] == 0)  # a flush acknowledges no batch that lost spans
    assert len(rec._prefixes._by_trajectory) == 0
    rlreplay.close()
    if policy == "spill":
        run = rlreplay.open_run(run_dir)
        assert len(run.trajectories()) == 8
