"""Which trajectory a proxied call joins, on the proxy's own bookkeeping (no server, no recorder)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.proxy.protocol import CHAT
from rlreplay.proxy.trajectories import Trajectories


def _answer(text: str) -> dict[str, Any]:
    """A recorded chat answer, as the proxy keeps it (the body the client got)."""
    message = {"role": "assistant", "content": text}
    return {"status": 200, "body": {"choices": [{"index": 0, "message": message}]}}


def _call(trajectories: Trajectories, messages: list[dict[str, Any]], answer: str) -> Any:
    """One chat call through the bookkeeping, as the server makes it: find, name when new, continue."""
    body = {"model": "m", "messages": messages}
    traj, new = trajectories.find(CHAT, body, None)
    if new:
        trajectories.name(traj)
    trajectories.continues(traj, CHAT, body, _answer(answer))
    return traj


@settings(max_examples=60, deadline=None)
@given(
    conversations=st.integers(min_value=2, max_value=5),
    turns=st.integers(min_value=2, max_value=4),
    order=st.randoms(use_true_random=False),
)
def test_identical_conversations_each_keep_their_own_trajectory(
    conversations: int, turns: int, order: Any
) -> None:
    """A group of rollouts of one prompt at temperature 0 sends the same calls: each conversation's
    next call continues one of the open identical trajectories, never opens a new one, and no
    trajectory takes two calls of the same turn."""
    trajectories = Trajectories(None)
    history = [[{"role": "user", "content": "What is 2+2?"}] for _ in range(conversations)]
    joined: list[list[Any]] = [[] for _ in range(conversations)]
    pending = [c for c in range(conversations) for _ in range(turns)]
    order.shuffle(pending)
    # each conversation's calls stay in order; conversations interleave as the shuffle says
    for c in pending:
        messages = history[c]
        traj = _call(trajectories, messages, "4")
        joined[c].append(traj)
        history[c] = [*messages, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    assert len(trajectories.open) == conversations
    calls: dict[int, int] = {}
    for c in range(conversations):
        for traj in joined[c]:
            calls[id(traj)] = calls.get(id(traj), 0) + 1
    assert sorted(calls.values()) == [turns] * conversations
    # every turn of every conversation went to a distinct trajectory, each holding one call per turn
    for turn in range(turns):
        assert len({id(joined[c][turn]) for c in range(conversations)}) == conversations
    sample_indexes = sorted(t.key.sample_index for t in trajectories.open)
    assert sample_indexes == sorted(f"auto-{i}" for i in range(conversations))
