"""Encoding a span event: its fields become the row by name; what encoding had to change comes back
as problems (counted, or only warned), never as calls into the recorder; the recorder counts exactly
the counted ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlreplay
from rlreplay.format.keys import TrajectoryKey
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.recorder.events import (
    OpenTrajectory,
    OpMeta,
    SpanEvent,
    format_span_id,
    format_trajectory_id,
    given_keys,
)
from rlreplay.recorder.rows import PrefixCache, Problem, encode_row
from rlreplay.recorder.writer import RecorderConfig

CONFIG = RecorderConfig(run_dir=Path("unused"), experiment="exp")


def generate(request_id: str, *, prompt_ids: list[int]) -> dict:
    return {}


class BadName:
    def __str__(self) -> str:
        raise RuntimeError("no name")


def event(traj: OpenTrajectory, **fields: Any) -> SpanEvent:
    given = {
        "traj": traj,
        "span_id": 5,
        "parent_id": 3,
        "meta": OpMeta(name="generate", kind="llm", fn=generate),
        "start_ns": 1_000,
        "end_ns": 2_500,
        "exc": None,
        "args": ("r1",),
        "kwargs": {"prompt_ids": list(range(300))},
        "result": {"token_ids": list(range(1000, 1200))},
        "nbytes": 256,
    }
    return SpanEvent(**{**given, **fields})


def as_dict(row: tuple | None) -> dict[str, Any]:
    assert row is not None
    return dict(zip(SPAN_SCHEMA.names, row))


def test_a_span_events_fields_become_its_row() -> None:
    traj = OpenTrajectory(TrajectoryKey.of(step=4, sample_index=2, rollout_n=1, validate=False))
    row, nbytes, problems = encode_row(event(traj), CONFIG, "w0")
    assert problems == [] and nbytes > 200
    r = as_dict(row)
    assert (r["trajectory_id"], r["span_id"], r["parent_id"]) == (
        format_trajectory_id(traj.id),
        format_span_id(5),
        format_span_id(3),
    )
    assert (r["name"], r["kind"], r["start_ns"], r["end_ns"], r["status"], r["error"]) == (
        "generate", "llm", 1_000, 2_500, "ok", None,
    )  # fmt: skip
    assert (r["worker"], r["experiment"], r["step"], r["sample_index"], r["rollout_n"]) == (
        "w0",
        "exp",
        4,
        2,
        1,
    )
    assert orjson.loads(r["inputs"])["request_id"] == "r1"
    assert (r["prompt_tokens"], r["response_tokens"]) == (300, 200)
    ids = r["token_ids"]  # an array, or arrays taken end to end
    ids = np.concatenate(ids) if type(ids) is list else ids
    assert ids.tolist() == [*range(300), *range(1000, 1200)]

    failed = as_dict(encode_row(event(traj, exc=ValueError("boom"), result=None), CONFIG, "w0")[0])
    assert failed["status"] == "error" and failed["error"] == "ValueError: boom"
    # a recorded id (a signals span of a trajectory recorded elsewhere) is kept as it is
    signals = OpenTrajectory(TrajectoryKey(4, 2, 1), explicit=False)
    signals.id = "ab" * 16
    recorded = as_dict(encode_row(event(signals, span_id="cd" * 8, parent_id="ef" * 8), CONFIG, "w0")[0])
    assert (recorded["trajectory_id"], recorded["span_id"], recorded["parent_id"]) == (
        "ab" * 16,
        "cd" * 8,
        "ef" * 8,
    )


def test_a_trajectory_holds_its_key_and_its_spans_store_it() -> None:
    """An open trajectory holds one TrajectoryKey (values as the format keeps them); every span's row
    stores it, a value that is neither an int nor a string as its string, said for each span."""
    given = (np.int64(3), "s1", 1.5)
    traj = OpenTrajectory(TrajectoryKey.of(*given, validate=True, experiment="e2"), given=given_keys(*given))
    assert traj.key == TrajectoryKey(3, "s1", "1.5", True, "e2")
    assert type(traj.key.step) is int and traj.step == 3 and traj.validate is True
    for span_id in (5, 6):
        row, _, problems = encode_row(event(traj, span_id=span_id), CONFIG, "w0")
        r = as_dict(row)
        assert (r["step"], r["sample_index"], r["rollout_n"]) == (3, None, None)
        assert (r["step_str"], r["sample_index_str"], r["rollout_n_str"]) == (None, "s1", "1.5")
        assert (r["validate"], r["experiment"]) == (True, "e2")
        assert [p.message for p in problems] == [
            "a value could not be recorded as given: a key of type float was stored as the string '1.5'"
        ]
    assert OpenTrajectory(TrajectoryKey.of("7")).step is None  # a string step partitions nowhere
    assert given_keys(3, "s1", None) is None  # ints and strings are stored as given


def test_values_encoding_changed_come_back_as_counted_problems() -> None:
    traj = OpenTrajectory(TrajectoryKey.of(step=0, sample_index=0))
    bad = event(traj, args=("caf\udce9",), result={"text": "x\udcff"})
    row, _, problems = encode_row(bad, CONFIG, "w0")
    r = as_dict(row)
    assert orjson.loads(r["inputs"])["request_id"] == "caf\\udce9"
    assert orjson.loads(r["output"])["text"] == "x\\udcff"
    assert [(p.key, p.counted) for p in problems] == [("encode:value", True)] * 2
    assert all("not valid Unicode" in p.message for p in problems)


def test_a_failing_reducer_is_a_warning_and_its_span_keeps_a_marker() -> None:
    def reducer(output: Any) -> Any:
        raise KeyError("reducer bug")

    meta = OpMeta(name="generate", kind="llm", fn=generate, reduce_output=reducer)
    row, _, problems = encode_row(event(OpenTrajectory(TrajectoryKey.of(step=0)), meta=meta), CONFIG, "w0")
    assert problems == [
        Problem(
            "reduce:generate:reduce_output", "reduce_output of generate raised KeyError: 'reducer bug'", False
        )
    ]
    output = orjson.loads(as_dict(row)["output"])
    assert output["__type__"] == "error" and "reducer bug" in output["error"]


def test_a_span_that_cannot_be_encoded_has_no_row_and_its_trajectory_shares_nothing_older() -> None:
    traj = OpenTrajectory(TrajectoryKey.of(step=0, sample_index=0))
    prefixes = PrefixCache()
    first = event(traj)
    assert encode_row(first, CONFIG, "w0", prefixes)[2] == []
    assert prefixes.peek(format_trajectory_id(traj.id)) is not None  # the next call may share its ids
    broken = event(traj, span_id=6, meta=OpMeta(name=BadName(), kind="llm", fn=generate))  # type: ignore[arg-type]
    row, nbytes, problems = encode_row(broken, CONFIG, "w0", prefixes)
    assert (row, nbytes) == (None, 0)
    assert problems == [Problem("encode", "could not encode a span: RuntimeError: no name")]
    assert prefixes.peek(format_trajectory_id(traj.id)) is None


def test_the_recorder_counts_the_counted_problems_and_warns_once_per_kind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def reducer(output: Any) -> Any:
        raise KeyError("reducer bug")

    def echo(text: str) -> int:
        return len(text)

    tool = rlreplay.trace_op(kind="tool")(echo)
    reduced = rlreplay.trace_op(name="reduced", reduce_output=reducer)(echo)
    broken = rlreplay.trace_op(name=BadName())(echo)  # type: ignore[arg-type]
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="rlreplay"):
        rlreplay.init(run_dir, worker="w0")
        with rlreplay.trajectory(step=0, sample_index=0):
            for i in range(3):
                tool(f"caf\udce9 {i}")  # one value changed each: counted
            reduced("fine")  # a marker in its output: warned, not counted
            broken("fine")  # no row: counted
        assert not rlreplay.flush()  # values were changed since the last flush: not acknowledged
        stats = rlreplay.stats()
        assert rlreplay.flush()
        rlreplay.close()
    assert stats["encode_errors"] == 3 + 1 and stats["spans"] == 1 + 3 + 1 and stats["lost"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("not valid Unicode" in m for m in messages) == 1
    assert sum("reduce_output of reduced raised" in m for m in messages) == 1
    assert sum("could not encode a span" in m for m in messages) == 1
    names = rlreplay.open_run(run_dir).spans(columns=["name"])["name"].to_pylist()
    assert sorted(names) == sorted(["trajectory", "reduced", *[echo.__qualname__] * 3])


# ---- every list a span carries reads back as given, whatever is shared --------------------------

_IDS = st.integers(0, 151_000)
_EDGE_INTS = st.sampled_from([0, 1, True, False, np.int64(7), np.int64(1), np.bool_(True), 1 << 31, -1])
_FLOATS = st.sampled_from([-0.0, 0.0, 1e-45, -3.5, np.float32(-0.25).item(), 0.1, 1.0, 2.0**-130])


@st.composite
def _turns(draw: Any) -> list[dict[str, Any]]:
    """Model calls of one trajectory: prompts that continue the previous call's ids (or cut them,
    or start anew), replies, masks and log-probs, with values that must not be stored as typed
    arrays (bools, numpy scalars, ints beyond int32, floats float32 cannot hold) here and there."""
    calls: list[dict[str, Any]] = []
    stream: list[Any] = []
    logprobs: list[list[float]] = []
    for _ in range(draw(st.integers(1, 5))):
        how = draw(st.sampled_from(["continue", "cut", "edit", "new"]))
        own = draw(st.lists(_IDS, min_size=0, max_size=90))
        if how == "continue":
            prompt = stream + own
        elif how == "cut" and len(stream) > 64:  # the previous ids up to somewhere, then others
            prompt = [*stream[: draw(st.integers(60, len(stream) - 1))], -1, *own]
        elif how == "edit" and stream:  # the previous ids, one of them changed
            prompt = list(stream)
            prompt[draw(st.integers(0, len(stream) - 1))] = -2
        else:
            prompt = own + draw(st.lists(_IDS, min_size=60, max_size=120))
        reply = draw(st.lists(_IDS, min_size=64, max_size=150))
        if draw(st.booleans()) and prompt:  # an odd value among the ids
            prompt[draw(st.integers(0, len(prompt) - 1))] = draw(_EDGE_INTS)
        n = len(reply)
        lp = draw(st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n))
        if draw(st.booleans()) and lp:
            lp[draw(st.integers(0, n - 1))] = draw(_FLOATS)
        if draw(st.booleans()) and logprobs:  # an agent's log-probs: earlier calls', gaps between
            agent = [v for old in logprobs for v in [*old, 0.0, -0.0]]
            if draw(st.booleans()) and agent:  # one changed, maybe only in its sign bit
                at = draw(st.integers(0, len(agent) - 1))
                agent[at] = -agent[at] if agent[at] == 0.0 else agent[at] / 2
            lp = agent + lp
        mask = [draw(st.sampled_from([0, 1, True]))] + [1] * len(lp) if draw(st.booleans()) else None
        output: dict[str, Any] = {"token_ids": reply, "log_probs": lp}
        if mask is not None:
            output["response_mask"] = mask
        calls.append({"prompt_ids": prompt, "output": output})
        stream = prompt + reply
        logprobs.append(lp)
    return calls


def _same(got: Any, want: Any) -> bool:
    """Equal as recorded: the same types (a bool is not an int; a numpy int reads back as an int),
    floats bit for bit."""
    if isinstance(want, (np.integer, np.bool_)):
        want = want.item()
    if type(want) is float:
        return type(got) is float and np.float64(got).tobytes() == np.float64(want).tobytes()
    if type(want) is list:
        return type(got) is list and len(got) == len(want) and all(map(_same, got, want))
    if type(want) is dict:
        return type(got) is dict and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


@settings(max_examples=200, deadline=None)
@given(_turns())
def test_every_list_reads_back_as_given_whatever_is_shared(calls: list[dict[str, Any]]) -> None:
    from rlreplay.model import trajectory_from_table
    from rlreplay.recorder.rows import StepBuffer

    traj = OpenTrajectory(TrajectoryKey.of(step=0, sample_index=0))
    prefixes = PrefixCache()
    buffer = StepBuffer()
    for i, call in enumerate(calls):
        kwargs = {"prompt_ids": list(call["prompt_ids"])}
        spanned = event(traj, span_id=10 + i, start_ns=i, end_ns=i, kwargs=kwargs, result=call["output"])
        row, nbytes, _ = encode_row(spanned, CONFIG, "w0", prefixes)
        buffer.append(row, nbytes)
    batch, problems = buffer.take_batch()
    assert problems == []
    spans = sorted(trajectory_from_table(pa.Table.from_batches([batch])).spans, key=lambda s: s.start_ns)
    for span, call in zip(spans, calls, strict=True):
        assert _same(span.inputs["prompt_ids"], call["prompt_ids"])
        assert _same(span.output, call["output"])
