"""A served value is what the op returned, bit for bit, or the call is not served and says why.

Values are recorded by a real recorder into a real run, read back with ``show --json`` and served by
``rlreplay.replay`` to the same ops while the "engine" is down. Expected values are the values
themselves (floats by their bits, containers by their types) and the documented JSON form
(``tests/format/test_payload_fidelity.reference_form``), never the code under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlreplay
from rlreplay.cli.main import main
from rlreplay.recorder.replay import ReplayDivergence

sys.path.insert(0, str(Path(__file__).parents[1] / "format"))
from test_payload_fidelity import VALUES, bits, json_text, marker_shaped, reference_form

NAME = "Engine.generate"


class Engine:
    """A model server that answers what it is told to; ``down`` refuses every call."""

    def __init__(self, replies: list[Any], down: bool = False) -> None:
        self.replies = replies
        self.down = down
        self.calls = 0

    @rlreplay.trace_op(name=NAME, kind="llm")
    def generate(self, prompt_ids: list[int], sample: int) -> Any:
        self.calls += 1
        if self.down:
            raise ConnectionError("no model server")
        return self.replies[sample]


def record(run_dir: Path, replies: list[Any], **init: Any) -> None:
    rlreplay.init(run_dir, worker="w0", **init)
    try:
        engine = Engine(replies)
        for i in range(len(replies)):
            with rlreplay.trajectory(step=0, sample_index=i, rollout_n=0):
                engine.generate([1, 2, i], sample=i)
    finally:
        rlreplay.close()


def replay(source: Path, new_run: Path, n: int, **kw: Any) -> tuple[list[Any], Engine]:
    """Each trajectory's served reply (or the error its call raised), with the engine down."""
    engine = Engine([None] * n, down=True)
    got: list[Any] = []
    rlreplay.init(new_run, worker="w0")
    try:
        with rlreplay.replay(source, **kw):
            for i in range(n):
                with rlreplay.trajectory(step=0, sample_index=i, rollout_n=0):
                    try:
                        got.append(engine.generate([1, 2, i], sample=i))
                    except Exception as exc:
                        got.append(exc)
    finally:
        rlreplay.close()
    return got, engine


def cli_out(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def cli_json(*args: str) -> list[Any]:
    return [json.loads(line) for line in cli_out(*args).splitlines() if line.strip()]


def shown_outputs(run_dir: Path, n: int) -> list[Any]:
    """Each trajectory's model call output as ``show --json`` gives it."""
    out = []
    for i in range(n):
        shown = json.loads(cli_out("show", str(run_dir), f"sample_index={i}", "--json", "--no-text"))
        [root] = shown["spans"]
        [call] = root["children"]
        assert call["name"] == NAME
        out.append(call["output"])
    return out


def replay_rows(run_dir: Path) -> dict[int, dict]:
    return {r["sample_index"]: r for r in cli_json("ls", str(run_dir), "--json")}


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(VALUES | marker_shaped(VALUES), min_size=1, max_size=6))
def test_recorded_values_come_back_from_show_and_replay_bit_for_bit(replies: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source, new = Path(tmp) / "src", Path(tmp) / "new"
        record(source, replies)
        for shown, value in zip(shown_outputs(source, len(replies)), replies):
            assert json_text(shown) == json_text(json.loads(json.dumps(reference_form(value))))
        served, engine = replay(source, new, len(replies))
        assert engine.calls == 0  # every call served
        assert [bits(v) for v in served] == [bits(v) for v in replies]
        assert {r["replay"] for r in replay_rows(new).values()} == {"served"}


def test_marker_shaped_tool_data_is_data_in_show_listing_and_replay(tmp_path: Path) -> None:
    """What a tool returns shaped like the format's markers stays the tool's data everywhere."""
    replies = [
        {"__type__": "exception", "type": "ValueError", "message": "not an error: the tool's data"},
        {"__type__": "tokens", "t": "i32", "o": 0, "n": 3},
        {"__type__": "error", "error": "also data"},
        {"__type__": "truncated", "bytes": 9, "preview": "data"},
    ]
    record(tmp_path / "src", replies)
    shown = shown_outputs(tmp_path / "src", len(replies))
    assert [s["value"] for s in shown] == replies
    assert all(s["__type__"] == "dict" for s in shown)
    rows = replay_rows(tmp_path / "src")
    assert [rows[i]["status"] for i in range(len(replies))] == ["ok"] * len(replies)
    served, engine = replay(tmp_path / "src", tmp_path / "new", len(replies))
    assert (served, engine.calls) == (replies, 0)


class Reading:
    """An object the generic adapter does not rebuild."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Reading({self.value})"


NOT_KEPT = [
    # (reply, what the divergence reason says)
    ({"text": "x" * 3000}, "a value at /text was recorded truncated"),
    ({"api_key": "a-real-looking-secret-7f3a"}, "a value hidden by redaction at /api_key"),
    ({"logits": np.zeros(3, dtype=np.float32)}, "a numpy.ndarray at /logits was recorded as a list"),
    ({"reading": Reading(0.5)}, f"a {__name__}.Reading at /reading was recorded as its repr"),
    ({7: "seven"}, "a dict whose keys were not all strings"),
]


@pytest.mark.parametrize("on_diverge", ["live", "fail"])
def test_an_output_not_kept_as_returned_is_not_served_and_the_reason_says_why(
    tmp_path: Path, on_diverge: str
) -> None:
    replies = [reply for reply, _ in NOT_KEPT] + [{"fine": (1, 2.5)}]
    record(tmp_path / "src", replies, max_field_bytes=1000)
    source_ids = {i: r["id"] for i, r in replay_rows(tmp_path / "src").items()}
    served, engine = replay(tmp_path / "src", tmp_path / "new", len(replies), on_diverge=on_diverge)
    assert bits(served[-1]) == bits(replies[-1])  # the one kept as returned is served
    rows = replay_rows(tmp_path / "new")
    for i, (_, why) in enumerate(NOT_KEPT):
        if on_diverge == "live":
            assert isinstance(served[i], ConnectionError)  # not served: the call ran (the engine is down)
        else:
            assert isinstance(served[i], ReplayDivergence) and why in str(served[i])
        assert rows[i]["replay"] == "diverged" and rows[i]["replay_of"] == source_ids[i]
        assert why in rows[i]["replay_reason"] and "is not what the op returned" in rows[i]["replay_reason"]
    assert engine.calls == (len(NOT_KEPT) if on_diverge == "live" else 0)


def test_an_op_recorded_through_reduce_output_is_not_served(tmp_path: Path) -> None:
    @rlreplay.trace_op(kind="llm", name="Summarized.generate", reduce_output=lambda out: {"n": len(out)})
    def generate(prompt: str) -> list[int]:
        if down:
            raise ConnectionError("no model server")
        return [1, 2, 3]

    down = False
    rlreplay.init(tmp_path / "src")
    try:
        with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
            generate("p")
    finally:
        rlreplay.close()
    down = True
    rlreplay.init(tmp_path / "new")
    try:
        with (
            rlreplay.replay(tmp_path / "src") as cassette,
            rlreplay.trajectory(step=0, sample_index=0, rollout_n=0),
            pytest.raises(ConnectionError),
        ):
            generate("p")
    finally:
        rlreplay.close()
    [why] = cassette.divergences.values()
    assert "an output recorded through reduce_output, not as the op returned it" in why


@pytest.mark.parametrize(
    "shape",
    [
        {"__type__": "tokens", "t": "i32", "o": 0, "n": 1},
        {"__type__": "exception", "type": "ValueError", "message": "the tool's own words"},
    ],
)
def test_tool_replies_shaped_like_markers_are_data_in_export_and_uploads(tmp_path: Path, shape: dict) -> None:
    """A tool's reply with the format's marker key: ``export`` gives its text as the tool message,
    an OTLP upload does not report the call as failed."""
    from replay_job import EXECUTE, run_job
    from support import qwen_tokenizer_dir

    from rlreplay.uploaders.otlp_proto import exception_attributes

    rlreplay.init(tmp_path / "run", worker="w0")
    try:
        run_job({"steps": 1, "samples": 3, "rollouts": 1, "seed": 0, "tool_shape": shape})
    finally:
        rlreplay.close()
    run = rlreplay.open_run(tmp_path / "run")
    texts = []
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        for span in sorted(traj.spans, key=lambda s: s.start_ns):
            if span.name == EXECUTE:
                assert span.output == {
                    "__type__": "dict",
                    "value": {**shape, "text": span.output["value"]["text"]},
                }
                assert exception_attributes(span) is None and span.status == "ok"
                texts.append(span.output["value"]["text"])
    assert texts, "the job called its tool"
    out = tmp_path / "export.jsonl"
    tokenizer = str(qwen_tokenizer_dir())
    assert main(["export", str(tmp_path / "run"), "--tokenizer", tokenizer, "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    exported = [m["content"] for r in records for m in r["messages"] if m["role"] == "tool"]
    assert sorted(exported) == sorted(texts)
    assert all(t.startswith("result=") for t in texts)
