"""``show`` marks a model call that stopped on its length limit, in the span tree and on its turn of
the conversation; the truth is each model call's recorded ``stop_reason``, read here."""

from __future__ import annotations

import re
from pathlib import Path

from support import length_stops, rlreplay_proc

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "sample_runs" / "verl-arith-smollm2"  # recorded with verl's length stop on
MARK = "stopped on its length limit"


def _show(traj_id: str, *args: str) -> str:
    env = {"NO_COLOR": "1", "PATH": "", "HOME": str(Path.home())}
    return rlreplay_proc("show", RUN, traj_id, *args, env=env, inherit=False, check=True).stdout


def test_show_marks_the_turn_and_the_call_that_stopped_on_length() -> None:
    calls = length_stops(RUN)
    truncated = [t for t, stops in calls.items() if any(stops)]
    clean = [t for t, stops in calls.items() if stops and not any(stops)]
    assert truncated and clean
    for traj_id in (truncated[0], truncated[-1], clean[0]):
        out = _show(traj_id)
        # the conversation: the k-th assistant turn is the k-th model call's answer
        heads = [line for line in out.splitlines() if re.match(r"\[\d+\] assistant\b", line)]
        assert [MARK in h for h in heads] == calls[traj_id], (traj_id, heads)
        # the span tree: one mark per model call that stopped on length
        spans = [line for line in out.splitlines() if "LLMServerClient.generate" in line]
        assert sum(MARK in line for line in spans) == sum(calls[traj_id])
    # without text the span tree still says it
    out = _show(truncated[0], "--no-text")
    assert out.count(MARK) == sum(calls[truncated[0]])
