"""Typed token arrays on the writer: shared prompts found by comparing the lists as given (before any
conversion), and the values that must not become typed arrays (bools, ints among floats, floats
float32 cannot hold, ints beyond int32) read back exactly as recorded."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

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


def test_list_cover_claims_only_equal_runs() -> None:
    """The list comparison finds the longest runs of the latest id stream in the new list, from the
    stream's array starts or where the span's previous array ended, wherever they begin in the new
    list, each to the exact value where it stops; a run shorter than MIN_SHARED is not claimed."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, VOCAB, 120).tolist(), rng.integers(0, VOCAB, 90).tolist()
    index = token_arrays.SharedIndex()
    arrays = token_arrays.Arrays(index)
    arrays.extract({"prompt_ids": a, "token_ids": b})
    index.add("s1", arrays)
    stream = a + b
    for start in (0, 50):
        after = ("s1", start) if start else None
        refs, last = index.list_cover([*stream[start:], 5, 6], after)
        assert refs == [["s1", start, len(stream) - start, 0]]
        assert last == ("s1", len(stream))
    assert index.list_cover(a[:100], None)[0] == [["s1", 0, 100, 0]]
    assert index.list_cover(a[: payload.MIN_SHARED - 1] + [-1] * 100, None) == ([], None)
    assert index.list_cover([-1, *a], ("s2", 0))[0] == [["s1", 0, len(a), 1]]  # a run starting later
    edited = [*a[:70], a[70] + 1, *a[71:]]
    assert index.list_cover(edited, None)[0] == [["s1", 0, 70, 0]]  # up to the value that differs
    # a new id, then the stream moved by one (a sliding window): the run begins at the second value
    window = [-7, *stream[:-1]]
    assert index.list_cover(window, None)[0] == [["s1", 0, len(stream) - 1, 1]]
    # two runs with a new stretch between them
    spliced = [*a, *([-3] * 80), *b]
    assert index.list_cover(spliced, None)[0] == [["s1", 0, len(a), 0], ["s1", len(a), len(b), len(a) + 80]]
    placeholder = token_arrays.Arrays(index).extract({"prompt_ids": edited})["prompt_ids"]
    assert placeholder["r"][0][:3] == ["s1", 0, 70]


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


def test_prompts_that_slide_splice_and_edit_read_back_and_share(tmp_path: Path) -> None:
    """Prompts made of stretches of the previous call's ids at any position (a window moved by a few
    ids, two stretches with new ids between them, an edited value, a bool among them): each reads
    back as sent, and the stretches are stored once."""
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
    # every id kept once, except the new ones each prompt brings: well under the ids sent
    sent = sum(len(p) + len(r) for p, r in zip(prompts, replies))
    assert _stored_ids(run_dir) < sent / 4
