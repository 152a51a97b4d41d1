"""Which trajectory a proxied call joins, on the proxy's own bookkeeping (no server, no recorder):
the rule for ids sent back, keys, continuation, and trajectories written while idle."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.errors import ProxyError, UnknownTrajectory
from rlreplay.format.keys import TrajectoryKey
from rlreplay.proxy.protocol import CHAT
from rlreplay.proxy.trajectories import Trajectories, parse_key


def _answer(text: str) -> dict[str, Any]:
    return {
        "status": 200,
        "body": {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]},
    }


def _call(t: Trajectories, messages: list[dict[str, Any]], answer: str, **how: Any) -> Any:
    """One chat call as the server makes it: find, name when new, its id given, continue."""
    body = {"model": "m", "messages": messages}
    traj, new = t.find(CHAT, body, how.get("named"), how.get("sent_id"))
    if new and how.get("named") is None:
        t.name(traj)
    t.allocate(traj)
    t.continues(traj, CHAT, body, _answer(answer))
    return traj


QUESTION = [{"role": "user", "content": "2+2?"}]


@settings(max_examples=40, deadline=None)
@given(group=st.integers(min_value=2, max_value=8), order=st.randoms(use_true_random=False))
def test_ids_sent_back_keep_each_rollout_of_a_group_answered_alike(group: int, order: Any) -> None:
    """Turn 2 in any order: every rollout that sends its id back stays in its trajectory, none of
    those joins counts as a guess; without the id, the joins are counted as ambiguous."""
    t = Trajectories(None)
    first = [_call(t, QUESTION, "4") for _ in range(group)]
    turn2 = list(range(group))
    order.shuffle(turn2)
    for k in turn2:
        follow = [*QUESTION, {"role": "assistant", "content": "4"}, {"role": "user", "content": f"r{k}"}]
        assert _call(t, follow, "ok", sent_id=first[k].id) is first[k]
    assert t.ambiguous == 0 and len(t.open) == group
    guessed = Trajectories(None)
    for _ in range(group):
        _call(guessed, QUESTION, "4")
    for k in range(group):
        _call(
            guessed,
            [*QUESTION, {"role": "assistant", "content": "4"}, {"role": "user", "content": f"r{k}"}],
            "ok",
        )
    assert guessed.ambiguous == group - 1  # the last one had no other to choose from
    assert len(guessed.open) == group


def test_unnamed_keys_are_never_named_keys() -> None:
    t = Trajectories(None)
    unnamed = _call(t, QUESTION, "4")
    named = _call(t, [{"role": "user", "content": "x"}], "y", named=parse_key("step=0,sample_index=0"))
    assert unnamed is not named and unnamed.key != named.key
    assert unnamed.key == TrajectoryKey.of(0, "auto-0", None, False)
    with pytest.raises(ProxyError, match="auto-"):
        parse_key("step=0,sample_index=auto-0")
    fresh = Trajectories(None)
    fresh.reserve(0, "auto-7")
    assert _call(fresh, QUESTION, "4").key.sample_index == "auto-8"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step=0,sample_index=1,", "trailing comma"),
        ("step=0,step=1", "given twice"),
        ("step=0,sample_index=", "no value for 'sample_index'"),
        ("step=0,colour=red", "unknown key 'colour'"),
        ("step=0,experiment=x", "experiment is the proxy's own"),
        ("step=0,rollout_n=auto-3", "auto-"),
    ],
)
def test_keys_a_call_names_are_refused_when_malformed(text: str, message: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_key(text)
    assert message in str(caught.value) and str(caught.value).startswith("X-Rlreplay-Trajectory: ")


def test_keys_a_call_names_read_as_str_writes_them() -> None:
    key = TrajectoryKey.of(3, "12", 0, True)
    assert parse_key(str(key)) == key
    assert parse_key("step=3,sample=4,rollout=0,split=val") == TrajectoryKey.of(3, 4, 0, True)


def test_written_trajectories_are_joined_again_by_every_rule() -> None:
    t = Trajectories(None, idle_s=1.0)
    a = _call(t, QUESTION, "4")
    b = _call(t, [{"role": "user", "content": "b"}], "c", named=parse_key("step=0,sample_index=3"))
    c = _call(t, [{"role": "user", "content": "c"}], "d")
    assert t.close_idle(now=a.last_used + 10) == 3 and not t.open
    follow = [*QUESTION, {"role": "assistant", "content": "4"}, {"role": "user", "content": "more"}]
    assert _call(t, follow, "5") is a
    assert _call(t, [{"role": "user", "content": "b2"}], "x", named=parse_key("step=0,sample_index=3")) is b
    assert _call(t, [{"role": "user", "content": "anything"}], "x", sent_id=c.id) is c
    assert t.open == {a, b, c} and len({a.id, b.id, c.id}) == 3


def test_unknown_ids_and_keys_are_refused() -> None:
    t = Trajectories(None)
    known = _call(t, QUESTION, "4")
    with pytest.raises(UnknownTrajectory):
        t.find(CHAT, {"messages": QUESTION}, None, "f" * 32)
    with pytest.raises(UnknownTrajectory):
        t.signals({"trajectory_id": "f" * 32, "reward": 1.0})
    with pytest.raises(UnknownTrajectory):
        t.signals({"step": 9, "sample_index": 9, "reward": 1.0})
    with pytest.raises(ProxyError, match="not"):  # an id and the keys of another trajectory
        t.find(CHAT, {"messages": QUESTION}, parse_key("step=4,sample_index=4"), known.id)
    assert not t.by_id.keys() - {known.id}  # nothing made by the refused ones
