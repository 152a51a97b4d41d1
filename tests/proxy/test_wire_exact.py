"""What ``rlreplay proxy`` forwards, records and replays is the bytes that went over the wire: a real
proxy process between a real client and a scripted loopback upstream (``wire_upstream.py``), then a
replay of the run with the upstream gone. For any request and answer (numbers beyond 64 bits, bare
NaN, lone surrogates, nesting 300 and 1,024 deep, non-JSON, token texts such as "token" and "***"):
the upstream gets the client's bytes, the client the upstream's, the run keeps both (the request's
values too), and the replay answers with the recorded bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ProxyProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_proxy import llm_spans
from wire_upstream import Script, Upstream

from rlreplay.format import payload

pytestmark = pytest.mark.timeout(600)
ASKED = '"return_token_ids": true, "logprobs": true'  # the client asks itself: nothing is added
WORDS = ["token", "***", "password", "secret", "sk", "Bearer", "<|im_end|>"]
# a value main's payload redaction still hides ("token: X" read as an assignment): in answers here,
# whose bytes are checked; in requests once redaction decides by what a value is
PROSE = "the next token: cat"


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


def request_bytes(values: str) -> bytes:
    return (
        '{"model": "m", ' + ASKED + ', "messages": [{"role": "user", "content": "hi"}], ' + values + "}"
    ).encode()


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def sse(*chunks: str) -> list[bytes]:
    return [f"data: {c}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
FIXED: list[tuple[Any, ...]] = [
    (
        request_bytes('"seed": 123456789012345678901234567890'),
        [b'{"id": "a", "n": 123456789012345678901234567890}'],
        False,
    ),
    (request_bytes('"x": "\\ud83d", "y": NaN, "z": -Infinity'), [b'{"t": "\\ud83d", "v": NaN}'], False),
    (request_bytes('"deep": ' + nested(300)), [('{"deep": ' + nested(300) + "}").encode()], False),
    (request_bytes('"deep": ' + nested(1024)), [b"not json at all \xff\xfe"], False),
    (b"this is not JSON \xff", [b'{"error": "bad request"}'], False),
    (
        request_bytes('"stream": true'),
        sse(
            '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
            '{"choices": [{"index": 0, "delta": {"content": "' + PROSE + '"}, "token_ids": [9],'
            ' "logprobs": {"content": [{"token": "token", "logprob": -0.5,'
            ' "top_logprobs": [{"token": "***", "logprob": -1.5}]}]}}]}',
        ),
        True,
    ),
    # OpenAI's Responses API (openai-agents' default), whole and streamed as typed events
    (
        b'{"model": "m", "input": "Name a colour.", "instructions": "Be brief."}',
        [
            b'{"id": "resp_1", "object": "response", "status": "completed", "output": [{"type": "message",'
            b' "role": "assistant", "content": [{"type": "output_text", "text": "red"}]}],'
            b' "usage": {"input_tokens": 9, "output_tokens": 1}}'
        ],
        False,
        RESPONSES,
    ),
    (
        b'{"model": "m", "input": [{"role": "user", "content": "Name a colour."}], "stream": true}',
        [
            b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_2"}}\n\n',
            b"event: response.output_text.delta\n"
            b'data: {"type": "response.output_text.delta", "delta": "red"}\n\n',
            b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "resp_2",'
            b' "status": "completed", "usage": {"input_tokens": 9, "output_tokens": 1}}}\n\n',
        ],
        True,
        RESPONSES,
    ),
]


def run_through(upstream: Upstream, cases: list[tuple[Any, ...]], tmp: Path, prefix: str) -> None:
    """Each case through a recording proxy, then through a replay of its run with no upstream."""
    tags = [f"{prefix}-{i}" for i in range(len(cases))]
    routes = [case[3] if len(case) > 3 else CHAT for case in cases]
    for tag, (_, answer, streamed, *_) in zip(tags, cases):
        upstream.script(
            tag, Script(answer, content_type="text/event-stream" if streamed else "application/json")
        )

    def call(url: str, i: int, raw: bytes) -> tuple[bytes, str]:
        headers = {
            "Content-Type": "application/json",
            "X-Test": tags[i],
            "X-Rlreplay-Trajectory": f"step=0,sample_index={i}",
        }
        got = httpx.post(f"{url}{routes[i]}", content=raw, headers=headers, timeout=60)
        assert got.status_code == 200, got.text
        return got.content, got.headers["Content-Type"]

    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp)
    types = []  # the Content-Type each answer reached the client with
    try:
        for i, (raw, answer, *_) in enumerate(cases):
            body, content_type = call(proxy.url, i, raw)
            assert body == b"".join(answer)  # the client gets the upstream's bytes
            assert upstream.got[tags[i]][1] == raw  # the upstream gets the client's
            types.append(content_type)
    finally:
        assert proxy.stop() == 0, proxy.stderr
    spans = {}
    for traj, [span] in llm_spans(tmp / "run"):
        spans[traj.sample_index] = span
    for i, (raw, answer, *_) in enumerate(cases):
        wire_in = payload.from_json(spans[i].inputs["wire"], None)
        wire_out = payload.from_json(spans[i].output["wire"], None)
        assert (wire_in, wire_out) == (raw, b"".join(answer))
        assert "body" not in spans[i].output  # an answer is kept once: as its bytes
        value = json_value(raw)
        # the values too, where the run keeps them as values (a lone surrogate is kept in the bytes:
        # a value holds it written out, "\\ud83d")
        if value is not None and depth(value) < 20 and not lone_surrogates(value):
            inputs = payload.from_json(spans[i].inputs, None)
            kept = {k: v for k, v in inputs.items() if k not in ("wire", "prompt_ids")}
            assert canonical(kept) == canonical(value)
    replay = ProxyProcess("--replay", "run", "--on-diverge", "fail", "--out", "replayed", cwd=tmp)
    try:
        for i, (raw, answer, *_) in enumerate(cases):
            # the recorded bytes, served as the client got them
            assert call(replay.url, i, raw) == (b"".join(answer), types[i])
    finally:
        assert replay.stop() == 0, replay.stderr


def json_value(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def lone_surrogates(value: Any) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in json.dumps(value, ensure_ascii=False))


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)  # NaN as NaN: equal where the values are


def test_fixed_bodies_go_through_exactly(upstream: Upstream, tmp_path: Path) -> None:
    run_through(upstream, FIXED, tmp_path, "fixed")
    responses = [s for _, spans in llm_spans(tmp_path / "run") for s in spans if s.name == "responses"]
    assert len(responses) == 2  # /v1/responses calls are model calls of the run, whole and streamed
    for span in responses:
        assert span.output["usage"] == {"input_tokens": 9, "output_tokens": 1}
        assert span.output["finish_reason"] == "completed"


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**100), max_value=2**100),
    st.floats(),  # NaN and the infinities included: Python writes them bare
    st.text(st.characters(codec=None, exclude_categories=["Cs"]), max_size=8),
    st.sampled_from(WORDS),
    st.sampled_from(["\ud83d", "a\udc00b"]),  # lone surrogates, written escaped
)
KEYS = st.one_of(
    st.sampled_from(["text", "token", "content", "seed", "n", "***"]), st.text("abcxyz", max_size=4)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
ANSWER_VALUES = st.recursive(
    st.one_of(SCALARS, st.just(PROSE)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cases=st.lists(
        st.tuples(
            st.dictionaries(KEYS, VALUES, max_size=4),
            st.lists(ANSWER_VALUES, min_size=1, max_size=3),
            st.integers(0, 40),
            st.booleans(),
            st.booleans(),
        ),
        min_size=6,
        max_size=6,
    )
)
def test_any_json_goes_through_exactly(upstream: Upstream, tmp_path_factory: Any, cases: list[Any]) -> None:
    built = []
    reserved = ("model", "messages", "return_token_ids", "logprobs", "stream")
    for extra, answers, deep, spaced, streamed in cases:
        extra = {k: v for k, v in extra.items() if k not in reserved}
        separators = (", ", ": ") if spaced else (",", ":")
        values = json.dumps(extra, separators=separators)[1:-1]
        values += (", " if values else "") + '"deep": ' + nested(deep)
        if streamed:  # SSE chunks of any JSON, then [DONE]
            chunks = [json.dumps({"choices": [{"index": 0, "delta": {"content": a}}]}) for a in answers]
            built.append((request_bytes(values + ', "stream": true'), sse(*chunks), True))
        else:
            answer = json.dumps({"answer": answers}, separators=separators).encode()
            built.append((request_bytes(values), [answer], False))
    run_through(upstream, built, tmp_path_factory.mktemp("wire"), f"any-{id(cases)}")


ODD_VALUES = ['"v": NaN', '"v": -Infinity', '"v": 123456789012345678901234567890', '"v": "\\ud83d"']


def _without_what_was_asked(value: Any, streamed: bool) -> Any:
    """The upstream's answer as a client that asked for no ids and log-probs gets it: a streamed
    chunk's ``token_ids`` taken out, a whole answer's set to null; ``logprobs`` null."""
    for choice in value["choices"]:
        if streamed:
            del choice["token_ids"]
        else:
            choice["token_ids"] = None
        choice["logprobs"] = None
    return value


def test_what_the_proxy_asked_for_is_taken_out_and_no_other_value_changes(
    upstream: Upstream, tmp_path: Path
) -> None:
    """A client that did not ask for ids and log-probs gets the answer without them, every other
    value as the upstream sent it (bare NaN and Infinity, integers beyond 64 bits, lone
    surrogates), streamed and whole; the run records the ids and log-probs."""
    asked = '"token_ids": [9], "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]}'
    cases = []
    for odd in ODD_VALUES:
        delta = '{"choices": [{"index": 0, "delta": {"content": "hi"}, ' + asked + "}], " + odd + "}"
        message = '{"role": "assistant", "content": "hi"}'
        whole = '{"choices": [{"index": 0, "message": ' + message + ", " + asked + "}], " + odd + "}"
        cases += [(delta, True), (whole, False)]
    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp_path)
    try:
        for i, (answer, streamed) in enumerate(cases):
            tag = f"asked-{i}"
            pieces = sse(answer) if streamed else [answer.encode()]
            upstream.script(
                tag, Script(pieces, content_type="text/event-stream" if streamed else "application/json")
            )
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": streamed}
            got = httpx.post(
                f"{proxy.url}{CHAT}",
                json=body,
                headers={"X-Test": tag, "X-Rlreplay-Trajectory": f"step=0,sample_index={i}"},
                timeout=60,
            )
            assert got.status_code == 200, got.text
            sent = json.loads(upstream.got[tag][1])
            assert sent.get("logprobs") and sent.get("return_token_ids")  # the proxy asked
            received = got.content.split(b"\n\n")[0].removeprefix(b"data: ") if streamed else got.content
            expected = _without_what_was_asked(json.loads(answer), streamed)
            assert canonical(json.loads(received)) == canonical(expected), (answer, received)
    finally:
        assert proxy.stop() == 0, proxy.stderr
    recorded = {traj.sample_index: span for traj, [span] in llm_spans(tmp_path / "run")}
    assert sorted(recorded) == list(range(len(cases)))
    assert all(span.output["token_ids"] == [9] for span in recorded.values())


@pytest.mark.parametrize("index", ['"x"', "[1]", "{}", "1e400", '"0"'])
@pytest.mark.parametrize("client_asks", [False, True])
def test_a_choice_whose_index_is_no_whole_number_is_answered_and_recorded(
    upstream: Upstream, tmp_path: Path, index: str, client_asks: bool
) -> None:
    """An upstream whose chunk names its choice (or a tool call) by something other than a whole
    number: the client gets every byte of the stream, the call is recorded with them, and the ids
    of the choice that is numbered are kept."""
    chunks = [
        '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
        '{"choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [7],'
        ' "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]}}]}',
        '{"choices": [{"index": '
        + index
        + ', "delta": {"content": "yo", "tool_calls": [{"index": '
        + index
        + ', "function": {"name": "f", "arguments": "{}"}}]}, "token_ids": [8]}]}',
    ]
    tag = f"index-{index}-{client_asks}"
    upstream.script(tag, Script(sse(*chunks), content_type="text/event-stream"))
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if client_asks:
        body.update(return_token_ids=True, logprobs=True)
    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp_path)
    try:
        got = httpx.post(f"{proxy.url}{CHAT}", json=body, headers={"X-Test": tag}, timeout=60)
    finally:
        assert proxy.stop() == 0, proxy.stderr
    assert got.status_code == 200, got.text
    assert got.content.endswith(b"data: [DONE]\n\n")
    received = [json.loads(e.removeprefix(b"data: ")) for e in got.content.split(b"\n\n")[:-2]]
    assert [c["choices"][0]["delta"] for c in received] == [
        json.loads(c)["choices"][0]["delta"] for c in chunks
    ]
    [(_, [span])] = llm_spans(tmp_path / "run")
    assert payload.from_json(span.output["wire"], None) == got.content
    assert list(span.output["token_ids"])[:1] == [7]


def test_a_conversation_holding_what_orjson_cannot_write_is_one_trajectory(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Messages whose content holds an integer beyond 64 bits or a lone surrogate (what Python's
    JSON reader reads and orjson cannot write): each call is answered and recorded, the call that
    continues the conversation joins its trajectory, and a replay answers both from the run."""
    odd = '[{"type": "text", "text": "hi"}, 123456789012345678901234567890, "\\ud83d"]'
    first = '{"model": "m", "messages": [{"role": "user", "content": ' + odd + "}]}"
    answer = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}}]}'
    second = first[:-2] + ', {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}]}'
    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp_path)
    try:
        for i, raw in enumerate((first, second)):
            upstream.script(f"odd-{i}", Script([answer], content_type="application/json"))
            got = httpx.post(
                f"{proxy.url}{CHAT}",
                content=raw.encode(),
                headers={"Content-Type": "application/json", "X-Test": f"odd-{i}"},
                timeout=60,
            )
            assert got.status_code == 200, got.text
            assert got.content == answer
    finally:
        assert proxy.stop() == 0, proxy.stderr
    [(_, spans)] = llm_spans(tmp_path / "run")
    assert [payload.from_json(s.inputs["wire"], None) for s in spans] == [first.encode(), second.encode()]
    replay = ProxyProcess("--replay", "run", "--on-diverge", "fail", "--out", "replayed", cwd=tmp_path)
    try:
        for raw in (first, second):
            got = httpx.post(
                f"{replay.url}{CHAT}",
                content=raw.encode(),
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            assert (got.status_code, got.content) == (200, answer)  # the recorded answer, served
    finally:
        assert replay.stop() == 0, replay.stderr
