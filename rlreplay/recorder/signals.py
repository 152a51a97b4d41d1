"""Training signals (reward, advantage, train/rollout mismatch) for a trajectory recorded elsewhere.

The trainer (verl's driver) or a reward loop knows a trajectory's reward and advantage only after
the agent loop that recorded it has finished, in another process. ``record_signals`` writes one
span of kind ``signals`` for that trajectory id through this process's recorder; readers merge it
into the trajectory (contract C1/C2). Importing this module is cheap: the recorder loads on the
first call, and only when recording is on (``rlreplay.init`` or ``$RLREPLAY_DIR``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from rlreplay.format.kinds import KIND_SIGNALS

__all__ = ["record_signals"]

log = logging.getLogger("rlreplay")


_meta: Any = None


def record_signals(
    trajectory_id: str,
    *,
    step: Any,
    sample_index: Any,
    rollout_n: Any,
    validate: bool | None,
    reward: float | None = None,
    advantage: float | None = None,
    logprob_diff_mean: float | None = None,
    logprob_diff_max: float | None = None,
    importance_ratio: float | None = None,
    attributes: dict[str, Any] | None = None,
    output: Any = None,
    root_span_id: str | None = None,
) -> bool:
    """Record training signals for trajectory ``trajectory_id``; True when queued.

    Never raises: without a recorder it returns False; a failure is counted as lost.
    ``attributes`` holds extras (``{"reward_extra": {"acc": 1.0}}``), ``output`` e.g. per-token
    trainer log-probs; ``root_span_id``, when known, makes the span a child of the trajectory root.
    """
    global _meta
    rec = None
    try:
        from rlreplay.format.keys import TrajectoryKey
        from rlreplay.format.payload import snapshot
        from rlreplay.recorder import api, events

        rec = api.get_recorder()
        if rec is None:
            return False
        if _meta is None:
            _meta = events.OpMeta(name="signals", kind=KIND_SIGNALS)
        # the recorder's view of the trajectory, recorded elsewhere: its recorded id and its key
        traj = events.OpenTrajectory(
            TrajectoryKey.of(step, sample_index, rollout_n),
            attributes or None,
            explicit=False,
            given=events.given_keys(step, sample_index, rollout_n),
        )
        traj.id = str(trajectory_id)
        traj.validate = None if validate is None else bool(validate)  # None: not known here
        values = {
            "reward": reward,
            "advantage": advantage,
            "logprob_diff_mean": logprob_diff_mean,
            "logprob_diff_max": logprob_diff_max,
            "importance_ratio": importance_ratio,
        }
        now = time.time_ns()
        nbytes = events.payload_bytes((), {}, output)
        span_id = next(events.span_ids)
        rec.on_end(
            events.SpanEvent(
                traj, span_id, root_span_id, _meta, now, now, None, (), values, snapshot(output), nbytes
            )
        )
        return True
    except Exception as exc:
        if rec is not None:
            with contextlib.suppress(Exception):
                rec.count_loss(
                    "lost", 1, "signals", f"could not record signals ({type(exc).__name__}: {exc})"
                )
        else:
            log.warning("rlreplay: could not record signals: %s: %s", type(exc).__name__, exc)
        return False
