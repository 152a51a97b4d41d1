"""What the JSON form of a payload holds beside plain numbers does not lose a response: an op's own
dict with a ``__type__`` key (written wrapped), a NaN log-prob in a short list (a float marker)
or in a typed column; such a token never counts, the others do."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
from test_mismatch_verl import mismatch_json

import rlreplay
from rlreplay.recorder.signals import record_signals


def _record(run_dir: Path) -> list[tuple[list[int], list[float], list[float]]]:
    """Two responses, 10 and 80 tokens (a JSON list and a typed column), each with a NaN rollout
    log-prob on a model token and a tool token; the agent's output has a ``__type__`` key."""
    rng = np.random.default_rng(7)
    recorded = []

    @rlreplay.trace_op(name="AgentLoop.run", kind="agent")
    async def agent(n: int) -> dict:
        mask = [1] * n
        mask[n // 2] = 0
        rollout = [float(v) for v in np.float32(-rng.random(n))]
        rollout[1] = math.nan
        return {
            "__type__": "AgentLoopOutput",
            "response_ids": list(range(100, 100 + n)),
            "response_mask": mask,
            "response_logprobs": rollout,
        }

    async def one(sample: int, n: int) -> None:
        async with rlreplay.trajectory(step=0, sample_index=sample, rollout_n=0) as traj:
            out = await agent(n)
        trainer = [
            float(v) for v in np.float32(np.nan_to_num(out["response_logprobs"]) + rng.normal(0, 0.1, n))
        ]
        record_signals(
            traj.id,
            step=0,
            sample_index=sample,
            rollout_n=0,
            validate=False,
            output={"old_log_probs": trainer},
        )
        recorded.append((out["response_mask"], out["response_logprobs"], trainer))

    rlreplay.init(run_dir, worker="w0")
    for sample, n in enumerate((10, 80)):
        asyncio.run(one(sample, n))
    rlreplay.close()
    return recorded


def test_wrapped_outputs_and_nan_log_probs(tmp_path: Path) -> None:
    recorded = _record(tmp_path / "run")
    gaps = []
    for mask, rollout, trainer in recorded:
        for m, r, t in zip(mask, rollout, trainer):
            if m and math.isfinite(r) and math.isfinite(t):
                gaps.append(abs(t - r))
    (row,) = mismatch_json(str(tmp_path / "run"))
    assert row["sequences"] == 2 and row["tokens"] == len(gaps) == 10 + 80 - 2 - 2
    assert math.isclose(row["logprob_diff_mean"], sum(gaps) / len(gaps), rel_tol=1e-12)
    assert row["logprob_diff_max"] == max(gaps)
