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


def test_signals_after_a_trajectory_ended_leave_no_prefix_index(tmp_path: Path) -> None:
    """verl records a trajectory's reward after it ended: its signals span must not open a new
    (never dropped) index, or the writer holds one per trajectory for the whole run."""
    from rlreplay.recorder import record_signals

    rng = np.random.default_rng(1)

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids: list[int]) -> dict:
        return {"token_ids": rng.integers(0, 151_000, 200).tolist()}

    rlreplay.init(tmp_path / "run", worker="w")
    rec = get_recorder()
    assert rec is not None
    n = 40
    for i in range(n):
        traj = rlreplay.trajectory(step=i // 4, sample_index=i % 4, rollout_n=0)
        with traj:
            generate(rng.integers(0, 151_000, 300).tolist())
        record_signals(traj.id, step=i // 4, sample_index=i % 4, rollout_n=0, validate=False, reward=1.0)
    assert rlreplay.flush()
    assert len(rec._prefixes._by_trajectory) == 0
    rlreplay.close()
    assert len(rlreplay.open_run(tmp_path / "run").trajectories()) == n


def test_prefix_cache_holds_at_most_its_trajectories() -> None:
    """Spans that end after their trajectory (a late child) open an index nobody drops: the cache
    keeps the most recently used ``max_trajectories`` whatever their size."""
    from rlreplay.recorder.rows import PrefixCache

    cache = PrefixCache(max_trajectories=3)
    for i in range(10):
        cache.get(f"t{i}")
    cache.get("t8")  # used again: kept over t7
    cache.get("t10")
    assert list(cache._by_trajectory) == ["t9", "t8", "t10"]
    assert cache.peek("t0") is None and cache.peek("t9") is not None
    assert len(cache._by_trajectory) == 3
