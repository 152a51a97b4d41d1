"""Recorder benchmark: rlreplay against the cheapest lossless writer of the same numbers (issue 40).

The workload is a model call that takes 1,000 prompt ids and returns 2,000 ids and 2,000 float
log-probs as Python lists: ids of real text (the Python standard library's source through the
Qwen3 tokenizer, each call its own stretch), log-probs float32 values as Python floats, fresh
for each call; 8 calls per trajectory. The growing-prefix workload is verl's agent loop: a
1,000-id prompt, 4 turns of 500 response ids and log-probs, each turn's prompt the previous
prompt + response + 40 tool ids, and the agent span (prompt, all response ids, their mask and
log-probs) at the end of each trajectory.

The limit (written here, run in the same sitting): the caller copies the three lists onto a
``queue.SimpleQueue``; a thread converts them to numpy int32/float32, builds a pyarrow
``RecordBatch`` every 256 rows and writes zstd-3 Parquet (``use_dictionary=False``, log-probs
byte-stream-split).

Each figure comes from a fresh process per run (rounds interleave the arms, so that the load of
the machine falls on all alike), as the median of the rounds:

- total CPU per call: the process's CPU from the first call to the last file closed (rlreplay's
  writer, sealer and lease threads included), less a bare run of the same loop (making the
  workload's lists), per model call; back to back and paced 1 ms apart;
- the calling thread's CPU per call over the bare call, back to back and paced (median, mean:
  the mean holds the spans a full queue made the calling thread encode itself);
- spans spilled (encoded on the calling thread) with 1 and 4 recording processes at once;
- bytes on disk per token id given (prompt + response ids of the model calls): rlreplay's
  sealed shards and their indexes, the limit's one Parquet file.

    python benchmarks/bench_recorder.py [--calls 2000] [--rounds 3] [--tree main=/path/to/tree]
    python benchmarks/bench_recorder.py --peers [--calls 3000] ...   # against weave and MLflow

``--tree LABEL=PATH`` adds an arm running another source tree's rlreplay (``PYTHONPATH=PATH``),
interleaved with this one's in each round.

``--peers``: what one span costs the calling thread, side by side in one process, against weave's
client and MLflow's span API as verl's backends call them. Same workload for every tracer, each
op call inside an open trajectory (root span/call/trace):
- token spans: ``generate(request_id, *, prompt_ids=<1,000 ids>, sampling_params)`` returning
  ``{"token_ids": <2,000 ids>}`` (the shape of verl's ``LLMServerClient.generate``);
- tiny spans: ``op(x)`` returning ``x + 1``.

Tracers: none (the bare call), rlreplay (``@rlreplay.trace_op`` + ``rlreplay.trajectory``), weave's
client (``WeaveClient.create_call``/``finish_call``, as verl's weave backend calls them, inputs
given ready-bound; the client talks to a validating loopback Weave server on 127.0.0.1,
tests/weave_loopback.py, with op publishing answered locally), and MLflow's span API
(``mlflow.start_span`` + ``set_inputs``/``set_outputs``, as verl's mlflow backend; sqlite tracking
store in a temp dir). Per-call times are taken with perf_counter_ns around each op call; the
trajectory's own open/close is timed separately. Background work is flushed between tracers.
Also: event-loop lag (p50/p99 of a 1 ms ticker's lateness) with 64 asyncio tasks making
~1,000 token spans/s, without and with the recorder (``--lag-seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import mmap
import os
import shutil
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


def peers_main(argv: list[str]) -> None:
    """The calling thread per span against weave's client and MLflow's span API (``--peers``)."""
    parser = argparse.ArgumentParser(description="bench_recorder.py --peers")
    parser.add_argument("--calls", type=int, default=3000, help="op calls per tracer and workload")
    parser.add_argument("--weave-token-calls", type=int, default=40, help="token calls for weave (slow)")
    parser.add_argument("--mlflow-calls", type=int, default=400, help="calls for MLflow (slow)")
    parser.add_argument("--lag-seconds", type=float, default=5.0)
    parser.add_argument("--lag-only", action="store_true", help="only the event-loop lag part")
    args = parser.parse_args(argv)
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


# ---- rlreplay against the limit (issue 40) ---------------------------------------------------------

LIMIT_BATCH_ROWS = 256
TURNS, TURN_IDS, TOOL_IDS = 4, 500, 40  # the growing-prefix workload (and PROMPT_IDS)
POOL_IDS = 1_000_000  # real-text ids: each call takes its own stretch


def real_text_pool(path: Path) -> Path:
    """Ids of real text (the standard library's source through the Qwen3 tokenizer), saved once."""
    import numpy as np
    from support import qwen_tokenizer_dir
    from tokenizers import Tokenizer

    if path.exists():
        return path
    tokenizer = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    ids: list[int] = []
    for source in sorted(Path(os.__file__).parent.glob("*.py")):
        ids += tokenizer.encode(source.read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= POOL_IDS:
            break
    np.save(path, np.array(ids, dtype=np.int32))
    return path


class Workload:
    """Model calls' lists: each call its own stretch of the real-text pool and fresh log-probs."""

    def __init__(self, pool: list[int], seed: int) -> None:
        import numpy as np

        self.pool = pool
        self.at = (seed * len(pool)) // 5
        self.rng = np.random.default_rng(seed)
        self.ids_given = 0  # prompt + response ids of the model calls

    def ids(self, n: int) -> list[int]:
        if self.at + n > len(self.pool):
            self.at = 0
        self.at += n
        return self.pool[self.at - n : self.at]

    def logprobs(self, n: int) -> list[float]:
        import numpy as np

        return (-np.abs(self.rng.standard_normal(n) * 1.2)).astype(np.float32).tolist()


class Arm:
    """How one arm records: ``op`` wraps a model call, ``agent`` the agent loop, ``trajectory`` opens one."""

    def op(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def agent(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def trajectory(self, i: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def close(self) -> dict[str, Any]:
        return {}


class LimitArm(Arm):
    """The limit: the caller copies the lists onto a SimpleQueue; a thread converts and writes Parquet."""

    def __init__(self, path: Path) -> None:
        import queue
        import threading

        import pyarrow.parquet  # noqa: F401  imported before the clock starts, as rlreplay.init imports it

        self.queue: Any = queue.SimpleQueue()
        self.backlog = 0  # the most calls waiting in the queue
        self.thread = threading.Thread(target=limit_writer, args=(self.queue, path), name="limit-writer")
        self.path = path
        self.thread.start()

    def op(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        put = self.queue.put

        def traced(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            result = fn(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            put((prompt_ids.copy(), result["token_ids"].copy(), result["log_probs"].copy(), None))
            return result

        return traced

    def agent(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any) -> dict:
            out = fn(*args)
            self.queue.put(
                (
                    out["prompt_ids"].copy(),
                    out["response_ids"].copy(),
                    out["response_logprobs"].copy(),
                    out["response_mask"].copy(),
                )
            )
            self.backlog = max(self.backlog, self.queue.qsize())
            return out

        return traced

    def trajectory(self, i: int) -> contextlib.AbstractContextManager:
        self.backlog = max(self.backlog, self.queue.qsize())
        return contextlib.nullcontext()

    def close(self) -> dict[str, Any]:
        self.queue.put(None)
        self.thread.join()
        return {"bytes": self.path.stat().st_size, "backlog": self.backlog}


def limit_writer(queue: Any, path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = [(np.int32, pa.int32()), (np.int32, pa.int32()), (np.float32, pa.float32()), (np.int8, pa.int8())]
    names = ["prompt_ids", "response_ids", "logprobs", "mask"]
    schema = pa.schema([(n, pa.large_list(t)) for n, (_, t) in zip(names, types)])
    writer = pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=3,
        use_dictionary=False,
        use_byte_stream_split=["logprobs.list.element"],
    )

    def write(rows: list[tuple]) -> None:
        columns = []
        for k, (dtype, typ) in enumerate(types):
            parts = [row[k] for row in rows]
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([len(p) for p in parts], out=offsets[1:])
            values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
            columns.append(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ)))
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))

    rows: list[tuple] = []
    empty = np.zeros(0, dtype=np.int8)
    while (item := queue.get()) is not None:
        prompt, response, logprobs, mask = item
        rows.append(
            (
                np.array(prompt, dtype=np.int32),
                np.array(response, dtype=np.int32),
                np.array(logprobs, dtype=np.float32),
                empty if mask is None else np.array(mask, dtype=np.int8),
            )
        )
        if len(rows) == LIMIT_BATCH_ROWS:
            write(rows)
            rows = []
    if rows:
        write(rows)
    writer.close()


class RlreplayArm(Arm):
    def __init__(self, run_dir: Path, worker: str) -> None:
        import rlreplay

        self.rlreplay = rlreplay
        self.run_dir = run_dir
        self.recorder = rlreplay.init(run_dir, experiment="bench", worker=worker)
        rlreplay.flush()  # the writer has started

    def op(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.rlreplay.trace_op(kind="llm", name="generate")(fn)

    def agent(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.rlreplay.trace_op(kind="agent", name="agent_loop")(fn)

    def trajectory(self, i: int) -> contextlib.AbstractContextManager:
        return self.rlreplay.trajectory(step=0, sample_index=i, rollout_n=0, name="agent_loop")

    def close(self) -> dict[str, Any]:
        self.rlreplay.close()
        counters = self.recorder.counters
        files = [p for p in (self.run_dir / "spans").rglob("*") if p.is_file()]
        return {
            "bytes": sum(p.stat().st_size for p in files),
            "shard_bytes": sum(p.stat().st_size for p in files if p.suffix == ".parquet"),
            "spans": counters["spans"] + counters["spilled"],
            "spilled": counters["spilled"],
            "losses": {k: v for k, v in counters.items() if k not in ("spans", "spilled") and v},
        }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One arm's run in this process: its CPU, its calling thread's per-call CPU, what it wrote."""
    import gc

    import numpy as np

    pool = np.load(spec["pool"]).tolist()
    work = Workload(pool, spec["seed"])
    out_dir = Path(spec["out"])
    arm: Arm
    if spec["arm"] == "bare":
        arm = Arm()
    elif spec["arm"] == "limit":
        arm = LimitArm(out_dir / "limit.parquet")
    else:
        arm = RlreplayArm(out_dir / "run", f"bench{spec['seed']}")
    pending: dict[str, Any] = {}

    def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        return pending["out"]

    op = arm.op(generate)
    pause = 0.001 if spec["paced"] else 0.0
    params = {"temperature": 1.0, "top_p": 1.0, "logprobs": 1}
    thread_ns: list[int] = []
    clock = time.thread_time_ns

    def call(prompt: list[int], response: list[int], logprobs: list[float]) -> None:
        pending["out"] = {"token_ids": response, "log_probs": logprobs}
        work.ids_given += len(prompt) + len(response)
        t0 = clock()
        op("req", prompt_ids=prompt, sampling_params=params)
        thread_ns.append(clock() - t0)
        if pause:
            time.sleep(pause)

    def agent_loop(request_id: str, turns: int) -> dict:
        prompt = work.ids(PROMPT_IDS)
        context, mask, logprobs = prompt, [], []
        for turn in range(turns):
            response, lps = work.ids(TURN_IDS), work.logprobs(TURN_IDS)
            call(context, response, lps)
            context = context + response
            mask += [1] * TURN_IDS
            logprobs += lps
            if turn < turns - 1:
                context = context + work.ids(TOOL_IDS)
                mask += [0] * TOOL_IDS
                logprobs += [0.0] * TOOL_IDS
        return {
            "prompt_ids": prompt,
            "response_ids": context[len(prompt) :],
            "response_mask": mask,
            "response_logprobs": logprobs,
        }

    agent = arm.agent(agent_loop)
    gc.collect()
    started = time.process_time_ns()
    calls, i = 0, 0
    while calls < spec["calls"]:
        with arm.trajectory(i):
            if spec["workload"] == "growing":
                agent("req", TURNS)
                calls += TURNS
            else:
                for _ in range(SPANS_PER_TRAJECTORY):
                    call(work.ids(PROMPT_IDS), work.ids(OUTPUT_IDS), work.logprobs(OUTPUT_IDS))
                calls += SPANS_PER_TRAJECTORY
        i += 1
    result = arm.close()
    cpu = time.process_time_ns() - started
    thread_ns.sort()
    return {
        **result,
        "calls": calls,
        "cpu_ns": cpu,
        "thread_median_ns": thread_ns[len(thread_ns) // 2],
        "thread_mean_ns": statistics.fmean(thread_ns),
        "ids": work.ids_given,
    }


def spawn(spec: dict[str, Any], tree: Path | None) -> Any:
    import json
    import subprocess

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, __file__, "--child", json.dumps(spec)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: list[Any]) -> list[dict[str, Any]]:
    import json

    out = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a benchmark child failed (exit {proc.returncode}):\n{stderr}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def limit_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, help="model calls per run (default 2,000; --quick 400)")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved runs (default 3; --quick 1)")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=PATH", help="another tree's rlreplay too"
    )
    parser.add_argument("--quick", action="store_true", help="every figure, from fewer calls and one round")
    args = parser.parse_args(argv)
    calls = args.calls or (400 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="rlreplay-bench-"))
    pool = real_text_pool(Path(tempfile.gettempdir()) / "rlreplay-bench-real-text-ids.npy")
    trees: dict[str, Path] = {"rlreplay": ROOT}
    for item in args.tree:
        label, _, path = item.partition("=")
        trees[label] = Path(path).resolve()
    arms = ["limit", *trees]
    calls = max(calls - calls % (SPANS_PER_TRAJECTORY * TURNS), SPANS_PER_TRAJECTORY * TURNS)
    # (workload, paced, processes): what each figure needs
    setups = [("unshared", False, 1), ("unshared", True, 1), ("growing", False, 1)]
    setups += [("unshared", False, 4), ("unshared", True, 4)]
    results: dict[tuple, list[dict[str, Any]]] = {}
    n = 0
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; {calls:,} model calls per run, "
        f"{rounds} rounds; trees: " + ", ".join(f"{k}={v}" for k, v in trees.items()),
        flush=True,
    )
    for r in range(rounds):
        for workload, paced, procs in setups:
            for arm in (["bare"] if procs == 1 else []) + arms:
                load = os.getloadavg()[0]
                specs = []
                for k in range(procs):
                    n += 1
                    out = tmp / f"{n}"
                    out.mkdir()
                    spec = {"arm": "limit" if arm == "limit" else "bare" if arm == "bare" else "rlreplay"}
                    spec.update(workload=workload, paced=paced, calls=calls, pool=str(pool), out=str(out))
                    specs.append((dict(spec, seed=k), trees.get(arm)))
                runs = collect([spawn(spec, tree) for spec, tree in specs])
                results.setdefault((workload, paced, procs, arm), []).append(
                    {
                        "load": load,
                        "cpu_ns": sum(x["cpu_ns"] for x in runs),
                        "calls": sum(x["calls"] for x in runs),
                        "spans": sum(x.get("spans", 0) for x in runs),
                        "spilled": sum(x.get("spilled", 0) for x in runs),
                        "backlog": max(x.get("backlog", 0) for x in runs),
                        "losses": [x.get("losses") for x in runs if x.get("losses")],
                        **{
                            k: runs[0].get(k, 0)
                            for k in ("thread_median_ns", "thread_mean_ns", "bytes", "ids")
                        },
                    }
                )
        print(f"  round {r + 1} of {rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    report(results, arms, calls)


class Figures:
    """The figures of one run of ``limit_main``: medians over the rounds, per arm."""

    def __init__(self, results: dict[tuple, list[dict[str, Any]]], calls: int) -> None:
        self.results = results
        self.calls = calls

    def med(self, key: tuple, field: str) -> float:
        return statistics.median(run[field] for run in self.results[key])

    def load(self, *setups: tuple) -> str:
        """The load average at the starts of the runs behind a figure (every arm's, bare's)."""
        loads = [run["load"] for key, runs in self.results.items() if key[:3] in setups for run in runs]
        return f"{min(loads):.1f}–{max(loads):.1f}"

    def total(self, workload: str, paced: bool, arm: str) -> float:
        """Process CPU per model call over the bare loop's (µs)."""
        bare = self.med((workload, paced, 1, "bare"), "cpu_ns")
        return (self.med((workload, paced, 1, arm), "cpu_ns") - bare) / self.calls / 1e3

    def thread(self, paced: bool, arm: str, field: str) -> float:
        """The calling thread's CPU per call over the bare call's (µs)."""
        bare = self.med(("unshared", paced, 1, "bare"), field)
        return (self.med(("unshared", paced, 1, arm), field) - bare) / 1e3

    def spilled(self, paced: bool, procs: int, arm: str) -> float:
        """The share of spans encoded on the calling thread (the limit never spills: None)."""
        runs = self.results[("unshared", paced, procs, arm)]
        return statistics.median(r["spilled"] / max(r["spans"], 1) for r in runs)

    def backlog(self, paced: bool, procs: int) -> int:
        return max(r["backlog"] for r in self.results[("unshared", paced, procs, "limit")])

    def per_token(self, workload: str, arm: str) -> float:
        """Bytes on disk per token id given to the model calls (prompt + response ids)."""
        return self.med((workload, False, 1, arm), "bytes") / self.med((workload, False, 1, arm), "ids")


def report(results: dict[tuple, list[dict[str, Any]]], arms: list[str], calls: int) -> None:
    fig = Figures(results, calls)
    ub, up, gb = ("unshared", False, 1), ("unshared", True, 1), ("growing", False, 1)
    ub4, up4 = ("unshared", False, 4), ("unshared", True, 4)
    # label, the arm's figure, how it compares with the limit's ("×": ratio, "+": difference), setups
    rows: list[tuple[str, Callable[[str], float], str, tuple]] = [
        ("total CPU per call, back to back (µs)", lambda a: fig.total(*ub[:2], a), "×", (ub,)),
        ("total CPU per call, paced 1 ms (µs)", lambda a: fig.total(*up[:2], a), "×", (up,)),
        ("total CPU per call, growing prefix (µs)", lambda a: fig.total(*gb[:2], a), "×", (gb,)),
        (
            "calling thread, back to back, median (µs)",
            lambda a: fig.thread(False, a, "thread_median_ns"),
            "+",
            (ub,),
        ),
        (
            "calling thread, back to back, mean (µs)",
            lambda a: fig.thread(False, a, "thread_mean_ns"),
            "+",
            (ub,),
        ),
        (
            "calling thread, paced 1 ms, median (µs)",
            lambda a: fig.thread(True, a, "thread_median_ns"),
            "+",
            (up,),
        ),
        (
            "calling thread, paced 1 ms, mean (µs)",
            lambda a: fig.thread(True, a, "thread_mean_ns"),
            "+",
            (up,),
        ),
        ("spilled, 1 process, back to back (%)", lambda a: 100 * fig.spilled(False, 1, a), "", (ub,)),
        ("spilled, 1 process, paced 1 ms (%)", lambda a: 100 * fig.spilled(True, 1, a), "", (up,)),
        ("spilled, 4 processes, back to back (%)", lambda a: 100 * fig.spilled(False, 4, a), "", (ub4,)),
        ("spilled, 4 processes, paced 1 ms (%)", lambda a: 100 * fig.spilled(True, 4, a), "", (up4,)),
        ("bytes per token id, unshared", lambda a: fig.per_token("unshared", a), "×", (ub,)),
        ("bytes per token id, growing prefix", lambda a: fig.per_token("growing", a), "×", (gb,)),
    ]
    ours = arms[1:]
    print(
        f"\nper model call of {PROMPT_IDS:,} prompt ids, {OUTPUT_IDS:,} response ids and {OUTPUT_IDS:,} "
        f"log-probs (growing prefix: {TURNS} turns of {TURN_IDS} ids), median of the rounds; CPU and "
        "calling thread over the bare loop's; load: the load average at the runs' starts"
    )
    width = 43
    header = f"{'':{width}s}" + "".join(f"{a:>10s}" for a in arms)
    header += "".join(f"{a[:8] + ' vs limit':>18s}" for a in ours) + f"{'load':>10s}"
    print(header)
    for label, value, compare, setups in rows:
        cells, versus = [], []
        for a in arms:
            if a == "limit" and label.startswith("spilled"):
                paced, procs = "paced" in label, 4 if "4 processes" in label else 1
                cells.append(f"(≤{fig.backlog(paced, procs)} q)")
                continue
            v = value(a)
            cells.append(f"{v:.3f}" if label.startswith("bytes") else f"{v:.1f}")
            if a != "limit" and compare:
                lim = value("limit")
                versus.append(f"{v / lim:.2f}×" if compare == "×" else f"{v - lim:+.1f} µs")
            elif a != "limit":
                versus.append("")
        line = f"{label:{width}s}" + "".join(f"{c:>10s}" for c in cells)
        print(line + "".join(f"{c:>18s}" for c in versus) + f"{fig.load(*setups):>10s}")
    print("(the limit's spill rows: the most calls its queue held, it never spills)")
    for arm in ours:
        checks = []
        for mode, (w, paced) in (("back to back", ub[:2]), ("paced", up[:2])):
            ratio = fig.total(w, paced, arm) / fig.total(w, paced, "limit")
            checks.append((f"total CPU {mode} {ratio:.2f}× the limit (≤ 1.25×)", ratio <= 1.25))
        over = fig.thread(True, arm, "thread_mean_ns") - fig.thread(True, "limit", "thread_mean_ns")
        checks.append((f"calling thread paced {over:+.1f} µs over the limit's copy (≤ 15)", over <= 15))
        spill = fig.spilled(True, 4, arm)
        checks.append((f"spilled with 4 processes paced {spill:.1%} (none)", spill == 0))
        unshared = fig.per_token("unshared", arm) / fig.per_token("unshared", "limit")
        checks.append((f"bytes unshared {unshared:.3f}× the limit's (≤ 1)", unshared <= 1))
        for other in ours:
            if other != arm:
                growing = fig.per_token("growing", arm) / fig.per_token("growing", other)
                checks.append(
                    (
                        f"bytes growing prefix {growing:.4f}× {other}'s (≤ 1, ± 0.1%: where files are"
                        " cut follows the timing)",
                        growing <= 1.001 if other == "main" else None,
                    )
                )
        losses = [x for key, runs in results.items() if key[3] == arm for r in runs for x in r["losses"]]
        if losses:
            checks.append((f"spans lost {losses}", False))
        verdicts = {True: "met", False: "MISSED", None: "-"}
        print(f"{arm}: " + "; ".join(f"{text} {verdicts[ok]}" for text, ok in checks))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        import json

        print(json.dumps(run_child(json.loads(sys.argv[2]))))
        return
    if "--peers" in sys.argv:
        return peers_main([a for a in sys.argv[1:] if a != "--peers"])
    limit_main(sys.argv[1:])


if __name__ == "__main__":
    main()
