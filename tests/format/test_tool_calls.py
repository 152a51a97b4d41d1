"""What counts as a tool call: the model's calls, one definition for verl, generic and proxy runs
(``rlreplay.format.tool_errors``), from model answers in every form and from tool spans."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import rlreplay
from rlreplay.format.tool_errors import WIRE_CALL_MARKS, answer_tool_calls


def _call(n: int) -> dict[str, Any]:
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": n})},
    }


def _chat_body(k: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in range(k)] or None}
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


def _chat_stream(k: int, pieces: int) -> list[Any]:
    """Chunks as a server streams k calls: each call's name first, then its arguments in pieces."""
    chunks: list[Any] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for i in range(k):
        head = {
            "index": i,
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "add", "arguments": ""},
        }
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [head]}}]})
        text = json.dumps({"a": i})
        step = max(1, len(text) // pieces)
        for at in range(0, len(text), step):
            part = {"index": i, "function": {"arguments": text[at : at + step]}}
            chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return [*chunks, "[DONE]"]


def _responses(k: int, text: bool) -> dict[str, Any]:
    items: list[Any] = (
        [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}] if text else []
    )
    items += [
        {"type": "function_call", "call_id": f"c{i}", "name": "add", "arguments": "{}"} for i in range(k)
    ]
    return {"object": "response", "output": items}


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(min_value=0, max_value=6), pieces=st.integers(min_value=1, max_value=5), text=st.booleans()
)
def test_every_form_of_an_answer_counts_its_calls(k: int, pieces: int, text: bool) -> None:
    body = _chat_body(k)
    assert answer_tool_calls(body) == k
    assert answer_tool_calls({"status": 200, "body": body}) == k  # as the proxy records it
    assert answer_tool_calls({"status": 200, "stream": _chat_stream(k, pieces)}) == k
    assert answer_tool_calls(_responses(k, text)) == k
    done = {"type": "response.completed", "response": _responses(k, text)}
    assert answer_tool_calls({"stream": [{"type": "response.created"}, done]}) == k
    assert answer_tool_calls(body["choices"][0]["message"]) == k  # a message recorded as the output
    # a second choice is another sample, not this trajectory's answer
    two = {
        "choices": [
            *_chat_body(k)["choices"],
            {"index": 1, "message": _chat_body(k + 1)["choices"][0]["message"]},
        ]
    }
    assert answer_tool_calls(two) == k


def _sse(chunks: list[Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@settings(max_examples=40, deadline=None)
@given(k=st.integers(min_value=0, max_value=6), pieces=st.integers(min_value=1, max_value=5))
def test_an_answer_kept_as_wire_bytes_counts_its_calls(k: int, pieces: int) -> None:
    """The proxy keeps answers as the bytes that went over the wire: streamed and whole, as bytes
    and in their stored JSON form, read back through the span's payload column."""
    from rlreplay.format import payload

    for wire in (_sse(_chat_stream(k, pieces)), json.dumps(_chat_body(k)).encode()):
        record = {"status": 200, "token_ids": [1, 2], "wire": wire}
        assert answer_tool_calls(record) == k
        stored, _ = payload.decode_safe(payload.encode(record))
        assert answer_tool_calls(stored) == k


def _escaped(wire: bytes, letters: str) -> bytes:
    """``wire`` with each of ``letters`` in its keys written as a JSON escape (``_`` as ``\\u005f``):
    the same JSON value, other bytes."""
    for name in (b"tool_calls", b"function_call", b"calls"):
        escaped = b"".join(b"\\u%04x" % c if chr(c) in letters else bytes([c]) for c in name)
        wire = wire.replace(b'"' + name, b'"' + escaped)
    return wire


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(min_value=0, max_value=4),
    pieces=st.integers(min_value=1, max_value=3),
    letters=st.text(alphabet="tool_cafuni", max_size=3),
    whole=st.booleans(),
)
def test_wire_bytes_count_as_their_json_value_however_keys_are_written(
    k: int, pieces: int, letters: str, whole: bool
) -> None:
    """Kept bytes count what their JSON value counts, keys written plainly or escaped."""
    value: Any = _chat_body(k) if whole else _chat_stream(k, pieces)
    plain = json.dumps(value).encode() if whole else _sse(value[:-1])
    wire = _escaped(plain, letters)
    parsed = json.loads(wire) if whole else [json.loads(line[6:]) for line in wire.split(b"\n\n")[:-2]]
    assert parsed == (value if whole else value[:-1])  # the same value, whatever the bytes
    by_value = answer_tool_calls({"body": parsed} if whole else {"stream": parsed})
    assert by_value == k
    assert answer_tool_calls({"status": 200, "wire": wire}) == by_value


@settings(max_examples=300, deadline=None)
@given(
    before=st.binary(max_size=7),
    after=st.binary(max_size=7),
    mark=st.sampled_from(WIRE_CALL_MARKS),
)
def test_the_text_of_kept_bytes_that_hold_a_call_key_is_always_decoded(
    before: bytes, after: bytes, mark: bytes
) -> None:
    """The listing decodes an answer kept as bytes when its stored text matches the cheap test:
    bytes holding a call key, wherever it falls in base64's 3-byte groups, always match."""
    import base64

    import pyarrow as pa

    from rlreplay.format import payload
    from rlreplay.format.marks import holds_any
    from rlreplay.format.tool_errors import TOOL_CALL_MARKS

    text = payload.encode({"status": 200, "wire": before + mark + after})
    assert base64.b64encode(before + mark + after).decode() in text
    plain = payload.encode({"status": 200, "wire": b"data: [DONE]"})
    for kind in (pa.string(), pa.large_string()):
        column = pa.chunked_array([pa.array([plain, text], kind), pa.array([None, text, plain], kind)])
        assert holds_any(column, TOOL_CALL_MARKS).tolist() == [False, True, False, True, False]


_CALLS_VALUE = st.one_of(
    st.just([]), st.none(), st.integers(1, 2).map(lambda k: [_call(i) for i in range(k)])
)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(_CALLS_VALUE, min_size=1, max_size=3),
    whole=st.booleans(),
    compact=st.booleans(),
    text=st.sampled_from(["", "tool_calls", '"tool_calls":[]', "x\\"]),
)
def test_bytes_whose_call_members_name_none_count_as_their_value(
    values: list[Any], whole: bool, compact: bool, text: str
) -> None:
    """Servers write ``"tool_calls":[]`` in every message: bytes are counted as their JSON value
    whatever their members hold (empty, null, calls; the key written twice, the last one counting;
    the same bytes inside a text)."""
    separators = (",", ":") if compact else (", ", ": ")
    members = ",".join(json.dumps({"tool_calls": v}, separators=separators)[1:-1] for v in values)
    message = '{"role":"assistant","content":' + json.dumps(text) + "," + members + "}"
    if whole:
        wire = ('{"choices":[{"index":0,"message":' + message + ',"finish_reason":"stop"}]}').encode()
        by_value = answer_tool_calls({"body": json.loads(wire)})
    else:
        delta = '{"choices":[{"index":0,"delta":' + message + "}]}"
        wire = b"data: " + delta.encode() + b"\n\ndata: [DONE]\n\n"
        by_value = answer_tool_calls({"stream": [json.loads(delta), "[DONE]"]})
    assert by_value == (len(values[-1] or ()) if whole else by_value)
    assert answer_tool_calls({"status": 200, "wire": wire}) == by_value


def test_not_an_answer_counts_none() -> None:
    for value in (None, 3, "tool_calls", [], {"text": "tool_calls"}, {"choices": []}, {"stream": ["[DONE]"]}):
        assert answer_tool_calls(value) == 0


def test_ls_counts_the_models_calls_once_whether_tools_ran_as_spans_or_not(tmp_path: Path) -> None:
    """Three trajectories: calls only in the answers (a proxy run), calls in the answers and the
    tools run as spans (a generic run), tools as spans with token-id answers (verl)."""
    run_dir = tmp_path / "run"
    rlreplay.init(str(run_dir))

    @rlreplay.trace_op(kind="llm")
    async def chat(k: int) -> dict[str, Any]:
        return {"status": 200, "body": _chat_body(k)}

    @rlreplay.trace_op(kind="llm")
    async def generate(k: int) -> dict[str, Any]:
        return {"token_ids": [1, 2, 3]}

    @rlreplay.trace_op(kind="tool")
    async def add(a: int) -> int:
        return a + 1

    async def rollouts() -> None:
        async with rlreplay.trajectory(step=0, sample_index=0):
            await chat(2)
            await chat(1)
        async with rlreplay.trajectory(step=0, sample_index=1):
            await chat(2)
            await add(1)
            await add(2)
        async with rlreplay.trajectory(step=0, sample_index=2):
            await generate(0)
            for a in range(3):
                await add(a)

    asyncio.run(rollouts())
    rlreplay.close()
    rows = {r["sample_index"]: r for r in rlreplay.open_run(run_dir).trajectories().to_pylist()}
    assert {i: rows[i]["tool_calls"] for i in rows} == {0: 3, 1: 2, 2: 3}
