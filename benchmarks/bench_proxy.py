"""What ``rlreplay proxy`` adds to a model call: latency (p50/p99) and the proxy's CPU per request,
at 1 and 256 concurrent streams, beside calling the upstream directly and beside a bare aiohttp
forwarder (forwarding alone, the HTTP parsing floor).

The upstream is a fast stand-in (it measures the proxy, not a model): an aiohttp server answering
``/v1/chat/completions`` as vLLM does, with a 1,000-token prompt and a 200-token answer, and token
ids and log-probs when asked. Each party runs in its own process; CPU is read from
``/proc/PID/stat`` over the measured requests. Needs the ``proxy`` extra; Linux.

    .venv/bin/python benchmarks/bench_proxy.py [--requests 2000] [--streams 1,256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

PROMPT_IDS = 1000
ANSWER_IDS = 200

UPSTREAM = r"""
import sys, orjson, random
from aiohttp import web
rng = random.Random(0)
prompt = [rng.randrange(50000) for _ in range(int(sys.argv[2]))]
ids = [rng.randrange(50000) for _ in range(int(sys.argv[3]))]
lps = [-rng.random() * 3 for _ in ids]
text = " ".join(f"w{i}" for i in ids)
async def chat(request):
    body = orjson.loads(await request.read())
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
              "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
    if body.get("logprobs"):
        content = [{"token": "w", "logprob": lp, "bytes": [119], "top_logprobs": []} for lp in lps]
        choice["logprobs"] = {"content": content}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    n, m = len(prompt), len(ids)
    usage = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [choice], "usage": usage, "prompt_logprobs": None,
              "prompt_token_ids": prompt if body.get("return_token_ids") else None}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")
app = web.Application(); app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

FORWARDER = r"""
import sys, aiohttp
from aiohttp import web
up = sys.argv[2]
async def start(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
async def fwd(request):
    body = await request.read()
    headers = {"Content-Type": "application/json"}
    async with request.app["s"].post(up + request.path, data=body, headers=headers) as r:
        return web.Response(body=await r.read(), status=r.status, content_type="application/json")
app = web.Application(); app.on_startup.append(start); app.router.add_post("/v1/chat/completions", fwd)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            try:
                async with s.get(url) as r:
                    await r.read()
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


def request_body() -> bytes:
    rng = random.Random(1)
    words = " ".join(f"t{rng.randrange(9999)}" for _ in range(PROMPT_IDS))
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": ANSWER_IDS}
    )


async def load(url: str, total: int, streams: int, body: bytes) -> list[float]:
    """Latencies (s) of ``total`` calls over ``streams`` concurrent streams, each a new trajectory."""
    latencies: list[float] = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(k: int) -> None:
            for _i in range(total // streams):
                t = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(one(k) for k in range(streams)))
    return latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def measure(
    url: str, pid: int | None, total: int, streams: int, body: bytes
) -> tuple[float, float, float | None]:
    asyncio.run(load(url, min(total, 200), streams, body))  # warm up
    before = cpu_s(pid) if pid else 0.0
    latencies = asyncio.run(load(url, total, streams, body))
    cpu = (cpu_s(pid) - before) / len(latencies) * 1e6 if pid else None
    return pct(latencies, 0.5), pct(latencies, 0.99), cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--streams", default="1,256")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    try:
        up_port, fwd_port, proxy_port = free_port(), free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        procs.append(
            subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port), str(PROMPT_IDS), str(ANSWER_IDS)])
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", FORWARDER, str(fwd_port), upstream], stderr=subprocess.DEVNULL
            )
        )
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlreplay",
                "proxy",
                "--upstream",
                upstream,
                "--port",
                str(proxy_port),
                "--out",
                str(tmp / "run"),
                "--idle-close",
                "5",
            ],
            stderr=subprocess.DEVNULL,
        )
        procs.append(proxy)
        for port in (up_port, fwd_port, proxy_port):
            asyncio.run(wait_up(f"http://127.0.0.1:{port}/health"))
        body = request_body()
        print(
            f"load average {os.getloadavg()[0]:.1f}; {args.requests} calls per row; "
            f"prompt {PROMPT_IDS} ids, answer {ANSWER_IDS} ids"
        )
        print(
            "| streams | direct p50 / p99 | bare forwarder: added p50 / p99, CPU/call | "
            "rlreplay proxy: added p50 / p99, CPU/call |"
        )
        print("|---:|---:|---:|---:|")
        for streams in (int(s) for s in args.streams.split(",")):
            d50, d99, _ = measure(f"{upstream}/v1/chat/completions", None, args.requests, streams, body)
            f50, f99, fcpu = measure(
                f"http://127.0.0.1:{fwd_port}/v1/chat/completions", procs[1].pid, args.requests, streams, body
            )
            p50, p99, pcpu = measure(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions", proxy.pid, args.requests, streams, body
            )
            print(
                f"| {streams} | {d50:.2f} / {d99:.2f} ms "
                f"| +{f50 - d50:.2f} / +{f99 - d99:.2f} ms, {fcpu:.0f} µs "
                f"| +{p50 - d50:.2f} / +{p99 - d99:.2f} ms, {pcpu:.0f} µs |"
            )
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
