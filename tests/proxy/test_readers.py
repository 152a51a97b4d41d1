"""The proxy's reading processes (``--readers``): a run is the same whether the proxy's answers are
read in reading processes or in its own (``--readers 0``), and a reading process that dies mid-run
costs no record: the proxy reads the rest itself and says so once. ``rlreplay proxy`` is a real
process in front of a scripted loopback upstream."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ProxyProcess
from test_proxy import llm_spans
from wire_upstream import Script, Upstream

from rlreplay.format import payload

pytestmark = pytest.mark.timeout(300)
CHAT = "/v1/chat/completions"
SECRET = "sk-proj-Q7vR2mX9kLp4Tz8WbN3cYd6Hf1Js5Ga0"


@pytest.fixture(scope="module")
def upstream() -> Any:
    server = Upstream()
    yield server
    server.close()


def streamed(ids: list[int], text: str) -> list[bytes]:
    """An answer streamed as vLLM streams it when asked for ids and log-probs: a token a chunk."""
    pieces = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    ]
    words = text.split(" ")
    for i, token in enumerate(ids):
        delta = {"content": (" " if i else "") + words[i]}
        logprobs = {"content": [{"token": words[i], "logprob": -0.25 * (i + 1), "top_logprobs": []}]}
        finish = "stop" if i == len(ids) - 1 else None
        pieces.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": logprobs,
                        "token_ids": [token],
                        "finish_reason": finish,
                    }
                ]
            }
        )
    return [b"data: " + json.dumps(p).encode() + b"\n\n" for p in pieces] + [b"data: [DONE]\n\n"]


def whole(ids: list[int], text: str) -> list[bytes]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": [{"token": "w", "logprob": -0.5} for _ in ids]},
        "token_ids": ids,
        "finish_reason": "stop",
    }
    return [json.dumps({"choices": [choice]}).encode()]


def without_ids(pieces: list[bytes]) -> bytes:
    """A stream as a client that did not ask for ids and log-probs gets it: each chunk that holds
    them written again without them (ids left out, log-probs null), every other member's value as
    :func:`streamed` wrote it; the other chunks as they came."""
    out = []
    for piece in pieces:
        chunk = json.loads(piece[6:]) if piece != b"data: [DONE]\n\n" else None
        choice = chunk["choices"][0] if chunk else {}
        if "token_ids" not in choice and choice.get("logprobs") is None:
            out.append(piece)
            continue
        choice.pop("token_ids", None)
        choice["logprobs"] = None
        members = ",".join(f"{json.dumps(name)}:{json.dumps(value)}" for name, value in choice.items())
        out.append(b'data: {"choices":[{' + members.encode() + b"}]}\n\n")
    return b"".join(out)


#: (tag, streamed, whether the client asks for ids and log-probs, the answer's ids, its text): a
#: conversation of four calls, the first answer holding a key, the last one rewritten by the
#: proxy (it asks for what the client did not); then an answer that is no JSON
CALLS = [
    ("first", True, True, [11, 12, 13], f"use {SECRET} here"),
    ("second", False, True, [21, 22], "done now"),
    ("third", True, True, [31, 32], "and more"),
    ("fourth", True, False, [41, 42, 43], "the last one"),
]


def converse(proxy: ProxyProcess, upstream: Upstream, prefix: str) -> list[bytes]:
    """The conversation through ``proxy``; what the client got."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{prefix}: go"}]
    got = []
    for tag, is_stream, asks, ids, text in CALLS:
        answer = streamed(ids, text) if is_stream else whole(ids, text)
        kind = "text/event-stream" if is_stream else "application/json"
        upstream.script(f"{prefix}-{tag}", Script(answer, content_type=kind))
        body: dict[str, Any] = {"model": "m", "messages": messages, "stream": is_stream}
        if asks:
            body.update(logprobs=True, return_token_ids=True)
        reply = httpx.post(f"{proxy.url}{CHAT}", json=body, headers={"X-Test": f"{prefix}-{tag}"})
        assert reply.status_code == 200, reply.text
        assert reply.content == (b"".join(answer) if asks else without_ids(answer))
        got.append(reply.content)
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "on"}]
    upstream.script(f"{prefix}-odd", Script([b"not json at all"], content_type="text/plain"))
    reply = httpx.post(
        f"{proxy.url}{CHAT}",
        json={"model": "m", "messages": [{"role": "user", "content": f"{prefix}: odd"}]},
        headers={"X-Test": f"{prefix}-odd"},
    )
    assert (reply.status_code, reply.content) == (200, b"not json at all")
    return got


def recorded(run: Path) -> list[list[dict[str, Any]]]:
    """Each trajectory's calls as recorded: the answer's kept bytes, ids, log-probs, finish reason."""
    out = []
    for _, spans in llm_spans(run):
        calls = []
        for span in spans:
            output = span.output
            calls.append(
                {
                    "wire": payload.from_json(output.get("wire"), None),
                    "token_ids": list(output.get("token_ids") or []),
                    "log_probs": list(output.get("log_probs") or []),
                    "finish_reason": output.get("finish_reason"),
                }
            )
        out.append(calls)
    return sorted(out, key=len, reverse=True)


def reading_processes(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


@pytest.mark.parametrize("readers", [0, 2])
def test_a_run_is_the_same_read_in_reading_processes_or_in_the_proxy(
    upstream: Upstream, tmp_path: Path, readers: int
) -> None:
    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", "--readers", str(readers), cwd=tmp_path)
    try:
        answers = converse(proxy, upstream, f"r{readers}")
        assert len(reading_processes(proxy.proc.pid)) == readers
    finally:
        assert proxy.stop() == 0, proxy.stderr
    conversation, odd = recorded(tmp_path / "run")
    # the calls continue one another: one trajectory; the answer that is no JSON: another
    assert [len(conversation), len(odd)] == [len(CALLS), 1]
    for call, (_, is_stream, _, ids, _), answer in zip(conversation, CALLS, answers):
        assert call["wire"] == answer.replace(SECRET.encode(), b"***")  # the key, and only it, hidden
        assert call["token_ids"] == ids
        expected_lps = [-0.25 * (i + 1) for i in range(len(ids))] if is_stream else [-0.5] * len(ids)
        assert call["log_probs"] == expected_lps
        assert call["finish_reason"] == "stop"
    assert odd == [{"wire": b"not json at all", "token_ids": [], "log_probs": [], "finish_reason": None}]
    assert SECRET not in proxy.stderr
    assert "could not read" not in proxy.stderr  # the reading processes read every answer


def test_a_reading_process_that_dies_costs_no_record(upstream: Upstream, tmp_path: Path) -> None:
    proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", "--readers", "1", cwd=tmp_path)
    try:
        before = converse(proxy, upstream, "alive")
        [reader] = reading_processes(proxy.proc.pid)
        os.kill(reader, signal.SIGKILL)
        after = converse(proxy, upstream, "killed")
    finally:
        assert proxy.stop() == 0, proxy.stderr
    runs = recorded(tmp_path / "run")
    assert [len(calls) for calls in runs] == [len(CALLS), len(CALLS), 1, 1]
    for calls in runs[:2]:
        assert [c["token_ids"] for c in calls] == [ids for _, _, _, ids, _ in CALLS]
    wires = sorted(c["wire"] for calls in runs[:2] for c in calls)
    assert wires == sorted(a.replace(SECRET.encode(), b"***") for a in before + after)
    assert proxy.stderr.count("a reading process stopped") == 1
    assert "Traceback" not in proxy.stderr
