"""Typed token arrays on the writer: shared prompts found by comparing the lists as given (before any
conversion), and the values that must not become typed arrays (bools, ints among floats, floats
float32 cannot hold, ints beyond int32) read back exactly as recorded."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import rlreplay
from rlreplay.format import arrays as token_arrays
from rlreplay.format import payload

VOCAB = 151_643


_REPLIES: list[Any] = []


@rlreplay.trace_op(kind="llm")
def _call(*, prompt_ids: list[int]) -> Any:
    return _REPLIES.pop()


def generate(*, prompt_ids: list[int], reply: Any) -> Any:
    _REPLIES.append(reply)
    return _call(prompt_ids=prompt_ids)


def _spans(run_dir: Path) -> list[Any]:
    run = rlreplay.open_run(run_dir)
    (traj,) = [run.trajectory(row["id"]) for row in run.trajectories().to_pylist()]
    return sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)


def _stored_ids(run_dir: Path) -> int:
    table = rlreplay.open_run(run_dir).spans(columns=["token_ids"])
    return sum(len(v) for v in table["token_ids"].to_pylist() if v is not None)


def _bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def test_prompts_share_the_previous_call_however_they_extend_it(tmp_path: Path) -> None:
    """Extending, cutting inside the previous prompt, repeating only its start, and changing a value
    the caller gave earlier (after its span was written): every prompt reads back as sent."""
    rng = np.random.default_rng(1)

    def ids(n: int) -> list[int]:
        return rng.integers(0, VOCAB, n).tolist()

    first = ids(500)
    reply1 = {"token_ids": ids(300)}
    grown = first + reply1["token_ids"] + ids(20)  # the usual next turn
    cut = grown[:650] + ids(100)  # a context cut inside the previous prompt+response
    start_only = first[:200]  # shorter than what it repeats
    nested = {"choices": [{"token_ids": ids(300)}]}  # the hot path copies one level only
    given = nested["choices"][0]["token_ids"]
    original = list(given)
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w")
    sent = []
    with rlreplay.trajectory(step=0, sample_index=0):
        for prompt, reply in (
            (first, reply1),
            (grown, {"token_ids": ids(300)}),
            (cut, {"text": "x"}),
            (start_only, nested),
        ):
            generate(prompt_ids=prompt, reply=reply)
            sent.append(list(prompt))
            assert rlreplay.flush()
        # the caller changes the list it returned, after its span was written, and sends it again
        given[5] = 7
        again = start_only + given + ids(80)
        generate(prompt_ids=again, reply={"text": "z"})
        sent.append(list(again))
    rlreplay.close()
    spans = _spans(run_dir)
    assert len(spans) == 5
    for span, prompt in zip(spans, sent):
        assert span.inputs["prompt_ids"] == prompt
        assert all(type(x) is int for x in span.inputs["prompt_ids"])
    assert spans[3].output["choices"][0]["token_ids"] == original
    assert spans[4].inputs["prompt_ids"][205] == 7
    # what repeats is stored once: the first prompt, the replies, and the new parts of the prompts
    # (the last one from where its changed value begins)
    assert _stored_ids(run_dir) <= 500 + 300 + 20 + 300 + 100 + 0 + 300 + 380 < sum(map(len, sent)) + 900


def test_values_that_are_not_plain_ints_or_float32_read_back_as_given(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    base = rng.integers(2, VOCAB, 200).tolist()
    base[10], base[20] = 1, 0
    more = rng.integers(2, VOCAB, 100).tolist()
    floats = (-np.abs(rng.normal(0, 1, 200))).astype(np.float32).tolist()
    cases: dict[str, list] = {
        "bools": [True, False] * 100,
        "ints_and_a_bool": [*base[:150], True, *base[150:]],
        "ones_and_bools": [1] * 300 + [True] + [0] * 100,  # every position looks like a bool
        "float64": (np.array(floats) / 3).tolist(),  # not float32: JSON keeps them exactly
        "float32_and_an_int": [*floats[:100], 0, *floats[100:]],
        "float32_and_a_bool": [*floats[:100], True, *floats[100:]],
        "many_whole_floats_and_an_int": [0.0] * 300 + [-1],
        "signed_zeros": [-0.0, 0.0] * 40 + floats,
        "whole_floats": [float(x) for x in range(-150, 150)],
        "int64": [*base, 1 << 40],
        "response_mask": [1] * 100 + [300],  # a mask beyond int8
        "loss_mask": [1] * 100 + [200],  # a byte, yet beyond int8
        "attention_mask": [1] * 100 + [True] + [0] * 50,  # a bool among 0/1 ints
    }
    # equal to the previous call's ids as lists compare (True == 1, False == 0), yet not the same
    shadow = [*base, *more]
    shadow[10], shadow[20] = True, False
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w")
    with rlreplay.trajectory(step=0, sample_index=0):
        generate(prompt_ids=base, reply={"token_ids": more})
        generate(prompt_ids=shadow, reply=cases)
        generate(prompt_ids=[float(x) for x in base], reply={"token_ids": [*base, *more, *base]})
        # each the start of the previous call's ids, whole: the first as lists compare only
        generate(prompt_ids=shadow[: len(base)], reply={"token_ids": [*base, *more]})
    rlreplay.close()
    _first, second, third, fourth = _spans(run_dir)
    assert fourth.inputs["prompt_ids"] == base
    assert [type(x) for x in fourth.inputs["prompt_ids"]] == [type(x) for x in shadow[: len(base)]]
    assert fourth.output["token_ids"] == [*base, *more]
    assert second.inputs["prompt_ids"] == shadow
    assert [type(x) for x in second.inputs["prompt_ids"]] == [type(x) for x in shadow]
    for key, values in cases.items():
        got = second.output[key]
        assert got == values, key
        assert [type(x) for x in got] == [type(x) for x in values], key
        if all(type(x) is float for x in values):
            assert _bits(got) == _bits(values), key
    assert [type(x) for x in third.inputs["prompt_ids"]] == [float] * len(base)
    assert third.output["token_ids"] == [*base, *more, *base]


def test_id_cover_claims_only_the_equal_start_of_an_array() -> None:
    """An id array shares the stretch of the latest id stream it begins with: from one of the
    stream's array starts or where the span's previous array ended, the longest, up to the exact
    value where they differ; nothing shorter than MIN_SHARED, nothing that begins elsewhere (no
    search), and where it ended only when it covers the whole array."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, VOCAB, 120).tolist(), rng.integers(0, VOCAB, 90).tolist()
    index = token_arrays.SharedIndex()
    arrays = token_arrays.Arrays(index)
    arrays.extract({"prompt_ids": a, "token_ids": b})
    index.add("s1", arrays)
    stream = a + b

    def cover(values: list[int], after: tuple[str, int] | None = None) -> tuple[list, Any]:
        return index.id_cover(np.array(values, dtype=np.int32), after)

    assert cover([*stream, 5, 6]) == ([["s1", 0, len(stream), 0]], None)  # a turn: prompt + reply + more
    assert cover(stream) == ([["s1", 0, len(stream), 0]], ("s1", len(stream)))
    assert cover(b) == ([["s1", len(a), len(b), 0]], ("s1", len(stream)))  # the reply's own start
    assert cover(stream[50:], ("s1", 50)) == ([["s1", 50, len(stream) - 50, 0]], ("s1", len(stream)))
    assert cover(stream[50:]) == ([], None)  # where no array starts, and no ``after``
    assert cover(stream[50:], ("s2", 50)) == ([], None)  # ``after`` in another span
    assert cover(a[:100]) == ([["s1", 0, 100, 0]], ("s1", 100))
    edited = [*a[:70], a[70] + 1, *a[71:]]
    assert cover(edited) == ([["s1", 0, 70, 0]], None)  # up to the value that differs
    assert cover(a[: payload.MIN_SHARED - 1] + [-1] * 100) == ([], None)
    assert cover([-7, *stream]) == ([], None)  # a window moved by one: not searched for
    placeholder = token_arrays.Arrays(index).extract({"prompt_ids": edited})["prompt_ids"]
    assert placeholder["r"] == [["s1", 0, 70, 0]] and placeholder["n"] == len(edited) - 70


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=4),  # the stream's arrays, by the size of each
    st.integers(0, 3),  # the array the candidate starts from
    st.integers(0, 300),  # where it stops copying the stream
    st.lists(st.integers(-3, 3), max_size=80),  # then its own values
    st.booleans(),
)
def test_id_cover_claims_equal_values_whatever_the_arrays(
    sizes: list[int], first: int, stop: int, tail: list[int], with_after: bool
) -> None:
    """Whatever the stream and the candidate, every id the cover claims equals the stream's value it
    points at, and the claim stops at the first value that differs."""
    rng = np.random.default_rng(sum(sizes) * 1000 + first * 100 + stop)
    parts = [rng.integers(0, 4, size * 40).tolist() for size in sizes]  # few values: many near-misses
    index = token_arrays.SharedIndex()
    arrays = token_arrays.Arrays(index)
    arrays.extract({f"ids{i}": part for i, part in enumerate(parts)})
    index.add("s", arrays)
    stream = [v for part in parts if len(part) >= payload.MIN_ARRAY for v in part]
    starts = [0]
    for part in parts:
        if len(part) >= payload.MIN_ARRAY:
            starts.append(starts[-1] + len(part))
    begin = starts[min(first, len(starts) - 1)]
    values = stream[begin : begin + stop] + tail
    if not values:
        return
    after = ("s", begin) if with_after else None
    refs, end = index.id_cover(np.array(values, dtype=np.int32), after)
    for span, start, length, at in refs:
        assert span == "s" and at == 0 and length >= payload.MIN_SHARED
        assert values[:length] == stream[start : start + length]
        if length < len(values) and start + length < len(stream):  # it stops where they differ
            assert values[length] != stream[start + length]
    assert end == (("s", refs[0][1] + refs[0][2]) if refs and refs[0][2] == len(values) else None)


def test_log_probs_equal_in_value_but_not_in_bits_are_not_shared(tmp_path: Path) -> None:
    """-0.0 equals 0.0 as floats compare: a call's log-probs must not be stored as a reference into
    an earlier call whose values compare equal but differ in sign."""
    rng = np.random.default_rng(3)
    negative_zeros = [-0.0] * 100 + (-np.abs(rng.normal(0, 1, 100))).astype(np.float32).tolist()
    zeros = [0.0] * 100 + (-np.abs(rng.normal(0, 1, 100))).astype(np.float32).tolist()
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w")
    with rlreplay.trajectory(step=0, sample_index=0):
        generate(prompt_ids=rng.integers(2, VOCAB, 100).tolist(), reply={"log_probs": negative_zeros})
        generate(prompt_ids=rng.integers(2, VOCAB, 100).tolist(), reply={"log_probs": zeros})
    rlreplay.close()
    first, second = _spans(run_dir)
    assert _bits(first.output["log_probs"]) == _bits(negative_zeros)
    assert _bits(second.output["log_probs"]) == _bits(zeros)


def test_prompts_that_slide_splice_and_edit_read_back_as_sent(tmp_path: Path) -> None:
    """Prompts made of stretches of the previous call's ids at any position (a window moved by a few
    ids, two stretches with new ids between them, an edited value, a bool among them) read back as
    sent, whatever of them is shared."""
    rng = np.random.default_rng(11)

    def ids(n: int) -> list[int]:
        return rng.integers(2, VOCAB, n).tolist()

    prompts, replies = [ids(400)], [ids(300)]
    for k in range(12):
        prev = prompts[-1] + replies[-1]
        choice = k % 4
        if choice == 0:  # a window: new ids in front, the end cut
            new = ids(3) + prev[: len(prev) - 3]
        elif choice == 1:  # two stretches, new ids between them
            new = prev[:150] + ids(90) + prev[200:]
        elif choice == 2:  # one value changed inside
            new = list(prev)
            new[333] += 1
        else:  # a bool equal to the id it replaces (True == 1)
            new = [1, *prev]
        prompts.append(new)
        replies.append(replies[-1] if k % 2 else ids(200))
    with_bool = [True, *prompts[-1][1:]]
    prompts.append(with_bool)
    replies.append(ids(100))
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w")
    with rlreplay.trajectory(step=0, sample_index=0):
        for prompt, reply in zip(prompts, replies):
            generate(prompt_ids=prompt, reply={"token_ids": reply})
    rlreplay.close()
    spans = _spans(run_dir)
    for span, prompt, reply in zip(spans, prompts, replies):
        assert span.inputs["prompt_ids"] == prompt
        assert [type(x) for x in span.inputs["prompt_ids"]] == [type(x) for x in prompt]
        assert span.output["token_ids"] == reply


_TURNS: list[tuple[list[int], list[float], list[int]]] = []


@rlreplay.trace_op(kind="agent")
def _agent_loop(prompt: list[int]) -> dict:
    """verl's agent loop: each turn's prompt is the previous prompt + response + tool ids."""
    context, mask, logprobs = list(prompt), [], []
    for response, response_logprobs, tool in _TURNS:
        generate(prompt_ids=context, reply={"token_ids": response, "log_probs": response_logprobs})
        context = context + response + tool
        mask += [1] * len(response) + [0] * len(tool)
        logprobs += response_logprobs + [0.0] * len(tool)
    return {
        "prompt_ids": prompt,
        "response_ids": context[len(prompt) :],
        "response_mask": mask,
        "response_logprobs": logprobs,
    }


def test_an_agent_loop_stores_each_id_and_log_prob_once(tmp_path: Path) -> None:
    """The common agent workload: every prompt continues the previous one, and the agent span repeats
    the first prompt, every turn's response and tool ids, and every turn's log-probs. Each id and
    log-prob is stored once (the tool ids' zeros among the agent's log-probs excepted, a stretch too
    short to share), and every span reads back as recorded."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, VOCAB, 700).tolist()
    turns = []
    for n in (300, 250, 400, 200):
        response = rng.integers(2, VOCAB, n).tolist()
        logprobs = (-np.abs(rng.normal(0, 1, n))).astype(np.float32).tolist()
        turns.append((response, logprobs, rng.integers(2, VOCAB, 40).tolist()))
    turns[-1] = (*turns[-1][:2], [])  # no tool call after the last turn
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w")
    _TURNS[:] = turns
    with rlreplay.trajectory(step=0, sample_index=0):
        out = _agent_loop(prompt)
    rlreplay.close()
    run = rlreplay.open_run(run_dir)
    (traj,) = [run.trajectory(row["id"]) for row in run.trajectories().to_pylist()]
    (agent,) = traj.by_kind("agent")
    assert agent.output == out
    assert _bits(agent.output["response_logprobs"]) == _bits(out["response_logprobs"])
    context = list(prompt)
    for span, (response, logprobs, tool) in zip(sorted(traj.by_kind("llm"), key=lambda s: s.start_ns), turns):
        assert span.inputs["prompt_ids"] == context
        assert span.output == {"token_ids": response, "log_probs": logprobs}
        context += response + tool
    table = run.spans(columns=["token_ids", "token_logprobs"])
    stored_ids = sum(len(v) for v in table["token_ids"].to_pylist() if v is not None)
    stored_logprobs = sum(len(v) for v in table["token_logprobs"].to_pylist() if v is not None)
    assert stored_ids == len(prompt) + sum(len(r) + len(t) for r, _, t in turns)
    assert stored_logprobs == sum(len(lp) + len(t) for _, lp, t in turns)
