"""Recorder benchmark: what recording one span costs the calling thread, side by side in one process.

Same workload for every tracer, each op call inside an open trajectory (root span/call/trace):
- token spans: ``generate(request_id, *, prompt_ids=<1,000 ids>, sampling_params)`` returning
  ``{"token_ids": <2,000 ids>}`` (the shape of verl's ``LLMServerClient.generate``);
- tiny spans: ``op(x)`` returning ``x + 1``.

Tracers: none (the bare call), rlreplay (``@rlreplay.trace_op`` + ``rlreplay.trajectory``), weave's
client (``WeaveClient.create_call``/``finish_call``, as verl's weave backend calls them, inputs
given ready-bound; the client talks to a validating loopback Weave server on 127.0.0.1,
tests/weave_loopback.py, with op publishing answered locally), and MLflow's span API
(``mlflow.start_span`` + ``set_inputs``/``set_outputs``, as verl's mlflow backend; sqlite tracking
store in a temp dir). Per-call times are taken with perf_counter_ns around each op call; the
trajectory's own open/close is timed separately. Background work (rlreplay's writer, weave's
batch sender, MLflow's async exporter) is flushed between tracers and not counted per span.

Total per span: the calling thread's mean (it includes the spans a full queue made the calling
thread encode itself) plus the CPU time rlreplay's own threads (writer and sealer, read from each
thread's CPU clock) spent per op call over the same calls: everything recording a span costs.

Also: event-loop lag (p50/p99 of a 1 ms ticker's lateness) with 64 asyncio tasks making
~1,000 token spans/s, without and with the recorder.

    python benchmarks/bench_recorder.py [--calls 3000] [--weave-token-calls 30] [--lag-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ["WANDB_ERROR_REPORTING"] = "false"  # weave reports its errors to Sentry otherwise
os.environ.setdefault("WEAVE_PRINT_CALL_LINK", "false")

PROMPT_IDS = 1000
OUTPUT_IDS = 2000
SPANS_PER_TRAJECTORY = 8
ATTRS = {"step": 3, "sample_index": 5, "rollout_n": 1, "validate": False, "experiment_name": "bench"}


def token_args(i: int) -> tuple[tuple, dict]:
    prompt = list(range(150_000 - PROMPT_IDS - i, 150_000 - i))
    return (f"req-{i}",), {"prompt_ids": prompt, "sampling_params": {"temperature": 1.0, "top_p": 1.0}}


OUTPUT = {"token_ids": list(range(10_000, 10_000 + OUTPUT_IDS))}


def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
    return {"token_ids": OUTPUT["token_ids"].copy()}


def tiny(x: int) -> int:
    return x + 1


def tiny_args(i: int) -> tuple[tuple, dict]:
    return (i,), {}


# ---- one tracer at a time: (open trajectory, close trajectory, wrap op) ------------------------------


class Tracer:
    name = "none"

    def trajectory(self, i: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def flush(self) -> None:
        pass

    def background_ns(self) -> int:
        """CPU time (ns) this tracer's own threads have used so far (0: not measured)."""
        return 0


def thread_cpu_ns(prefix: str) -> int:
    """CPU time (ns) used so far by the live threads whose names start with ``prefix``."""
    import threading

    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.ident is not None:
            with contextlib.suppress(OSError):
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    return total


class RlreplayTracer(Tracer):
    name = "rlreplay"

    def __init__(self, run_dir: Path) -> None:
        import rlreplay

        self.rlreplay = rlreplay
        rlreplay.init(run_dir, experiment="bench", worker="bench")
        rlreplay.flush()

    def trajectory(self, i: int) -> contextlib.AbstractContextManager:
        return self.rlreplay.trajectory(step=3, sample_index=i, rollout_n=1, name="agent_loop")

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.rlreplay.trace_op(kind="llm")(fn)

    def flush(self) -> None:
        self.rlreplay.flush()

    def background_ns(self) -> int:
        return thread_cpu_ns("rlreplay-")


class WeaveTracer(Tracer):
    name = "weave"

    def __init__(self, url: str, key: str) -> None:
        from pydantic_core import to_json
        from weave.trace.context import weave_client_context
        from weave.trace.weave_client import WeaveClient
        from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer
        from weave.vendor.weave_server_sdk.types import FileCreateResponse, ObjectCreateResponse

        class LocalOps(RemoteHTTPTraceServer):
            """The loopback has no object store: op publishing is answered here."""

            def obj_create(self, req: Any) -> Any:
                body = to_json(dict(req), fallback=str)
                return ObjectCreateResponse(digest=hashlib.sha256(body).hexdigest()[:43])

            def file_create(self, req: Any) -> Any:
                return FileCreateResponse(digest=hashlib.sha256(repr(req).encode()).hexdigest()[:43])

        self.server = LocalOps(url, should_batch=True, password=key)
        self.client = WeaveClient("bench", "recorder", self.server, ensure_project_exists=False)
        weave_client_context.set_weave_client_global(self.client)

    @contextlib.contextmanager
    def trajectory(self, i: int) -> Any:
        root = self.client.create_call("agent_loop", inputs={}, attributes={**ATTRS, "sample_index": i})
        try:
            yield
        finally:
            self.client.finish_call(root)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        client, op_name, signature = self.client, fn.__qualname__, inspect.signature(fn)

        def traced(*args: Any, **kwargs: Any) -> Any:
            inputs = signature.bind(*args, **kwargs).arguments  # verl binds too (~21 µs more there)
            call = client.create_call(op=op_name, inputs=dict(inputs), attributes=ATTRS)
            result = fn(*args, **kwargs)
            client.finish_call(call, output=result)
            return result

        return traced

    def flush(self) -> None:
        self.client.flush()


class MlflowTracer(Tracer):
    name = "mlflow"

    def __init__(self, tmp: Path) -> None:
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.ERROR)
        mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
        # artifacts (trace data) in the temp dir too, not in ./mlruns
        experiment = mlflow.create_experiment(
            "bench-recorder", artifact_location=(tmp / "artifacts").as_uri()
        )
        mlflow.set_experiment(experiment_id=experiment)
        self.mlflow = mlflow

    @contextlib.contextmanager
    def trajectory(self, i: int) -> Any:
        with self.mlflow.start_span(name="agent_loop", attributes={**ATTRS, "sample_index": i}):
            yield

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        mlflow, name, signature = self.mlflow, fn.__qualname__, inspect.signature(fn)

        def traced(*args: Any, **kwargs: Any) -> Any:
            inputs = signature.bind(*args, **kwargs).arguments
            with mlflow.start_span(name=name) as span:
                span.set_inputs(dict(inputs))
                result = fn(*args, **kwargs)
                span.set_outputs(result)
            return result

        return traced

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.mlflow.flush_trace_async_logging()


# ---- measurement ---------------------------------------------------------------------------------


def measure(
    tracer: Tracer, fn: Callable[..., Any], make_args: Callable[[int], tuple[tuple, dict]], calls: int
) -> dict[str, float]:
    """Per-call ns on the calling thread (median, p99), and per-trajectory open+close ns (median)."""
    op = tracer.wrap(fn)
    prepared = [make_args(i) for i in range(min(calls, 64))]
    per_call: list[int] = []
    per_root: list[int] = []
    clock = time.perf_counter_ns
    warmup = max(2, calls // 10)
    i = 0
    tracer.flush()
    background = tracer.background_ns()
    while i < calls + warmup:
        t0 = clock()
        ctx = tracer.trajectory(i)
        ctx.__enter__()
        root_ns = clock() - t0
        for _ in range(SPANS_PER_TRAJECTORY):
            args, kwargs = prepared[i % len(prepared)]
            t = clock()
            op(*args, **kwargs)
            elapsed = clock() - t
            if i >= warmup:
                per_call.append(elapsed)
            i += 1
        t0 = clock()
        ctx.__exit__(None, None, None)
        if i > warmup:
            per_root.append(root_ns + clock() - t0)
        if i % 512 < SPANS_PER_TRAJECTORY:
            tracer.flush()  # keep background queues short; not counted per call
    tracer.flush()
    background = tracer.background_ns() - background
    per_call.sort()
    return {
        "median": statistics.median(per_call),
        "mean": statistics.fmean(per_call),  # spans a full queue made the calling thread encode count here
        "background": background / i,  # per op call, all calls (warm-up too) and their trajectories
        "p99": per_call[min(len(per_call) - 1, int(len(per_call) * 0.99))],
        "root": statistics.median(per_root),
        "n": len(per_call),
    }


def page_fault_us() -> float:
    """What a first touch of a fresh 4 KiB page costs on this machine (µs)."""
    size = 64 << 20
    with mmap.mmap(-1, size) as m:
        started = time.perf_counter()
        for offset in range(0, size, 4096):
            m[offset] = 1
        first = time.perf_counter() - started
        started = time.perf_counter()
        for offset in range(0, size, 4096):
            m[offset] = 2
        again = time.perf_counter() - started
    return (first - again) / (size // 4096) * 1e6


def lag(with_recorder: bool, seconds: float, run_dir: Path) -> tuple[float, float, int]:
    """p50/p99 lateness (ms) of a 1 ms ticker while 64 tasks make ~1,000 token spans/s."""
    import rlreplay

    if with_recorder:
        rlreplay.init(run_dir, experiment="bench-lag", worker="lag")
        rlreplay.flush()  # setup done: the writer has started

    @rlreplay.trace_op(kind="llm")
    async def agenerate(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        return {"token_ids": OUTPUT["token_ids"].copy()}

    made = 0

    async def task(k: int, stop: float) -> None:
        nonlocal made
        n = 0
        while time.monotonic() < stop:
            async with rlreplay.trajectory(step=0, sample_index=k, rollout_n=n):
                for _ in range(4):
                    args, kwargs = token_args(n)
                    await agenerate(*args, **kwargs)
                    made += 1
                    await asyncio.sleep(0.064)  # 64 tasks x 1 span / 64 ms = ~1,000 spans/s
            n += 1

    async def ticker(stop: float, late: list[float]) -> None:
        while time.monotonic() < stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append((time.perf_counter() - t - 0.001) * 1e3)

    async def main() -> list[float]:
        late: list[float] = []
        stop = time.monotonic() + seconds
        await asyncio.gather(ticker(stop, late), *(task(k, stop) for k in range(64)))
        return late

    if not with_recorder:
        with rlreplay.disabled():
            late = asyncio.run(main())
    else:
        late = asyncio.run(main())
        rlreplay.close()
    late.sort()
    return late[len(late) // 2], late[int(len(late) * 0.99)], made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="op calls per tracer and workload")
    parser.add_argument("--weave-token-calls", type=int, default=40, help="token calls for weave (slow)")
    parser.add_argument("--mlflow-calls", type=int, default=400, help="calls for MLflow (slow)")
    parser.add_argument("--lag-seconds", type=float, default=5.0)
    parser.add_argument("--lag-only", action="store_true", help="only the event-loop lag part")
    args = parser.parse_args()
    if args.lag_only:
        return report_lag(args.lag_seconds, Path(tempfile.mkdtemp(prefix="rlreplay-bench-")))

    from weave_loopback import WeaveLoopback

    tmp = Path(tempfile.mkdtemp(prefix="rlreplay-bench-"))
    load = os.getloadavg()[0]
    version = sys.version.split()[0]
    print(
        f"python {version}, {os.cpu_count()} cpus, load {load:.1f}; {SPANS_PER_TRAJECTORY} calls/trajectory"
    )
    results: dict[tuple[str, str], dict[str, float]] = {}
    with WeaveLoopback(api_key="bench-key") as loopback:
        tracers: list[Tracer] = [
            Tracer(),
            RlreplayTracer(tmp / "run"),
            WeaveTracer(loopback.url, "bench-key"),
            MlflowTracer(tmp),
        ]
        for tracer in tracers:
            for workload, fn, make in (("token", generate, token_args), ("tiny", tiny, tiny_args)):
                calls = args.calls
                if tracer.name == "weave" and workload == "token":
                    calls = args.weave_token_calls
                elif tracer.name == "mlflow":
                    calls = args.mlflow_calls
                calls -= calls % SPANS_PER_TRAJECTORY
                started = time.perf_counter()
                results[tracer.name, workload] = measure(tracer, fn, make, calls)
                r = results[tracer.name, workload]
                took = time.perf_counter() - started
                print(f"  measured {tracer.name:8s} {workload:5s} n={r['n']:5d} in {took:6.1f}s", flush=True)
        stored = len(loopback.calls)
    import rlreplay

    rlreplay.close()
    counters = rlreplay.open_run(tmp / "run").counters()

    ids = PROMPT_IDS + OUTPUT_IDS
    print(f"\nper op call on the calling thread (µs); token spans carry {PROMPT_IDS:,} + {OUTPUT_IDS:,} ids")
    print(
        f"{'tracer':10s} {'token med':>10s} {'token p99':>10s} {'tiny med':>9s} "
        f"{'tiny p99':>9s} {'root open+close':>16s} {'token ×rlreplay':>16s} {'tiny ×rlreplay':>15s}"
    )
    base_token = results["rlreplay", "token"]["median"]
    base_tiny = results["rlreplay", "tiny"]["median"]
    for name in ("none", "rlreplay", "weave", "mlflow"):
        t, s = results[name, "token"], results[name, "tiny"]
        print(
            f"{name:10s} {t['median'] / 1e3:10.1f} {t['p99'] / 1e3:10.1f} "
            f"{s['median'] / 1e3:9.2f} {s['p99'] / 1e3:9.2f} {t['root'] / 1e3:16.1f} "
            f"{t['median'] / base_token:16.1f} {s['median'] / base_tiny:15.1f}"
        )
    print(
        f"(a first touch of a fresh 4 KiB page costs {page_fault_us():.2f} µs on this machine; "
        "snapshot copies land on fresh pages whenever the allocator has given freed memory back)"
    )
    r, t = results["rlreplay", "token"], results["rlreplay", "tiny"]
    print(
        f"\nrlreplay total per token span: {(r['mean'] + r['background']) / 1e3:.1f} µs "
        f"(calling thread, mean {r['mean'] / 1e3:.1f} + writer and sealer CPU {r['background'] / 1e3:.1f}); "
        f"tiny span: {(t['mean'] + t['background']) / 1e3:.1f} µs"
    )
    shards = sorted((tmp / "run" / "spans").rglob("*.parquet"))
    print(f"shards: {len(shards)} files, {sum(p.stat().st_size for p in shards):,} bytes")
    overhead_token = (results["rlreplay", "token"]["median"] - results["none", "token"]["median"]) / 1e3
    overhead_tiny = (results["rlreplay", "tiny"]["median"] - results["none", "tiny"]["median"]) / 1e3
    budget = 5 + 0.005 * ids
    print(
        f"\nrlreplay overhead over the bare call: token {overhead_token:.1f} µs (target ≤ {budget:.0f} µs = "
        f"5 µs + 5 ns × {ids:,} ids), tiny {overhead_tiny:.2f} µs (target ≤ 5 µs)"
    )
    print(
        f"weave / rlreplay on token spans: {results['weave', 'token']['median'] / base_token:,.0f}× "
        f"(target ≥ 100×); mlflow / rlreplay: {results['mlflow', 'token']['median'] / base_token:,.0f}×"
    )
    losses = {k: v for k, v in counters.items() if k != "spans" and v} or "none"
    print(
        f"recorded: rlreplay {counters['spans']} spans, losses {losses}; weave loopback stored {stored} calls"
    )

    report_lag(args.lag_seconds, tmp)


def report_lag(seconds: float, tmp: Path, rounds: int = 3) -> None:
    """Rounds alternate without/with, so that load from elsewhere on the machine hits both alike."""
    print(
        f"\nevent-loop lag: 64 tasks making ~1,000 token spans/s; lateness of a 1 ms ticker, "
        f"{rounds} rounds of {seconds:g} s each (median of rounds)"
    )
    runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for i in range(rounds):
        for with_recorder in (False, True):
            runs[with_recorder].append(lag(with_recorder, seconds, tmp / f"lag{i}"))
    for with_recorder in (False, True):
        p50 = statistics.median(r[0] for r in runs[with_recorder])
        p99s = [r[1] for r in runs[with_recorder]]
        rate = statistics.median(r[2] for r in runs[with_recorder]) / seconds
        label = "with rlreplay   " if with_recorder else "without recorder"
        print(
            f"  {label}: p50 {p50:.2f} ms  p99 {statistics.median(p99s):.2f} ms "
            f"(rounds: {', '.join(f'{v:.1f}' for v in p99s)})  {rate:,.0f} spans/s"
        )


if __name__ == "__main__":
    main()
