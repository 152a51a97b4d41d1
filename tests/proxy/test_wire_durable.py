"""A proxy killed (SIGKILL) under load loses no call it answered: every call whose answer reached its
client ended (a whole body, or a stream's ``[DONE]``) is in the run once the run is recovered, or
counted lost/dropped in ``info``. ``rlreplay proxy`` is a real process, with 24 clients calling it
at once through a scripted loopback upstream, streamed and not."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import ProxyProcess
from support import rlreplay_proc
from test_proxy import llm_spans
from wire_upstream import Script, Upstream

pytestmark = pytest.mark.timeout(300)
CLIENTS = 24
LOAD_S = 4.0


def answer_pieces() -> list[bytes]:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": f"t{i}"}, "token_ids": [i], "finish_reason": None}]}
        for i in range(20)
    ]
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


async def load(url: str, answered: set[str], stop: asyncio.Event) -> None:
    counter = iter(range(10**9))

    async def client(n: int) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                tag = f"call-{n}-{next(counter)}"
                streamed = len(tag) % 2 == 0
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": tag}],
                    "stream": streamed,
                    "return_token_ids": True,
                    "logprobs": True,
                }
                headers = {"X-Test": "stream" if streamed else "whole"}
                try:
                    async with http.stream(
                        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        got = await r.aread()
                except httpx.HTTPError:
                    continue
                if r.status_code == 200 and (not streamed or got.endswith(b"data: [DONE]\n\n")):
                    answered.add(tag)

    await asyncio.gather(*(client(n) for n in range(CLIENTS)))


def test_sigkill_under_load_loses_no_answered_call(tmp_path: Path) -> None:
    upstream = Upstream()
    try:
        upstream.script("stream", Script(answer_pieces(), content_type="text/event-stream"))
        whole = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [7]}]
        }
        upstream.script("whole", Script([json.dumps(whole).encode()]))
        proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp_path)
        answered: set[str] = set()

        async def main() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(load(proxy.url, answered, stop))
            began = time.monotonic()
            # under load for a while, with answered calls behind it (a loaded machine answers slower)
            while time.monotonic() - began < LOAD_S or (len(answered) < 40 and time.monotonic() - began < 90):
                await asyncio.sleep(0.1)
            os.kill(proxy.proc.pid, signal.SIGKILL)  # mid-load: calls in flight everywhere
            await asyncio.sleep(0.5)
            stop.set()
            await task

        asyncio.run(main())
        proxy.proc.wait(30)
    finally:
        upstream.close()
    assert len(answered) > 30, "the load did not run"
    run = tmp_path / "run"
    time.sleep(0.5)
    done = rlreplay_proc("recover", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    recorded = {span.inputs["messages"][0]["content"] for _, spans in llm_spans(run) for span in spans}
    info = json.loads(rlreplay_proc("info", str(run), "--json", cwd=tmp_path).stdout)
    counted = sum(int(info.get(k) or 0) for k in ("lost", "dropped"))
    missing = answered - recorded
    assert len(missing) <= counted, (
        f"{len(missing)} answered calls missing, {counted} counted: {sorted(missing)[:5]}"
    )


@pytest.mark.parametrize("cut_at", [len(b"data: ["), len(b"data: [DONE")])
def test_an_end_that_comes_in_two_pieces_reaches_the_client_after_the_call_is_recorded(
    tmp_path: Path, cut_at: int
) -> None:
    """An upstream may write a stream's ``[DONE]`` in two pieces: the client still gets its last byte
    only once the call is recorded. The proxy is killed the moment the client holds the whole end,
    the upstream still holding the answer open; the recovered run has the call."""
    end = b"data: [DONE]\n\n"
    pieces = [*answer_pieces()[:-1], end[:cut_at], end[cut_at:]]
    upstream = Upstream()
    try:
        upstream.script("split", Script(pieces, content_type="text/event-stream", pause_s=0.05, hold_s=1.0))
        proxy = ProxyProcess("--upstream", upstream.url, "--out", "run", cwd=tmp_path)
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "split"}],
            "stream": True,
            "return_token_ids": True,
            "logprobs": True,
        }
        got = b""
        with httpx.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Test": "split"}, timeout=60
        ) as r:
            for piece in r.iter_raw():
                got += piece
                if got.endswith(end):
                    os.kill(proxy.proc.pid, signal.SIGKILL)
                    break
        proxy.proc.wait(30)
    finally:
        upstream.close()
    assert got == b"".join(pieces)
    done = rlreplay_proc("recover", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    recorded = [
        span.inputs["messages"][0]["content"] for _, spans in llm_spans(tmp_path / "run") for span in spans
    ]
    assert recorded == ["split"]
