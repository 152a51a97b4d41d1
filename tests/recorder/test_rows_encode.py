"""Encoding a span event: its fields become the row by name; what encoding had to change comes back
as problems (counted, or only warned), never as calls into the recorder; the recorder counts exactly
the counted ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

import rlreplay
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.recorder.events import OpenTrajectory, OpMeta, SpanEvent, format_span_id, format_trajectory_id
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
    traj = OpenTrajectory(step=4, sample_index=2, rollout_n=1, validate=False)
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
    assert list(r["token_ids"]) == [*range(300), *range(1000, 1200)]

    failed = as_dict(encode_row(event(traj, exc=ValueError("boom"), result=None), CONFIG, "w0")[0])
    assert failed["status"] == "error" and failed["error"] == "ValueError: boom"
    # a recorded id (a signals span of a trajectory recorded elsewhere) is kept as it is
    signals = OpenTrajectory.__new__(OpenTrajectory)
    signals.id, signals.step, signals.sample_index, signals.rollout_n = "ab" * 16, 4, 2, 1
    signals.validate, signals.experiment, signals.attributes, signals.explicit = False, None, None, False
    recorded = as_dict(encode_row(event(signals, span_id="cd" * 8, parent_id="ef" * 8), CONFIG, "w0")[0])
    assert (recorded["trajectory_id"], recorded["span_id"], recorded["parent_id"]) == (
        "ab" * 16,
        "cd" * 8,
        "ef" * 8,
    )


def test_values_encoding_changed_come_back_as_counted_problems() -> None:
    traj = OpenTrajectory(step=0, sample_index=0)
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
    row, _, problems = encode_row(event(OpenTrajectory(step=0), meta=meta), CONFIG, "w0")
    assert problems == [
        Problem(
            "reduce:generate:reduce_output", "reduce_output of generate raised KeyError: 'reducer bug'", False
        )
    ]
    output = orjson.loads(as_dict(row)["output"])
    assert output["__type__"] == "error" and "reducer bug" in output["error"]


def test_a_span_that_cannot_be_encoded_has_no_row_and_its_trajectory_shares_nothing_older() -> None:
    traj = OpenTrajectory(step=0, sample_index=0)
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
