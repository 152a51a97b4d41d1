"""What goes over the proxy's wire when things go wrong, and the headers that go with a body:
``rlreplay proxy`` as a real process in front of a scripted loopback upstream
(``wire_upstream.py``). An upstream's error status, a stream it breaks off and a client that goes
away are spans with an error status and the reason; a client whose upstream broke its stream sees
its own stream fail, as it would without the proxy; a gzip body reaches the upstream with headers
that say what it is; numbers beyond 64 bits reach it as the client wrote them."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_proxy import llm_spans
from wire_upstream import Script, Upstream

from rlreplay.format import payload

pytestmark = pytest.mark.timeout(300)
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


def chunk(text: str, ids: list[int]) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": text}, "token_ids": ids, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def spans_of(run: Path) -> list[Any]:
    return [s for _, spans in llm_spans(run) for s in spans]


def test_an_upstream_error_status_is_passed_on_as_is_and_recorded_as_an_error(
    upstream: Upstream, start_proxy: Any, tmp_path: Path
) -> None:
    failing = b'{"error": {"message": "model overloaded", "code": 500}}'
    upstream.script("e500", Script([failing], status=500))
    proxy = start_proxy("--upstream", upstream.url, "--out", "run")
    got = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={"X-Test": "e500"})
    assert (got.status_code, got.content) == (500, failing)
    assert proxy.stop() == 0, proxy.stderr
    [span] = spans_of(tmp_path / "run")
    assert span.status == "error"
    assert "500" in span.error and "model overloaded" in span.error


def test_a_stream_the_upstream_breaks_off_fails_for_the_client_and_is_an_error(
    upstream: Upstream, start_proxy: Any, tmp_path: Path
) -> None:
    pieces = [chunk("a", [1]), chunk("b", [2])]
    upstream.script("cut", Script(pieces, content_type="text/event-stream", cut=True))
    body = {**CHAT_BODY, "stream": True, "return_token_ids": True, "logprobs": True}
    # without the proxy, the client's read fails (curl: exit 18)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST", f"{upstream.url}/v1/chat/completions", json=body, headers={"X-Test": "cut"}
        ) as r,
    ):
        r.read()
    proxy = start_proxy("--upstream", upstream.url, "--out", "run")
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Test": "cut"}) as r,
    ):
        for part in r.iter_bytes():
            got += part
    assert got == b"".join(pieces)  # what came, and then the failure
    assert proxy.stop() == 0, proxy.stderr
    [span] = spans_of(tmp_path / "run")
    assert span.status == "error" and "broke off" in span.error


def test_a_client_that_goes_away_mid_stream_leaves_an_error_span(
    upstream: Upstream, start_proxy: Any, tmp_path: Path
) -> None:
    pieces = [chunk(str(i), [i]) for i in range(40)] + [b"data: [DONE]\n\n"]
    upstream.script("gone", Script(pieces, content_type="text/event-stream", pause_s=0.05))
    body = {**CHAT_BODY, "stream": True, "return_token_ids": True, "logprobs": True}
    proxy = start_proxy("--upstream", upstream.url, "--out", "run")
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Test": "gone"}) as r:
        next(r.iter_bytes())  # the first piece, then the client leaves
    time.sleep(2.5)  # the upstream goes on; the proxy's next write finds the client gone
    assert proxy.stop() == 0, proxy.stderr
    [span] = spans_of(tmp_path / "run")
    assert span.status == "error" and "client went away" in span.error


def test_a_gzip_body_reaches_the_upstream_with_headers_that_say_what_it_is(
    upstream: Upstream, start_proxy: Any, tmp_path: Path
) -> None:
    upstream.script("gz", Script([json.dumps(ANSWER).encode()]))
    raw = json.dumps({**CHAT_BODY, "return_token_ids": True, "logprobs": True}).encode()
    proxy = start_proxy("--upstream", upstream.url, "--out", "run")
    for route in ("/v1/chat/completions", "/v1/models"):  # recorded, and passed through
        got = httpx.post(
            f"{proxy.url}{route}",
            content=gzip.compress(raw),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json", "X-Test": "gz"},
        )
        assert got.status_code == 200
        headers, body = upstream.got["gz"]
        encoding = {k.lower(): v for k, v in headers.items()}.get("content-encoding", "identity")
        assert (gzip.decompress(body) if encoding == "gzip" else body) == raw
    assert proxy.stop() == 0, proxy.stderr
    [span] = spans_of(tmp_path / "run")
    assert span.inputs["messages"] == CHAT_BODY["messages"]


def test_numbers_beyond_64_bits_reach_the_upstream_as_the_client_wrote_them(
    upstream: Upstream, start_proxy: Any, tmp_path: Path
) -> None:
    upstream.script("big", Script([json.dumps(ANSWER).encode()]))
    raw = (
        b'{"model": "m", "seed": 123456789012345678901234567890, '
        b'"messages": [{"role": "user", "content": "hi"}]}'
    )
    proxy = start_proxy("--upstream", upstream.url, "--out", "run")
    got = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json", "X-Test": "big"},
    )
    assert (got.status_code, got.content) == (200, json.dumps(ANSWER).encode())  # nothing to take out
    _, sent = upstream.got["big"]
    # what the proxy asks for goes first; every byte the client wrote follows as it was
    assert sent.endswith(raw[1:]) and sent.startswith(b"{")
    added = json.loads(sent)
    assert added.pop("return_token_ids") is True and added.pop("logprobs") is True
    assert added == json.loads(raw) and added["seed"] == 123456789012345678901234567890
    assert proxy.stop() == 0, proxy.stderr
    [span] = spans_of(tmp_path / "run")
    assert payload.from_json(span.inputs, None)["seed"] == 123456789012345678901234567890


def test_a_port_in_use_is_one_line_exit_2_and_leaves_no_run(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlreplay",
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                str(port),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # no run made, none to become the default
