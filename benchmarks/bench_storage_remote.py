"""Runs on an object store: calling-thread cost, shard upload throughput, `ls --step K` S3 vs disk.

A real S3 server (moto_server) is started on 127.0.0.1 for the run. Three measurements:

1. What one token span costs the calling thread when recording into a local directory and into
   ``s3://`` (local spool + publisher thread), same workload, each in a fresh process.
2. Shard upload throughput: a recorded run's sealed shards put in a spool and published to the
   loopback server by the publisher (files/s, MB/s), against copying them on local disk.
3. ``ls --step K`` (the library's ``Run.trajectories(step=K)``) on a STEPS-step run on local disk
   and in S3 (cold: empty cache, so it lists ``spans/step=K/`` and fetches its index files; warm:
   cached).
4. A whole-run ``ls`` (``Run.trajectories()``) and a cold ``show ID`` of a STEPS-step run with
   real-sized payloads (IDS random token ids in and out per trajectory, float32 log-probs):
   bytes fetched into the cache and time, the previous reader (mirror every object under
   ``spans/``, then list) against this one (index files only; a run index kept in the cache).

    python benchmarks/bench_storage_remote.py [--steps 200] [--samples 16] [--calls 3000] [--repeat 3]
        [--ids 2048] [--only-listing]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from rlreplay.shards.layout import SPANS_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port

BUCKET = "rlreplay-bench"

CALLER = textwrap.dedent(
    """
    import sys, time
    import rlreplay

    @rlreplay.trace_op(kind="llm", name="LLMServerClient.generate")
    def generate(request_id, *, prompt_ids, sampling_params):
        return {"token_ids": list(range(2000))}

    prompt = list(range(1000))
    calls, steps = int(sys.argv[1]), int(sys.argv[2])
    per_step = max(1, calls // steps)
    times = []
    for i in range(calls):
        with rlreplay.trajectory(step=i // per_step, sample_index=i % per_step, rollout_n=0):
            t0 = time.perf_counter_ns()
            generate("r", prompt_ids=prompt, sampling_params={"temperature": 1.0})
            times.append(time.perf_counter_ns() - t0)
    rlreplay.close()
    times.sort()
    print(times[len(times) // 2] / 1000, times[int(len(times) * 0.99)] / 1000)
    """
)

WRITER = textwrap.dedent(
    """
    import sys
    import rlreplay

    @rlreplay.trace_op(kind="llm", name="LLMServerClient.generate")
    def generate(prompt_ids):
        return {"token_ids": [t + 1 for t in prompt_ids]}

    steps, samples = int(sys.argv[1]), int(sys.argv[2])
    for step in range(steps):
        for sample in range(samples):
            with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=0):
                generate(list(range(sample, sample + 512)))
    """
)


PAYLOAD_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import rlreplay

    @rlreplay.trace_op(kind="llm", name="LLMServerClient.generate")
    def generate(prompt_ids, rng, n):
        return {
            "token_ids": rng.integers(0, 151_000, n).tolist(),
            "log_probs": (-rng.random(n, dtype=np.float32)).tolist(),
        }

    steps, samples, ids = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for step in range(steps):
        for sample in range(samples):
            rng = np.random.default_rng(step * 100_003 + sample)
            with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=0):
                generate(rng.integers(0, 151_000, ids).tolist(), rng, ids)
    """
)


class CountingProxy:
    """A loopback TCP proxy in front of the S3 server counting the bytes it sends back."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def caller_cost(target: str, env: dict[str, str], calls: int) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", CALLER, str(calls), "10"],
        env={**env, "RLREPLAY_DIR": target},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1])


def median_ms(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ids", type=int, default=2048, help="token ids in and out per trajectory (part 4)")
    parser.add_argument("--only-listing", action="store_true", help="part 4 only")
    args = parser.parse_args()

    moto, endpoint = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")}
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        RLREPLAY_SPOOL=str(tmp / "spool"),
        RLREPLAY_CACHE=str(tmp / "cache"),
    )
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ["RLREPLAY_CACHE"] = env["RLREPLAY_CACHE"]
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        from rlreplay.read.open import open_run
        from rlreplay.remote import location, publish

        if args.only_listing:
            whole_run_listing(args, env, tmp, endpoint)
            return
        print(f"## 1. calling-thread cost of one token span ({args.calls} calls, 1,000 + 2,000 ids)")
        runs: dict[str, list[tuple[float, float]]] = {"local": [], "s3": []}
        for i in range(args.repeat):  # alternated, so that load changes hit both alike
            runs["local"].append(caller_cost(str(tmp / f"caller-local-{i}"), env, args.calls))
            runs["s3"].append(caller_cost(f"s3://{BUCKET}/caller-{i}", env, args.calls))
        local, remote = (
            tuple(statistics.median(r[k] for r in runs[t]) for k in (0, 1)) for t in ("local", "s3")
        )
        print(f"(median over {args.repeat} alternated runs of each)")
        print("| target | p50 µs | p99 µs |\n|---|---:|---:|")
        print(f"| local directory | {local[0]:.1f} | {local[1]:.1f} |")
        print(f"| s3:// (spool + publisher) | {remote[0]:.1f} | {remote[1]:.1f} |")
        print(f"s3 / local (p50): {remote[0] / local[0]:.2f}x\n")

        run = tmp / "run"
        subprocess.run(
            [sys.executable, "-c", WRITER, str(args.steps), str(args.samples)],
            env={**env, "RLREPLAY_DIR": str(run)},
            check=True,
        )
        shards = sorted(run.glob("spans/step=*/worker=*/*.parquet"))
        nbytes = sum(p.stat().st_size for p in shards)

        copy_dir = tmp / "copy"
        t0 = time.perf_counter()
        shutil.copytree(run, copy_dir)
        copy_s = time.perf_counter() - t0

        uri = f"s3://{BUCKET}/runs/bench"
        loc = location.location(uri)
        spool = tmp / "publish-spool"
        shutil.copytree(run, spool)
        publisher = publish.Publisher(loc, spool)
        t0 = time.perf_counter()
        stats = publisher.close(timeout_s=600)
        upload_s = time.perf_counter() - t0
        assert stats.pending == 0, stats
        print(f"## 2. shard upload ({len(shards)} shards, {nbytes / 1e6:.2f} MB, {args.steps} steps)")
        print("| what | s | shards/s | MB/s |\n|---|---:|---:|---:|")
        for what, secs in (("publish to S3 (loopback moto)", upload_s), ("copy on local disk", copy_s)):
            print(f"| {what} | {secs:.3f} | {len(shards) / secs:.0f} | {nbytes / 1e6 / secs:.1f} |")
        print(f"S3 / disk time: {upload_s / copy_s:.0f}x\n")

        step = args.steps // 2
        local_run = open_run(run)
        expected = local_run.trajectories(step=step).num_rows
        local_ms = median_ms(lambda: local_run.trajectories(step=step))

        def cold() -> None:
            shutil.rmtree(tmp / "cache", ignore_errors=True)
            assert open_run(uri).trajectories(step=step).num_rows == expected

        cold_ms = median_ms(cold)
        warm_run = open_run(uri)
        warm_run.trajectories(step=step)
        warm_ms = median_ms(lambda: warm_run.trajectories(step=step))
        reopen_ms = median_ms(lambda: open_run(uri).trajectories(step=step))
        fetched = sorted(p.name for p in (tmp / "cache").glob("*/*/spans/*"))
        print(f"## 3. `ls --step {step}` on a {args.steps}-step run ({expected} trajectories), median of 5")
        print("| where | ms | / local |\n|---|---:|---:|")
        print(f"| local disk | {local_ms:.1f} | 1.0x |")
        print(f"| S3, cold cache (open + list + fetch step) | {cold_ms:.1f} | {cold_ms / local_ms:.1f}x |")
        for what, ms in (
            ("S3, reopened (manifest + listing, shards cached)", reopen_ms),
            ("S3, same Run again (all cached)", warm_ms),
        ):
            print(f"| {what} | {ms:.1f} | {ms / local_ms:.1f}x |")
        print(f"cache holds only: {fetched}\n")
        whole_run_listing(args, env, tmp, endpoint)
    finally:
        moto.terminate()
        moto.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def cache_bytes(cache: Path) -> tuple[int, int, int]:
    """(bytes, shard files, index files) the cache holds."""
    files = [p for p in cache.rglob("*") if p.is_file()]
    return (
        sum(p.stat().st_size for p in files),
        sum(p.name.endswith(".parquet") for p in files),
        sum(p.name.endswith(".index") and not p.name.startswith("_") for p in files),
    )


def whole_run_listing(args: argparse.Namespace, env: dict[str, str], tmp: Path, endpoint: str) -> None:
    from rlreplay.read.open import open_run
    from rlreplay.read.run import Run
    from rlreplay.read.summary import run_summary
    from rlreplay.remote import location, publish

    run = tmp / "payload-run"
    subprocess.run(
        [sys.executable, "-c", PAYLOAD_WRITER, str(args.steps), str(args.samples), str(args.ids)],
        env={**env, "RLREPLAY_DIR": str(run)},
        check=True,
    )
    shards = sorted(run.glob("spans/step=*/worker=*/*.parquet"))
    shard_bytes = sum(p.stat().st_size for p in shards)
    index_bytes = sum(p.stat().st_size for p in run.glob("spans/step=*/worker=*/*.index"))
    proxy = CountingProxy(int(endpoint.rsplit(":", 1)[1]))
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"  # this URI's reads go through it
    uri = f"s3://{BUCKET}/runs/payload"
    spool = tmp / "payload-spool"
    shutil.copytree(run, spool, ignore=shutil.ignore_patterns("_trajectories.index", "_run_index"))
    assert publish.Publisher(location.location(uri), spool).close(timeout_s=600).pending == 0
    local_run = open_run(run)
    expected = local_run.trajectories()
    some_id = expected["id"][len(expected) // 2].as_py()
    counts = ("steps", "trajectories", "spans", "token_ids")
    expected_info = [run_summary(local_run)[k] for k in counts]
    cache = tmp / "cache"

    def mirror() -> Run:  # the previous reader: every object under spans/ into the cache first
        remote = open_run(uri)
        remote.store.cache.fetch(SPANS_DIR)
        return Run(remote.store.cache_dir)

    cases = [
        ("`ls`, before: cold cache (mirror `spans/`, list it)", lambda: mirror().trajectories(), True),
        ("`ls`, now: cold cache (index files; run index written in the cache)", None, True),
        ("`ls`, now: reopened (listing + the cached run index)", None, False),
        ("`show ID`, before: cold cache", lambda: mirror().trajectory(some_id), True),
        (
            "`show ID`, now: cold cache (index files + the shard holding it)",
            lambda: open_run(uri).trajectory(some_id),
            True,
        ),
        ("`info`, before: cold cache", lambda: run_summary(mirror()), True),
        (
            "`info`, now: cold cache (metadata columns read in place)",
            lambda: run_summary(open_run(uri)),
            True,
        ),
    ]
    checks = {"`ls`": lambda out: out.equals(expected), "`show ID`": lambda out: out.id == some_id}
    checks["`info`"] = lambda out: [out[k] for k in counts] == expected_info
    results: dict[str, list[tuple[float, int, tuple[int, int, int]]]] = {}
    for _ in range(args.repeat):  # alternated, so that load changes hit all alike
        for name, fn, cold in cases:
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
            held, wire = cache_bytes(cache), proxy.down
            t0 = time.perf_counter()
            out = (fn or (lambda: open_run(uri).trajectories()))()
            secs = time.perf_counter() - t0
            assert checks[name.split(",")[0]](out), name
            now = cache_bytes(cache)
            results.setdefault(name, []).append(
                (secs * 1000, proxy.down - wire, tuple(a - b for a, b in zip(now, held)))
            )
    proxy.close()
    local_ms = median_ms(lambda: local_run.trajectories())
    print(
        f"## 4. whole-run `ls`, `show ID`, `info` on S3: {args.steps} steps, {len(expected)} trajectories, "
        f"{len(shards)} shards ({shard_bytes / 1e6:.1f} MB; index files {index_bytes / 1e6:.2f} MB), "
        f"{args.ids:,} ids in + out per trajectory; median of {args.repeat}"
    )
    print("| case | ms | MB over the wire | MB into the cache | shards fetched | index files fetched |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| `ls`, local disk (reference) | {local_ms:.0f} | 0 | 0 | 0 | 0 |")
    for name, runs in results.items():
        ms = statistics.median(r[0] for r in runs)
        wire, got = runs[-1][1], runs[-1][2]
        print(f"| {name} | {ms:.0f} | {wire / 1e6:.2f} | {got[0] / 1e6:.2f} | {got[1]} | {got[2]} |")
    ls_before, ls_after = (statistics.median(r[0] for r in results[c[0]]) for c in cases[:2])
    mb_before, mb_after = (results[c[0]][-1][1] for c in cases[:2])
    ratio = f"{ls_before / ls_after:.1f}x time, {mb_before / mb_after:.0f}x bytes over the wire"
    print(f"cold whole-run ls, before / now: {ratio}")


if __name__ == "__main__":
    main()
