"""Streamed calls through ``rlreplay proxy``, in front of a server that streams as vLLM's
``serving_chat`` does (a first chunk with the role alone, then one chunk per token with its
``token_ids``) and as SGLang's ``/generate`` does: every response id and log-prob recorded equals the
server's, whether the client asked for them or the proxy did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_proxy import CHAT, llm_spans

from rlreplay.proxy.protocol import CHAT as CHAT_ROUTE
from rlreplay.proxy.protocol import StreamedAnswer

pytestmark = pytest.mark.timeout(600)


def sse_chunks(raw: bytes) -> list[Any]:
    """The JSON chunks of an SSE body (``[DONE]`` left out)."""
    import json

    out = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if data and data != b"[DONE]":
            out.append(json.loads(data))
    return out


def whole(server: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    return httpx.post(f"{server}{route}", json=body, timeout=120).json()


def test_a_vllm_shaped_stream_is_recorded_with_every_id_and_log_prob(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    direct = httpx.post(
        f"{model_server}/v1/chat/completions",
        json={"model": "m", "messages": CHAT, "max_tokens": 5, "stream": True, "return_token_ids": True},
        timeout=120,
    ).content
    first = sse_chunks(direct)[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the shape of vLLM's
    assert "token_ids" not in first["choices"][0]
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    asks = [
        {"model": "m", "messages": CHAT, "max_tokens": 5, "stream": True},  # the proxy asks for ids
        {
            "model": "m",
            "messages": CHAT,
            "max_tokens": 5,
            "stream": True,
            "return_token_ids": True,
            "logprobs": True,
        },
        {"model": "m", "prompt": "Name a colour:", "max_tokens": 5, "stream": True},
    ]
    routes = ["/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]
    got = [httpx.post(f"{proxy.url}{r}", json=b, timeout=120).content for r, b in zip(routes, asks)]
    sglang = {
        "text": "Name a colour:",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "stream": True,
    }
    got.append(httpx.post(f"{proxy.url}/generate", json=sglang, timeout=120).content)
    assert proxy.stop() == 0, proxy.stderr
    expected = [
        whole(
            model_server,
            r,
            {
                **{k: v for k, v in b.items() if k != "stream"},
                "return_token_ids": True,
                "logprobs": True if "messages" in b else 0,
            },
        )
        for r, b in zip(routes, asks)
    ]
    gen = whole(model_server, "/generate", {**sglang, "stream": False, "return_logprob": True})
    spans = [s for _, ss in llm_spans(tmp_path / "run") for s in ss]
    by_name: dict[str, list[Any]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_name.setdefault(span.name, []).append(span)
    chat_spans = by_name["chat.completions"]
    assert len(chat_spans) == 2
    for span, want in zip([*chat_spans, *by_name["completions"]], expected):
        choice = want["choices"][0]
        assert list(span.output["token_ids"]) == choice["token_ids"]
        lps = choice["logprobs"]
        values = [c["logprob"] for c in lps["content"]] if "content" in lps else lps["token_logprobs"]
        assert list(span.output["log_probs"]) == values
        assert span.inputs["prompt_ids"] == (want.get("prompt_token_ids") or choice.get("prompt_token_ids"))
    [span] = by_name["generate"]
    assert list(span.output["token_ids"]) == gen["output_ids"]
    assert list(span.output["log_probs"]) == [row[0] for row in gen["meta_info"]["output_token_logprobs"]]
    # what the client got: the server's chunks, without what the proxy asked for
    client_view = sse_chunks(got[0])
    assert client_view[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(
        "token_ids" not in c["choices"][0] and c["choices"][0]["logprobs"] is None for c in client_view
    )
    assert all("prompt_token_ids" not in c for c in client_view)
    assert got[1].endswith(b"data: [DONE]\n\n") and sse_chunks(got[1])[1]["choices"][0]["token_ids"]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(
        st.tuples(st.integers(0, 2**31), st.floats(allow_nan=False, allow_infinity=False, max_value=0)),
        max_size=30,
    ),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    role_first=st.booleans(),
)
def test_a_streamed_answer_keeps_every_chunks_ids_however_it_is_cut(
    tokens: list[tuple[int, float]], cuts: list[int], role_first: bool
) -> None:
    """Chunks carry any number of tokens (none: a role-only chunk, or an empty one between); the
    ids and log-probs put back together are all of them, in order."""
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    chunks: list[dict[str, Any]] = []
    if role_first:
        chunks.append(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]}
        )
    for lo, hi in zip(bounds, bounds[1:] or [0]):
        part = tokens[lo:hi]
        choice = {
            "index": 0,
            "delta": {"content": "x" * len(part)},
            "token_ids": [t for t, _ in part],
            "logprobs": {"content": [{"token": "x", "logprob": lp} for _, lp in part]},
        }
        chunks.append({"choices": [choice]})
    answer = StreamedAnswer(CHAT_ROUTE, {})
    for chunk in chunks:
        answer.add(chunk)
    [choice] = answer.generated().choices
    assert choice["token_ids"] == ([t for t, _ in tokens] or None)
    assert choice["log_probs"] == ([lp for _, lp in tokens] or None)


_ids = st.lists(st.integers(0, 2**31), max_size=4)
_logprobs = st.fixed_dictionaries(
    {
        "content": st.lists(
            st.fixed_dictionaries({"token": st.text(max_size=3), "logprob": st.floats(max_value=0)})
        )
    }
)
_choice = st.fixed_dictionaries(
    {"index": st.integers(0, 2), "delta": st.fixed_dictionaries({"content": st.text(max_size=4)})},
    optional={
        "token_ids": st.none() | _ids,
        "prompt_token_ids": st.none() | _ids,
        "logprobs": st.none() | _logprobs,
        "finish_reason": st.none() | st.sampled_from(["stop", "length"]),
    },
)
_chunk = st.fixed_dictionaries(
    {"choices": st.lists(_choice, max_size=3)},
    optional={"prompt_token_ids": st.none() | _ids, "model": st.text(max_size=3)},
)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(_chunk, max_size=6), added=st.sets(st.sampled_from(["ids", "logprobs"])))
def test_a_chunk_taken_on_the_way_reads_and_shows_as_one_read_after_the_stream(
    chunks: list[dict[str, Any]], added: set[str]
) -> None:
    """The proxy reads each chunk of a stream once, as it passes, and takes out what it asked for in
    place: the client sees what ``as_client_sees`` makes of the chunk as the server sent it, and the
    ids and log-probs put together are every choice's, in order, per index."""
    import copy

    from rlreplay.proxy.protocol import as_client_sees

    sent = copy.deepcopy(chunks)
    answer = StreamedAnswer(CHAT_ROUTE, {})
    for chunk, original in zip(chunks, sent):
        seen = answer.take(chunk, frozenset(added))
        want = as_client_sees(CHAT_ROUTE, original, frozenset(added), streamed=True)
        assert (seen if seen is not None else chunk) == want
        assert (seen is None) == (want is original)
    expected: dict[int, tuple[list[int], list[float]]] = {}
    for chunk in sent:
        for choice in chunk["choices"]:
            ids, values = expected.setdefault(choice["index"], ([], []))
            ids += choice.get("token_ids") or []
            values += [c["logprob"] for c in (choice.get("logprobs") or {"content": []})["content"]]
    got = answer.generated().choices
    assert len(got) == len(expected)
    for one, index in zip(got, sorted(expected)):
        ids, values = expected[index]
        assert one["token_ids"] == (ids or None)
        assert one["log_probs"] == (values or None)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=3)
    | st.sampled_from([2**70, -(2**64), "\ud83d", "a\udfff"]),  # what Python's JSON reader reads
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def _anything_or(strategy: Any) -> Any:
    return _json | strategy


_odd_call = st.fixed_dictionaries(
    {},
    optional={
        "index": _json,
        "function": _anything_or(st.fixed_dictionaries({}, optional={"name": _json, "arguments": _json})),
    },
)
_odd_choice = st.fixed_dictionaries(
    {},
    optional={
        "index": _json,
        "delta": _anything_or(
            st.fixed_dictionaries(
                {}, optional={"content": _json, "tool_calls": _anything_or(st.lists(_odd_call, max_size=2))}
            )
        ),
        "message": _json,
        "text": _json,
        "token_ids": _json,
        "prompt_token_ids": _json,
        "logprobs": _anything_or(
            st.fixed_dictionaries({}, optional={"content": _json, "token_logprobs": _json})
        ),
        "finish_reason": _json,
    },
)
_odd_chunk = st.fixed_dictionaries(
    {},
    optional={
        "choices": _anything_or(st.lists(_odd_choice, max_size=2)),
        "usage": _anything_or(st.fixed_dictionaries({}, optional={"prompt_tokens_details": _json})),
        "prompt_token_ids": _json,
        "model": _json,
        "response": _json,
        "meta_info": _json,
        "text": _json,
        "output_ids": _json,
    },
)


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(_odd_chunk | _json, max_size=4),
    route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses"]),
    added=st.sets(st.sampled_from(["ids", "logprobs"])),
    messages=st.lists(_json | st.fixed_dictionaries({"role": _json, "content": _json}), max_size=2),
)
def test_no_answer_a_server_sends_stops_the_proxy_reading_it(
    chunks: list[Any], route: str, added: set[str], messages: list[Any]
) -> None:
    """Whatever JSON a server's chunks or whole answer hold where the proxy looks (a choice
    numbered ``"x"``, tool calls that are a number, text that is a list), and whatever a request's
    messages hold (integers beyond 64 bits, lone surrogates), reading them for the record and for
    the next call's prompt raises nothing: the call's bytes are recorded whatever they say."""
    from rlreplay.format.keys import TrajectoryKey
    from rlreplay.proxy.protocol import as_client_sees, generated
    from rlreplay.proxy.trajectories import (
        ContinuationIndex,
        ProxyTrajectory,
        context_of,
        context_sequence,
        prompt_sequence,
    )

    body = {"messages": messages, "prompt": "hi", "input_ids": [1]}
    answer = StreamedAnswer(route, body)
    for chunk in chunks:
        answer.take(chunk, frozenset(added))
    answer.generated().record()
    index = ContinuationIndex()
    for context in (
        context_sequence(route, body, {"token_ids": [1]}, answer.chunks),
        prompt_sequence(route, body),
    ):
        if context is not None:
            kind, sequence = context
            traj = ProxyTrajectory(TrajectoryKey(), explicit=False)
            index.add(context_of(kind, sequence), traj)
            longer = sequence + "..." if isinstance(sequence, str) else (*sequence, "...")
            assert index.claim((kind, longer)) == (traj, False)  # the call that continues joins it
    for whole in chunks:
        generated(route, body, whole).record()
        as_client_sees(route, whole, frozenset(added))
        if isinstance(whole, dict):
            context_sequence(route, body, {"body": whole, "token_ids": [1]})
