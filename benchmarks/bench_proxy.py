"""What ``rlreplay proxy`` adds to a model call: latency (p50/p99 over direct), calls/s and the
process's CPU per call, at 1, 32 and 256 concurrent streams, streamed and not, 200- and 2,000-token
answers, beside calling the upstream directly and beside a bare aiohttp forwarder (forwarding
alone, streams piped piece by piece: the HTTP floor). At the end the run is read back: every
recorded call's response ids and log-probs are checked against the stand-in's.

The upstream is a fast stand-in (it measures the proxy, not a model): an aiohttp server answering
``/v1/chat/completions`` as vLLM does, a 1,000-token prompt, ``max_tokens`` answer tokens, token ids
and float32 log-probs when asked; streamed as vLLM's ``serving_chat`` streams (a role-only first
chunk, then a chunk per token). Each party runs in its own process; CPU is read from
``/proc/PID/stat`` over the measured requests, and printed as a ratio to the forwarder's. The
proxy's CPU is its serving process's (with its recorder threads: encoding, writing, the wait for
each call to be in the live file) plus its reading processes' (``--readers``), each shown and
both compared. Needs the ``proxy`` extra; Linux.

With ``--callgrind`` (valgrind installed) the forwarder and the proxy each run under callgrind instead,
and the instructions per call are counted (independent of the machine's load), the proxy's split into
its event loop (HTTP, JSON, handing spans to the recorder) and the recorder's threads.

    .venv/bin/python benchmarks/bench_proxy.py [--requests 2000] [--streams 1,32,256] [--answers 200,2000]
    .venv/bin/python benchmarks/bench_proxy.py --callgrind [--json] [--client-asks] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port

PROMPT_IDS = 1000
ANSWER_IDS = (200, 2000)

UPSTREAM = r"""
import sys, orjson, random, struct
from aiohttp import web
rng = random.Random(0)
prompt = [rng.randrange(50000) for _ in range(int(sys.argv[2]))]
ids = [rng.randrange(50000) for _ in range(int(sys.argv[3]))]
# float32 values, as vLLM's log-prob tensors give them
lps = [struct.unpack("f", struct.pack("f", -rng.random() * 3))[0] for _ in ids]
async def chat(request):
    body = orjson.loads(await request.read())
    m = min(int(body.get("max_tokens") or 16), len(ids))
    want_ids, want_lp = body.get("return_token_ids"), body.get("logprobs")
    if body.get("stream"):  # as vLLM's serving_chat: the role alone, then one chunk per token
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]}
        if want_ids:
            head["prompt_token_ids"] = prompt
        await out.write(b"data: " + orjson.dumps(head) + b"\n\n")
        for i in range(m):
            finish = "length" if i == m - 1 else None
            choice = {"index": 0, "delta": {"content": f" w{ids[i]}"}, "finish_reason": finish}
            entry = {"token": "w", "logprob": lps[i], "bytes": [119], "top_logprobs": []}
            choice["logprobs"] = {"content": [entry]} if want_lp else None
            if want_ids:
                choice["token_ids"] = [ids[i]]
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [choice]}
            await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
    text = " ".join(f"w{i}" for i in ids[:m])
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
              "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
    if want_lp:
        content = [{"token": "w", "logprob": lp, "bytes": [119], "top_logprobs": []} for lp in lps[:m]]
        choice["logprobs"] = {"content": content}
    if want_ids:
        choice["token_ids"] = ids[:m]
    n = len(prompt)
    usage = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [choice], "usage": usage, "prompt_logprobs": None,
              "prompt_token_ids": prompt if want_ids else None}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")
app = web.Application(); app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

FORWARDER = r"""
import sys, aiohttp
from aiohttp import web
up = sys.argv[2]
async def start(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
async def fwd(request):
    body = await request.read()
    headers = {"Content-Type": "application/json"}
    async with request.app["s"].post(up + request.path, data=body, headers=headers) as r:
        out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})
        await out.prepare(request)
        async for piece in r.content.iter_any():
            await out.write(piece)
        await out.write_eof()
        return out
app = web.Application(); app.on_startup.append(start); app.router.add_post("/v1/chat/completions", fwd)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def upstream_tokens() -> tuple[list[int], list[float]]:
    """The stand-in's answer ids and log-probs (the same seeded draws as its own)."""
    import struct

    rng = random.Random(0)
    for _ in range(PROMPT_IDS):
        rng.randrange(50000)
    ids = [rng.randrange(50000) for _ in range(max(ANSWER_IDS))]
    lps = [struct.unpack("f", struct.pack("f", -rng.random() * 3))[0] for _ in ids]
    return ids, lps


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s(pid: int) -> float:
    """CPU of ``pid``'s running child processes (the proxy's reading processes)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += cpu_s(int(child))
    return total


async def wait_up(url: str, tries: int = 600) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(tries):
            try:
                async with s.get(url) as r:
                    await r.read()
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


def request_body(answer: int, streamed: bool, client_asks: bool = False) -> bytes:
    """The call; ``client_asks``: the client asks for ids and log-probs itself (the proxy adds
    nothing and passes the answer's bytes as they come)."""
    rng = random.Random(1)
    words = " ".join(f"t{rng.randrange(9999)}" for _ in range(PROMPT_IDS))
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": answer}
    body["stream"] = streamed
    if client_asks:
        body.update(return_token_ids=True, logprobs=True)
    return orjson.dumps(body)


async def load(url: str, total: int, streams: int, body: bytes) -> tuple[list[float], float]:
    """Latencies (s) of ``total`` calls over ``streams`` concurrent streams, each a new trajectory,
    and the wall time they took."""
    latencies: list[float] = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(k: int) -> None:
            for _i in range(max(1, total // streams)):
                t = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                latencies.append(time.perf_counter() - t)

        began = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(streams)))
    return latencies, time.perf_counter() - began


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def measure(url: str, pid: int | None, total: int, streams: int, body: bytes) -> dict[str, float]:
    asyncio.run(load(url, min(total, max(streams, 64)), streams, body))  # warm up
    before = (cpu_s(pid), children_cpu_s(pid)) if pid else (0.0, 0.0)
    latencies, wall = asyncio.run(load(url, total, streams, body))
    after = (cpu_s(pid), children_cpu_s(pid)) if pid else (0.0, 0.0)
    own, children = ((a - b) / len(latencies) * 1e3 for a, b in zip(after, before))
    return {
        "p50": pct(latencies, 0.5),
        "p99": pct(latencies, 0.99),
        "own": own,  # the serving process
        "cpu": own + children,  # with its reading processes
        "rate": len(latencies) / wall,
    }


def start(argv: list[str], procs: list[subprocess.Popen]) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(proc)
    return proc


def proxy_argv(port: int | str, upstream: str, out: Path, readers: int | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlreplay",
        "proxy",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--out",
        str(out),
        "--idle-close",
        "5",
        *([] if readers is None else ["--readers", str(readers)]),
    ]


def timed(args: argparse.Namespace, procs: list[subprocess.Popen], tmp: Path, upstream: str) -> None:
    """Latency, calls/s and CPU per call, the three side by side, per answer and number of streams."""
    fwd_port, proxy_port = free_port(), free_port()
    forwarder = start([sys.executable, "-c", FORWARDER, str(fwd_port), upstream], procs)
    proxy = start(proxy_argv(proxy_port, upstream, tmp / "run", args.readers), procs)
    for port in (fwd_port, proxy_port):
        asyncio.run(wait_up(f"http://127.0.0.1:{port}/health"))
    print(
        f"load average {os.getloadavg()[0]:.1f} at the start; {args.requests} calls per row; "
        f"prompt {PROMPT_IDS} ids; CPU per call in ms of the process; added = over direct; "
        + (
            "the client asks for ids and log-probs"
            if args.client_asks
            else "the proxy asks for ids and log-probs"
        )
    )
    print(
        "| mode | answer | streams | direct p50 / p99 ms, calls/s | bare forwarder: added p50 / p99 ms, "
        "CPU/call, calls/s | rlreplay proxy: added p50 / p99 ms, CPU/call (serving + reading), calls/s | "
        "proxy ÷ forwarder: CPU serving, CPU all, calls/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for streamed in (True, False):
        for answer in (int(a) for a in args.answers.split(",")):
            body = request_body(answer, streamed, args.client_asks)
            for streams in (int(s) for s in args.streams.split(",")):
                total = max(args.requests, streams)
                d = measure(f"{upstream}/v1/chat/completions", None, total, streams, body)
                f = measure(
                    f"http://127.0.0.1:{fwd_port}/v1/chat/completions", forwarder.pid, total, streams, body
                )
                p = measure(
                    f"http://127.0.0.1:{proxy_port}/v1/chat/completions", proxy.pid, total, streams, body
                )
                print(
                    f"| {'stream' if streamed else 'json'} | {answer} | {streams} "
                    f"| {d['p50']:.1f} / {d['p99']:.1f}, {d['rate']:,.0f} | {added(f, d)} | {added(p, d)} "
                    f"| {p['own'] / f['cpu']:.1f}×, {p['cpu'] / f['cpu']:.1f}×, "
                    f"{p['rate'] / f['rate']:.2f}× |",
                    flush=True,
                )
    proxy.send_signal(signal.SIGTERM)
    proxy.wait(600)
    print(f"load average {os.getloadavg()[0]:.1f} at the end; {check_recorded(tmp / 'run')}")


def added(party: dict[str, float], direct: dict[str, float]) -> str:
    reading = party["cpu"] - party["own"]
    cpu = f"{party['own']:.2f} + {reading:.2f}" if reading > 0.005 else f"{party['cpu']:.2f}"
    return (
        f"{party['p50'] - direct['p50']:+,.1f} / {party['p99'] - direct['p99']:+,.1f}, "
        f"{cpu}, {party['rate']:,.0f}"
    )


def check_recorded(run: Path) -> str:
    """Every recorded call's response ids and log-probs against the stand-in's."""
    from rlreplay.read.open import open_run

    ids, lps = upstream_tokens()
    opened = open_run(run)
    calls = wrong = 0
    for traj in opened.load(opened.trajectories()["id"].to_pylist()):
        for span in traj.spans:
            if span.kind != "llm":
                continue
            calls += 1
            got_ids, got_lps = (
                list(span.output.get("token_ids") or []),
                list(span.output.get("log_probs") or []),
            )
            n = len(got_ids)
            if not n or got_ids != ids[:n] or got_lps != lps[:n]:
                wrong += 1
    return f"recorded calls: {calls}, with ids and log-probs other than the server's: {wrong}"


def counted(
    argv: list[str], calls: int, tmp: Path, name: str, procs: list[subprocess.Popen], body: bytes
) -> dict[int, float]:
    """Instructions per call of one process under callgrind, by thread (1: the main thread):
    ``calls`` calls at one stream, counted after a warm-up, and the writer's tail after them."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    out = tmp / f"cg-{name}"
    out.mkdir()
    cg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
    proc = start([*cg, f"--callgrind-out-file={out}/cg", *argv], procs)
    asyncio.run(wait_up(f"http://127.0.0.1:{port}/health", tries=3000))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    asyncio.run(load(url, 30, 1, body))
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
    asyncio.run(load(url, calls, 1, body))
    time.sleep(15)  # the recorder writes (and seals) what the calls queued
    subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(600)
    per_thread = {}
    for path in out.glob("cg-*"):
        totals = [
            line for line in path.read_text(errors="replace").splitlines() if line.startswith("totals:")
        ]
        per_thread[int(path.name.rsplit("-", 1)[1])] = int(totals[-1].split()[1]) / calls if totals else 0.0
    return per_thread


def instructions(args: argparse.Namespace, procs: list[subprocess.Popen], tmp: Path, upstream: str) -> None:
    """Instructions per call under callgrind (independent of the machine's load)."""
    calls = args.requests
    streamed = not args.json
    body = request_body(ANSWER_IDS[0], streamed, args.client_asks)
    fwd_argv = [sys.executable, "-c", FORWARDER, "{port}", upstream]
    forwarder = counted(fwd_argv, calls, tmp, "fwd", procs, body)
    argv = proxy_argv("{port}", upstream, tmp / "run", args.readers or 0)
    proxy = counted(argv, calls, tmp, "proxy", procs, body)
    fwd = sum(forwarder.values())
    loop = proxy.get(1, 0.0)
    recorder = sum(v for k, v in proxy.items() if k != 1)
    print(f"instructions per call under callgrind, {calls} calls at 1 stream; ", end="")
    print(
        f"prompt {PROMPT_IDS} ids, {'streamed' if streamed else 'whole (JSON)'} answer {ANSWER_IDS[0]} ids, "
        + (
            "the client asks for ids and log-probs"
            if args.client_asks
            else "the proxy asks for ids and log-probs"
        )
    )
    print("| process, thread | instructions per call | ÷ bare forwarder |")
    print("|---|---:|---:|")
    rows = [
        ("bare forwarder", fwd),
        ("rlreplay proxy, event loop (HTTP, JSON, handing spans over)", loop),
        ("rlreplay proxy, recorder threads (encode, write, seal)", recorder),
        ("rlreplay proxy, whole process", loop + recorder),
    ]
    for name, value in rows:
        print(f"| {name} | {value / 1e6:.2f} M | {value / fwd:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--requests", type=int, default=None, help="calls per row (2,000; 300 with --callgrind)"
    )
    parser.add_argument("--streams", default="1,32,256")
    parser.add_argument("--answers", default="200,2000", help="answer lengths in tokens")
    parser.add_argument(
        "--client-asks", action="store_true", help="the client asks for token ids and log-probs itself"
    )
    parser.add_argument(
        "--callgrind", action="store_true", help="instructions per call under callgrind (needs valgrind)"
    )
    parser.add_argument("--json", action="store_true", help="with --callgrind: whole answers, not streamed")
    parser.add_argument(
        "--readers",
        type=int,
        default=None,
        help="the proxy's reading processes (default: the proxy's own choice; 0 with --callgrind, "
        "which counts one process)",
    )
    args = parser.parse_args()
    args.requests = args.requests or (300 if args.callgrind else 2000)
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    try:
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        start([sys.executable, "-c", UPSTREAM, str(up_port), str(PROMPT_IDS), str(max(ANSWER_IDS))], procs)
        asyncio.run(wait_up(f"{upstream}/health"))
        (instructions if args.callgrind else timed)(args, procs, tmp, upstream)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(600)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
