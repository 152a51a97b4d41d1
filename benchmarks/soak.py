"""Chaos soak: recording processes under faults, readers looping; nothing acknowledged may be lost.

Faults: SIGKILLs (cold start, mid-batch, after a step while it seals), a full disk (a tmpfs the
soak mounts, as root), store outages (--s3), corrupt run indexes and ``.index`` sidecars, and
bytes flipped in place in sealed shards and live files (a local run: ``recover`` sets aside what
their checksums reject, and the soak counts what that took apart from what went missing silently).

    python benchmarks/soak.py --duration 1800                  # a local run
    python benchmarks/soak.py --duration 900 --s3              # into s3:// on a real moto server

Each recording process runs the agent loop of ``agent_workload.py`` (multi-turn, token ids and
float32 log-probs) through ``rlreplay.init``/``trajectory``/``trace_op``, records the reward with
``record_signals`` and ends each step with ``rlreplay.flush()``. It keeps a ledger (JSONL, outside
the run): the ids of a batch before it starts, a digest of each trajectory, then whether the flush
acknowledged the batch. At the end the soak recovers the run and compares it with the ledgers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support import Forwarder, free_port, wait_port  # noqa: E402  (tests/: the helpers the tests share)

BUCKET = "soak"
SPANS_PER_TURN = 2  # an llm span, and a tool span between turns
STOP_FILE = "stop"
MIN_SLOPE_STEPS = 100  # a process's slopes count once its samples span this many steps
RUN_INDEX_DIR = "_run_index"  # the run index segments, in the run


# ---- the recording process ----------------------------------------------------------------------


def digest(prompt_ids: list[int], response_ids: list[int], log_probs: list[float], reward: Any) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(response_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(log_probs, dtype=np.float32).tobytes())
    h.update(f"|{None if reward is None else float(reward)!r}".encode())
    return h.hexdigest()[:32]


def _append(ledger: Any, record: dict) -> None:
    ledger.write(json.dumps(record) + "\n")
    ledger.flush()
    os.fsync(ledger.fileno())


def record_worker(args: argparse.Namespace) -> None:
    """One recording process: steps ``first..`` until ``--steps`` or the stop file appears."""
    sys.path.insert(0, str(HERE))
    from agent_workload import make_agent_loop

    import rlreplay
    from rlreplay.recorder import record_signals

    slot, gen = args.slot, args.gen
    rec = rlreplay.init(args.run, experiment="soak", worker=f"w{slot}")
    rec.config.max_partial_bytes = args.rotate_kb << 10  # live files rotate within a step
    seed = args.seed * 1000 + slot * 100 + gen
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    run_loop = make_agent_loop(rlreplay, list(range(1000, 120000)), rng, nprng)
    stop = Path(args.state) / STOP_FILE
    with open(args.ledger, "a") as ledger:
        for step in range(args.first, args.steps):
            if stop.exists():
                break
            began = time.monotonic()
            keys = [(slot * args.batch + b, gen) for b in range(args.batch)]
            trajs = [
                rlreplay.trajectory(step=step, sample_index=s, rollout_n=n, name="agent_loop")
                for s, n in keys
            ]
            turns = [rng.randint(2, 4) for _ in trajs]
            _append(
                ledger, {"event": "begin", "step": step, "pid": os.getpid(), "ids": [t.id for t in trajs]}
            )

            async def one(t: Any, request: str, turns: int) -> dict:
                async with t:
                    return await run_loop(request, args.tokens, turns)

            async def batch(trajs: list, turns: list[int], step: int) -> list[dict]:
                calls = (one(t, f"{step}-{k}", n) for k, (t, n) in enumerate(zip(trajs, turns)))
                return await asyncio.gather(*calls)

            outs = asyncio.run(batch(trajs, turns, step))
            for t, (s, n), out, nturns in zip(trajs, keys, outs, turns):
                record_signals(
                    t.id, step=step, sample_index=s, rollout_n=n, validate=False, reward=out["reward_score"]
                )
                d = digest(
                    out["prompt_ids"], out["response_ids"], out["response_logprobs"], out["reward_score"]
                )
                spans = 2 + nturns + (nturns - 1) + 1  # root, agent, llm, tool, signals
                _append(ledger, {"event": "recorded", "id": t.id, "step": step, "digest": d, "spans": spans})
            ok = rlreplay.flush()
            _append(ledger, {"event": "ack" if ok else "nack", "step": step, "ids": [t.id for t in trajs]})
            print(f"STEP {step}", flush=True)
            time.sleep(max(0.0, args.step_s - (time.monotonic() - began)))  # a step's generation time
    rlreplay.close()
    print("DONE", flush=True)


# ---- the object store ---------------------------------------------------------------------------


class Store:
    """A real moto S3 server (objects in memory), reached through a forwarder that chaos cuts."""

    def __init__(self, state: Path) -> None:
        self.port = free_port()
        moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
        self.log = open(state / "moto.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT
        )
        wait_port(self.port, 60)
        self.forwarder = Forwarder(self.port)
        self.forwarder.start()
        self.client().create_bucket(Bucket=BUCKET)

    def client(self, direct: bool = True) -> Any:
        import boto3

        port = self.port if direct else self.forwarder.port
        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id="soak",
            aws_secret_access_key="soak-secret",
        )

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.forwarder.port}",
            "AWS_ACCESS_KEY_ID": "soak",
            "AWS_SECRET_ACCESS_KEY": "soak-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def close(self) -> None:
        self.forwarder.stop()
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()


# ---- the soak -----------------------------------------------------------------------------------


def _proc_sample(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open fds, threads) of a process, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, AttributeError):
        return None
    return rss, fds, threads


def _slope_per_100(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of value over step, per 100 steps."""
    if len(points) < 4 or len({p[0] for p in points}) < 2:
        return None
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    return float(np.polyfit(x, y, 1)[0] * 100)


class Worker:
    def __init__(self, soak: Soak, slot: int, gen: int, first: int) -> None:
        self.slot, self.gen = slot, gen
        self.ledger = soak.state / f"ledger-{slot}-{gen}.jsonl"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--slot", str(slot),
            "--gen", str(gen),
            "--first", str(first),
            "--steps", str(soak.args.steps),
            "--batch", str(soak.args.batch),
            "--tokens", str(soak.args.tokens),
            "--rotate-kb", str(soak.args.rotate_kb),
            "--step-s", str(soak.args.step_s),
            "--seed", str(soak.args.seed),
            "--run", soak.run,
            "--ledger", str(self.ledger),
            "--state", str(soak.state),
        ]  # fmt: skip
        self.log = open(soak.state / f"worker-{slot}-{gen}.log", "w")  # noqa: SIM115 - closed when reaped
        self.proc = subprocess.Popen(cmd, env=soak.env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.started = time.monotonic()
        self.step = first - 1  # last step acknowledged
        self.last_step_at = self.started
        self.done = False
        self.killed = False
        self.samples: list[tuple[int, int, int, int]] = []  # (step, rss, fds, threads)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts[:1] == ["STEP"]:
                self.step = int(parts[1])
                self.last_step_at = time.monotonic()
            elif parts[:1] == ["DONE"]:
                self.done = True

    def alive(self) -> bool:
        return self.proc.poll() is None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.state = Path(tempfile.mkdtemp(prefix="rlreplay-soak-"))
        self.mount = self.state / "disk"
        self.mount.mkdir()
        self.tmpfs = False
        if not args.no_tmpfs and os.geteuid() == 0:
            size = f"size={args.disk_mb}m"
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", size, "soak", str(self.mount)], capture_output=True
            )
            self.tmpfs = mounted.returncode == 0
        self.store: Store | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RLREPLAY_"))}
        self.env["OPENBLAS_NUM_THREADS"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        if args.s3:
            self.store = Store(self.state)
            self.env.update(self.store.env())
            self.env["RLREPLAY_SPOOL"] = str(self.mount / "spool")  # the spool is the disk that fills
            self.env["RLREPLAY_CACHE"] = str(self.state / "cache")
            self.env["RLREPLAY_PUBLISH_INTERVAL_S"] = "0.5"
            os.environ.update(self.store.env(), RLREPLAY_CACHE=str(self.state / "cache-verify"))
            self.run = f"s3://{BUCKET}/soak/run"
            self.local_run: Path | None = None
        else:
            self.local_run = self.mount / "run"
            self.run = str(self.local_run)
        self.faults: Counter[str] = Counter()
        #: span files whose bytes a fault changed (relative to the run), and the trajectories
        #: they held then: what a read refuses, and what ``recover`` sets aside
        self.flipped: dict[str, set[str]] = {}
        self.workers: list[Worker] = []
        self.slots: dict[int, Worker] = {}
        self.gens: Counter[int] = Counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.reader_calls: Counter[str] = Counter()
        self.reader_refusals: list[str] = []
        self.reader_errors: list[str] = []
        self.ui: subprocess.Popen | None = None
        self.ui_port = 0

    # -- recording processes --

    def spawn(self, slot: int, first: int) -> Worker:
        gen = self.gens[slot]
        self.gens[slot] += 1
        worker = Worker(self, slot, gen, first)
        with self.lock:
            self.workers.append(worker)
            self.slots[slot] = worker
        return worker

    def next_step(self, slot: int) -> int:
        """The step a replacement starts at: the one after the last acknowledged (a batch is redone)."""
        return self.slots[slot].step + 1

    def kill(self, worker: Worker, kind: str) -> None:
        if not worker.alive():
            return
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        worker.killed = True
        self.faults[f"kill ({kind})"] += 1

    def replace(self, slot: int) -> Worker:
        return self.spawn(slot, self.next_step(slot))

    # -- faults --

    def chaos(self) -> None:
        kinds = ["kill-mid", "kill-cold", "kill-sealing", "disk-full", "corrupt"]
        if self.store is not None:
            kinds.append("store-outage")
        elif not self.args.no_flips:
            kinds.append("flip")
        deck: list[str] = []  # every kind once, in a seeded order, before any kind again
        while not self.stop.wait(self.rng.uniform(*self.args.fault_gap)):
            deck = deck or self.rng.sample(kinds, len(kinds))
            kind = deck.pop()
            try:
                getattr(self, "fault_" + kind.replace("-", "_"))()
            except Exception as exc:  # a fault that could not be made is reported, not fatal
                self.faults[f"{kind} not made ({type(exc).__name__})"] += 1

    def _live_slot(self) -> int | None:
        with self.lock:
            live = [s for s, w in self.slots.items() if w.alive() and not w.done]
        return self.rng.choice(live) if live else None

    def fault_kill_mid(self) -> None:
        slot = self._live_slot()
        if slot is not None:
            self.kill(self.slots[slot], "mid-batch")
            self.replace(slot)

    def fault_kill_cold(self) -> None:
        slot = self._live_slot()
        if slot is None:
            return
        self.kill(self.slots[slot], "mid-batch")
        fresh = self.replace(slot)
        time.sleep(self.rng.uniform(0.05, 1.5))  # while it imports, inits, records its first spans
        self.kill(fresh, "cold start")
        self.replace(slot)

    def fault_kill_sealing(self) -> None:
        """Kill right after a step's flush: the step before is being sealed (and published)."""
        slot = self._live_slot()
        if slot is None:
            return
        worker = self.slots[slot]
        seen = worker.step
        deadline = time.monotonic() + 30
        while (
            worker.step == seen and worker.alive() and time.monotonic() < deadline and not self.stop.is_set()
        ):
            time.sleep(0.01)
        time.sleep(self.rng.uniform(0.0, 0.2))
        self.kill(worker, "after a step, sealing")
        self.replace(slot)

    def fault_disk_full(self) -> None:
        if not self.tmpfs:
            return
        filler = self.mount / "filler"
        with open(filler, "wb") as f:
            chunk = b"\0" * (1 << 20)
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()
        self.faults["disk full"] += 1
        self.stop.wait(self.rng.uniform(1.0, 5.0))
        filler.unlink()

    def fault_store_outage(self) -> None:
        assert self.store is not None
        self.store.forwarder.stop()
        self.faults["store outage"] += 1
        self.stop.wait(self.rng.uniform(1.0, 6.0))
        self.store.forwarder.start()

    def fault_corrupt(self) -> None:
        if self.store is not None:
            client = self.store.client()
            indexes = [k for k in self.store.keys("soak/run/") if k.endswith(".index")]
            if not indexes:
                return
            key = self.rng.choice(indexes)
            body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            client.put_object(Bucket=BUCKET, Key=key, Body=_garble(body, self.rng))
            self.faults["corrupt run index" if key.endswith("_trajectories.index") else "corrupt .index"] += 1
            return
        assert self.local_run is not None
        segments = sorted((self.local_run / RUN_INDEX_DIR).glob("*.index"))
        if segments and self.rng.random() < 0.5:
            target, kind = self.rng.choice(segments), "corrupt run index"
        else:
            sidecars = list((self.local_run / "spans").glob("step=*/worker=*/*.index"))
            if not sidecars:
                return
            target, kind = self.rng.choice(sidecars), "corrupt .index"
        with contextlib.suppress(FileNotFoundError):
            data = target.read_bytes()
            target.write_bytes(_garble(data, self.rng))
            self.faults[kind] += 1

    def fault_flip(self) -> None:
        """Change 1 to 3 bytes in place (a bad sector, a stray write) of a sealed shard or a live
        file, after noting the trajectories it holds."""
        assert self.local_run is not None
        spans = self.local_run / "spans"
        files = sorted(spans.glob("step=*/worker=*/part-*.parquet"))
        if self.rng.random() < 0.3:
            files = sorted(spans.glob("step=*/worker=*/_part-*.partial")) or files
        if not files:
            return
        target = self.rng.choice(files)
        try:
            held = file_ids(target)
            size = target.stat().st_size
            with open(target, "r+b") as f:
                for _ in range(self.rng.randint(1, 3)):
                    at = self.rng.randrange(size)
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ self.rng.randrange(1, 256)]))
        except FileNotFoundError:  # sealed (or set aside) meanwhile
            return
        with self.lock:
            self.flipped.setdefault(target.relative_to(self.local_run).as_posix(), set()).update(held)
        self.faults["bytes flipped (" + ("live file" if target.name.startswith("_") else "shard") + ")"] += 1

    # -- readers --

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rlreplay", *args],
            env={**self.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.state,
        )

    def begun_ids(self) -> set[str]:
        ids: set[str] = set()
        for ledger in self.state.glob("ledger-*.jsonl"):
            for record in _records(ledger):
                if record["event"] == "begin":
                    ids.update(record["ids"])
        return ids

    def reader(self, n: int) -> None:
        rng = random.Random(self.args.seed + 7919 * (n + 1))
        last_ids: list[str] = []
        commands = ["ls", "show", "stats", "sql", "ui"]
        for turn in range(n, 1 << 62):
            if self.stop.is_set():
                break
            what = commands[turn % len(commands)]
            try:
                if what == "ls":
                    proc = self.cli("ls", self.run, "--json")
                    if self._check(what, proc):
                        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
                        ids = [r["id"] for r in rows]
                        last_ids = ids
                        self._check_listing(ids)
                elif what == "stats":
                    self._check(what, self.cli("stats", self.run))
                elif what == "show" and last_ids:
                    self._check(what, self.cli("show", rng.choice(last_ids), "--run", self.run))
                elif what == "sql":
                    proc = self.cli("sql", self.run, "SELECT count(*) AS n FROM trajectories", "--json")
                    self._check(what, proc)
                elif what == "ui" and self.ui_port:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/", timeout=60) as resp:
                        resp.read()
                    self.reader_calls["ui"] += 1
            except Exception as exc:
                with self.lock:
                    self.reader_errors.append(f"{what}: {type(exc).__name__}: {exc}")

    def _check(self, what: str, proc: subprocess.CompletedProcess) -> bool:
        self.reader_calls[what] += 1
        if proc.returncode == 0 and "Traceback" not in proc.stderr:
            return True
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        with self.lock:
            if proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) <= 2:
                self.reader_refusals.append(f"{what}: {lines[-1] if lines else ''}")
            else:
                self.reader_errors.append(f"{what}: exit {proc.returncode}: {proc.stderr[-2000:]}")
        return False

    def _check_listing(self, ids: list[str]) -> None:
        problems = []
        dups = [i for i, c in Counter(ids).items() if c > 1]
        if dups:
            problems.append(f"ls listed {len(dups)} trajectories twice")
        phantom = set(ids) - self.begun_ids()
        if phantom:
            problems.append(f"ls listed {len(phantom)} trajectories never recorded")
        if self.local_run is not None and self.rng.random() < 0.2:
            with self.lock:  # a damaged file's ids may be listed from its index
                flipped = len(set().union(*self.flipped.values()))
            on_disk = direct_count(self.local_run, partials=True) + flipped
            if len(set(ids)) > on_disk:
                problems.append(f"ls listed {len(set(ids))} trajectories, {on_disk} on disk after it")
        if problems:
            with self.lock:
                self.reader_errors.extend(problems)

    def start_ui(self) -> None:
        self.ui_port = free_port()
        log = open(self.state / "ui.log", "w")  # noqa: SIM115 - lives as long as the soak
        self.ui = subprocess.Popen(
            [sys.executable, "-m", "rlreplay", "ui", self.run, "--port", str(self.ui_port)],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.state,
        )
        try:
            wait_port(self.ui_port, 120)
        except TimeoutError:
            self.ui_port = 0

    # -- sampling --

    def sampler(self) -> None:
        while not self.stop.wait(self.args.sample_s):
            with self.lock:
                workers = [w for w in self.workers if w.alive()]
            for w in workers:
                sample = _proc_sample(w.proc.pid)
                if sample is not None and w.step >= 0:
                    w.samples.append((w.step, *sample))

    # -- the whole soak --

    def go(self) -> dict[str, Any]:
        args = self.args
        started = time.monotonic()
        for slot in range(args.processes):
            self.spawn(slot, 0)
        first = self.slots[0]
        while first.step < 0 and time.monotonic() - started < 300 and first.alive():
            time.sleep(0.2)  # the run exists once a process has recorded a step
        if args.ui:
            self.start_ui()
        threads = [
            threading.Thread(target=self.chaos, daemon=True),
            threading.Thread(target=self.sampler, daemon=True),
        ]
        threads += [threading.Thread(target=self.reader, args=(n,), daemon=True) for n in range(args.readers)]
        for t in threads:
            t.start()
        deadline = started + args.duration
        while time.monotonic() < deadline:
            with self.lock:
                slots = dict(self.slots)
            if all(w.done for w in slots.values()):
                break
            for slot, w in slots.items():  # a process that died by itself is replaced, and reported
                if not w.alive() and not w.done and not w.killed and not self.stop.is_set():
                    self.faults["died by itself"] += 1
                    w.killed = True
                    self.replace(slot)
            time.sleep(0.5)
        if self.store is None and not self.args.no_flips and not self.flipped:
            with contextlib.suppress(Exception):  # a short soak whose deck never reached a flip
                self.fault_flip()
        (self.state / STOP_FILE).touch()
        self.phase("stopping")
        self.stop.set()
        for t in threads:
            t.join(600)
        if self.store is not None:
            with contextlib.suppress(OSError):
                self.store.forwarder.start()
        with contextlib.suppress(FileNotFoundError):
            (self.mount / "filler").unlink()
        for w in list(self.workers):
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(300)
            if w.alive():
                self.kill(w, "did not stop")
        if self.ui is not None:
            self.ui.terminate()
            self.ui.wait(30)
        recording_s = time.monotonic() - started
        return self.verify(recording_s)

    def phase(self, what: str) -> None:
        print(f"soak: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)

    def verify(self, recording_s: float) -> dict[str, Any]:
        self.phase("recover")
        recover = self.cli("recover", self.run, timeout=1800)
        if recover.returncode != 0:
            self.reader_errors.append(f"recover: exit {recover.returncode}: {recover.stderr[-2000:]}")
        ledgers = [(w, list(_records(w.ledger))) for w in self.workers if w.ledger.exists()]
        begun: dict[str, Worker] = {}
        recorded: dict[str, dict] = {}
        acked: set[str] = set()
        nacked: set[str] = set()
        for w, records in ledgers:
            for r in records:
                if r["event"] == "begin":
                    begun.update(dict.fromkeys(r["ids"], w))
                elif r["event"] == "recorded":
                    recorded[r["id"]] = r
                elif r["event"] == "ack":
                    acked.update(r["ids"])
                elif r["event"] == "nack":
                    nacked.update(r["ids"])
        self.phase("final listing")
        ls = self.cli("ls", self.run, "--json", timeout=1800)
        if ls.returncode != 0:
            self.reader_errors.append(f"final ls: exit {ls.returncode}: {ls.stderr[-2000:]}")
        listed_rows = [json.loads(line) for line in ls.stdout.splitlines() if line.strip()]
        listed = Counter(r["id"] for r in listed_rows)
        duplicated = sum(1 for c in listed.values() if c > 1)
        phantom = len(set(listed) - set(begun))
        info = json.loads(self.cli("info", self.run, "--json").stdout or "{}")
        counted = sum(int(info.get(k) or 0) for k in ("lost", "dropped", "encode_errors"))
        missing_acked = sorted(acked - set(listed))
        # a trajectory not acknowledged is either listed, counted in the loss counters, or was in
        # the recording of a process killed before it could report (the caller got no acknowledgement)
        unacked = set(begun) - acked
        unlisted = unacked - set(listed)
        # a killed process may not have saved its loss counters (the disk was full): its unlisted
        # trajectories were never acknowledged to the caller, and are reported apart
        in_killed_batch = {i for i in unlisted if begun[i].killed}
        # a file whose bytes a fault changed: recover set it aside (and sealed what still matched
        # its checksums again); the trajectories it held may be gone, and recover said so
        set_aside = self.set_aside_files()
        flipped_ids = set().union(*self.flipped.values())
        with_file = set().union(*(ids for rel, ids in self.flipped.items() if rel in set_aside))
        lost_to_flips = {i for i in missing_acked if i in with_file}
        missing_acked = [i for i in missing_acked if i not in lost_to_flips]
        unlisted -= with_file
        uncounted_spans = sum(recorded.get(i, {}).get("spans", 0) for i in unlisted - in_killed_batch)
        uncounted = len(unlisted - in_killed_batch) if uncounted_spans > counted else 0
        silently_missing = len(missing_acked) + uncounted
        self.phase("direct count")
        direct = self.direct_count()
        self.phase("compare with the ledgers")
        # on S3, the objects themselves, mirrored by direct_count
        local = str(self.local_run or self.state / "mirror" / "soak" / "run")
        rewards = {r["id"]: r.get("reward") for r in listed_rows}
        differ, unreadable, incomplete = compare_digests(
            local, sorted(set(listed) & set(recorded)), recorded, rewards
        )
        # read back incomplete from a file a flip damaged (a read refused it, or recover set it
        # aside, and said so): not silent; other values than recorded always are
        refused_flipped = incomplete & flipped_ids
        mismatched = len((differ - refused_flipped) & acked)
        self.phase("run index rebuild")
        index_s, shards = self.rebuild_index()
        slopes = self.slopes()
        return {
            "mode": "s3" if self.store is not None else "local",
            "duration_s": round(recording_s),
            "processes": self.args.processes,
            "steps": max((w.step for w in self.workers), default=-1) + 1,
            "faults": dict(sorted(self.faults.items())),
            "acknowledged": len(acked),
            "recorded": len(begun),
            "listed": len(listed),
            "direct_count": direct,
            "counted_lost_spans": counted,
            "not_acknowledged_unlisted_killed": len(in_killed_batch),
            "not_acknowledged_unlisted_counted": len(unlisted - in_killed_batch),
            "duplicated": duplicated,
            "silently_missing": silently_missing,
            "missing_acknowledged": missing_acked[:10],
            "mismatched": mismatched,
            "mismatched_examples": sorted((differ - refused_flipped) & acked)[:10],
            # byte flips: files changed, acknowledged trajectories that went with the files recover
            # set aside, and trajectories a read refused (their file damaged, and named)
            "flipped_files": len(self.flipped),
            "flipped_files_set_aside": len(set_aside & set(self.flipped)),
            "lost_to_flips_acknowledged": len(lost_to_flips),
            "refused_damaged": len(refused_flipped),
            "listed_incomplete_not_acknowledged": len(differ - acked),
            # listed, a token array not readable back (a reader gives an error marker and a warning),
            # not from a file a flip damaged
            "unreadable_acknowledged": len((unreadable - flipped_ids) & acked),
            "unreadable_not_acknowledged": len(unreadable - acked),
            "phantom": phantom,
            "listing_equals_direct_count": len(listed) == direct,
            "reader_calls": dict(self.reader_calls),
            "reader_refusals": len(self.reader_refusals),
            "reader_refusal_examples": sorted(set(self.reader_refusals))[:5],
            "reader_errors": len(self.reader_errors),
            "reader_error_examples": self.reader_errors[:5],
            "shards": shards,
            "run_index_rebuild_s": index_s,
            **slopes,
            "recover": recover.stdout.strip()[-300:],
            "state": str(self.state),
        }

    def set_aside_files(self) -> set[str]:
        """The run files (relative paths) recover set aside in the quarantine, whole or in pieces."""
        if self.local_run is None:
            return set()
        quarantine = self.local_run / "_quarantine"
        out = set()
        for path in quarantine.rglob("*"):
            if path.is_file():
                rel = path.relative_to(quarantine).as_posix()
                out.add(re.sub(r"\.bytes-\d+-\d+$", "", rel))
        return out

    def direct_count(self) -> int:
        """Trajectories over the span files, counted with pyarrow alone."""
        if self.local_run is not None:
            return direct_count(self.local_run, partials=False)
        assert self.store is not None
        dest = self.state / "mirror"
        client = self.store.client()
        for key in self.store.keys("soak/run/"):
            if not key.endswith((".index", "/")):  # the shards, the manifest, the counters
                path = dest / key
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(BUCKET, key, str(path))
        return direct_count(dest / "soak" / "run", partials=False)

    def rebuild_index(self) -> tuple[float, int]:
        """Seconds a fresh reader takes to list the run without its run index; sealed shards."""
        if self.local_run is not None:
            shards = len(list((self.local_run / "spans").glob("step=*/worker=*/*.parquet")))
            shutil.rmtree(self.local_run / RUN_INDEX_DIR, ignore_errors=True)
            env_cache = self.state / "cache-rebuild"
        else:
            assert self.store is not None
            shards = len([k for k in self.store.keys("soak/run/spans/") if k.endswith(".parquet")])
            env_cache = self.state / "cache-rebuild"
        saved = self.env.get("RLREPLAY_CACHE")
        self.env["RLREPLAY_CACHE"] = str(env_cache)
        t0 = time.perf_counter()
        self.cli("ls", self.run, "--json", "--limit", "1", timeout=1800)
        seconds = time.perf_counter() - t0
        if saved is None:
            self.env.pop("RLREPLAY_CACHE")
        else:
            self.env["RLREPLAY_CACHE"] = saved
        return round(seconds, 2), shards

    def slopes(self) -> dict[str, Any]:
        """Per process sampled over at least ``MIN_SLOPE_STEPS`` steps: slope per 100 steps after its
        first 10% of samples (a replacement started late, sampled over a few steps, mostly shows its
        start-up, not a trend)."""
        rss, fds, thr = [], [], []
        for w in self.workers:
            samples = w.samples[max(1, len(w.samples) // 10) :]
            if len(samples) < 8 or samples[-1][0] - samples[0][0] < MIN_SLOPE_STEPS:
                continue
            for out, col in ((rss, 1), (fds, 2), (thr, 3)):
                slope = _slope_per_100([(s[0], s[col]) for s in samples])
                if slope is not None:
                    out.append(slope)
        peak_rss = max((s[1] for w in self.workers for s in w.samples), default=0)

        def worst(values: list[float]) -> float | None:
            return max(values, key=abs) if values else None

        mb = worst(rss)
        return {
            "rss_mb_per_100_steps_median": round(float(np.median(rss)) / 2**20, 2) if rss else None,
            "rss_mb_per_100_steps_worst": round(mb / 2**20, 2) if mb is not None else None,
            "fds_per_100_steps_worst": round(worst(fds), 2) if fds else None,
            "threads_per_100_steps_worst": round(worst(thr), 2) if thr else None,
            "peak_rss_mb": round(peak_rss / 2**20),
            "processes_sampled": len(rss),
            "processes_started": len(self.workers),
        }

    def close(self) -> None:
        for w in self.workers:
            if w.alive():
                w.proc.kill()
                w.proc.wait()
        if self.ui is not None and self.ui.poll() is None:
            self.ui.kill()
        if self.store is not None:
            self.store.close()
        if self.tmpfs:
            if self.args.keep:
                shutil.copytree(self.mount, self.state / "disk-copy", ignore=shutil.ignore_patterns("filler"))
            subprocess.run(["umount", "-l", str(self.mount)], check=False)
        if not self.args.keep:
            shutil.rmtree(self.state, ignore_errors=True)


def _records(ledger: Path) -> Any:
    """A ledger's records; a torn last line (the process was killed while writing it) is skipped."""
    with open(ledger) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                yield json.loads(line)


def _garble(data: bytes, rng: random.Random) -> bytes:
    """Half the file, or the file with a run of bytes overwritten."""
    if rng.random() < 0.5 or len(data) < 64:
        return data[: len(data) // 2]
    at = rng.randrange(0, len(data) - 32)
    return data[:at] + os.urandom(32) + data[at + 32 :]


def file_ids(path: Path) -> set[str]:
    """The trajectory ids a span file holds, read with pyarrow alone (as far as it reads: a damaged
    file gives what pyarrow gets from it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids: set[str] = set()
    if path.name.endswith(".parquet"):
        with contextlib.suppress(OSError, pa.ArrowException, ValueError):
            ids.update(pq.read_table(path, columns=["trajectory_id"])["trajectory_id"].to_pylist())
        return ids
    with (
        contextlib.suppress(OSError, pa.ArrowException, ValueError),
        pa.ipc.open_stream(pa.OSFile(str(path))) as reader,
    ):
        while True:
            try:
                batch = reader.read_next_batch()
            except (StopIteration, OSError, pa.ArrowException, ValueError):
                break
            ids.update(batch.column(batch.schema.get_field_index("trajectory_id")).to_pylist())
    return ids


def direct_count(run_dir: Path, partials: bool) -> int:
    """Distinct trajectory ids over a run's span files, read with pyarrow alone (live files too)."""
    ids: set[str] = set()
    spans = run_dir / "spans"
    if partials:  # live files first: one sealed meanwhile is in its shard before the live file goes
        for path in spans.glob("step=*/worker=*/_part-*.partial"):
            ids |= file_ids(path)
    for path in spans.glob("step=*/worker=*/*.parquet"):
        ids |= file_ids(path)
    return len(ids)


def compare_digests(
    run: str, ids: list[str], recorded: dict[str, dict], rewards: dict[str, Any]
) -> tuple[set[str], set[str], set[str]]:
    """(trajectories whose stored ids, log-probs or listed reward (``rewards``, from ``ls``) differ
    from what the recorder was given, or whose agent span is missing; those of them whose agent
    output did not read back as lists; those of them read back incomplete: no agent span, or a
    token array that could not be restored, never other values)."""
    import rlreplay
    from rlreplay.read.filters import Filters

    opened = rlreplay.open_run(run)
    differ: set[str] = set()
    unreadable: set[str] = set()
    incomplete: set[str] = set()
    by_step: dict[int, list[str]] = {}
    for tid in ids:
        by_step.setdefault(recorded[tid]["step"], []).append(tid)
    for step, chunk in sorted(by_step.items()):  # a step's files only
        found = {traj.id: traj for traj in opened.load(chunk, Filters(step=step))}
        for tid in chunk:
            traj = found.get(tid)
            agents = traj.by_kind("agent") if traj is not None else []
            if len(agents) != 1:
                differ.add(tid)
                incomplete.add(tid)
                continue
            out = agents[0].output
            if not all(
                isinstance(out.get(k), list) for k in ("prompt_ids", "response_ids", "response_logprobs")
            ):
                differ.add(tid)  # an error marker: a token array that cannot be restored
                unreadable.add(tid)
                incomplete.add(tid)
                continue
            got = digest(out["prompt_ids"], out["response_ids"], out["response_logprobs"], rewards.get(tid))
            if got != recorded[tid]["digest"]:
                differ.add(tid)
    return differ, unreadable, incomplete


def table(result: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in result["faults"].items()) or "none"
    rows = [
        ("mode", result["mode"]),
        ("recording time", f"{result['duration_s']} s"),
        ("steps", result["steps"]),
        ("processes", result["processes"]),
        ("faults injected", faults),
        ("trajectories recorded (begun)", result["recorded"]),
        ("acknowledged", result["acknowledged"]),
        ("listed after recover", result["listed"]),
        ("direct count over span files (pyarrow)", result["direct_count"]),
        ("counted lost (spans)", result["counted_lost_spans"]),
        ("unacknowledged, from a killed process, not listed", result["not_acknowledged_unlisted_killed"]),
        ("duplicated (must be 0)", result["duplicated"]),
        ("silently missing (must be 0)", result["silently_missing"]),
        ("ids/log-probs/reward differ silently (must be 0)", result["mismatched"]),
        ("byte flips: files changed / set aside by recover", f"{result['flipped_files']} / "
         f"{result['flipped_files_set_aside']}"),
        ("byte flips: acknowledged trajectories set aside with their file (recover said so)",
         result["lost_to_flips_acknowledged"]),
        ("byte flips: trajectories read back incomplete from a damaged file", result["refused_damaged"]),
        ("listed, token arrays unreadable: acknowledged (must be 0) / not acknowledged",
         f"{result['unreadable_acknowledged']} / {result['unreadable_not_acknowledged']}"),
        ("listed, never recorded (must be 0)", result["phantom"]),
        ("reader calls", ", ".join(f"{k} {v}" for k, v in sorted(result["reader_calls"].items()))),
        ("reader errors (must be 0)", result["reader_errors"]),
        ("reader refusals (exit 2, one line)", result["reader_refusals"]),
        ("processes whose slopes count (sampled over >= 100 steps) / started",
         f"{result['processes_sampled']} / {result['processes_started']}"),
        ("recorder RSS slope, MB per 100 steps (median / worst)",
         f"{result['rss_mb_per_100_steps_median']} / {result['rss_mb_per_100_steps_worst']}"),
        ("open FDs slope per 100 steps (worst)", result["fds_per_100_steps_worst"]),
        ("threads slope per 100 steps (worst)", result["threads_per_100_steps_worst"]),
        ("peak recorder RSS", f"{result['peak_rss_mb']} MB"),
        ("sealed shards", result["shards"]),
        ("listing without the run index (fresh reader)", f"{result['run_index_rebuild_s']} s"),
    ]  # fmt: skip
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def failures(result: dict[str, Any]) -> list[str]:
    checks = {
        "duplicated": result["duplicated"],
        "silently missing": result["silently_missing"],
        "mismatched": result["mismatched"],
        "listed, never recorded": result["phantom"],
        "reader errors": result["reader_errors"],
    }
    out = [f"{k}: {v}" for k, v in checks.items() if v]
    calls = sum(result["reader_calls"].values())
    if calls and calls <= result["reader_refusals"] + result["reader_errors"]:
        out.append(f"none of {calls} reader calls was answered")
    if not result["listing_equals_direct_count"]:
        out.append(f"listing {result['listed']} != direct count {result['direct_count']}")
    return out


def one_process(args: argparse.Namespace) -> None:
    """One recording process, no faults and no readers: its RSS every 25 steps, and the slope from
    step 100 on (does a long-lived process grow, or only start up?)."""
    state = Path(tempfile.mkdtemp(prefix="rlreplay-soak-one-"))
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--steps", str(args.one_process),
        "--batch", str(args.batch), "--tokens", str(args.tokens), "--rotate-kb", str(args.rotate_kb),
        "--seed", str(args.seed), "--run", str(state / "run"), "--ledger", str(state / "ledger.jsonl"),
        "--state", str(state),
    ]  # fmt: skip
    points: list[tuple[int, float]] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            parts = line.split()
            if parts[:1] == ["STEP"] and int(parts[1]) % 25 == 0:
                sample = _proc_sample(proc.pid)
                if sample is not None:
                    points.append((int(parts[1]), sample[0] / 2**20))
                    print(f"step {parts[1]}: RSS {points[-1][1]:.1f} MB", flush=True)
        proc.wait()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    slope = _slope_per_100([p for p in points if p[0] >= 100])
    print(f"RSS slope from step 100: {slope:+.2f} MB per 100 steps" if slope is not None else "too few steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--duration", type=float, default=1800, help="seconds of recording")
    p.add_argument(
        "--steps", type=int, default=1_000_000, help="steps per process (stops earlier at --duration)"
    )
    p.add_argument("--batch", type=int, default=4, help="trajectories per process per step")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per trajectory")
    p.add_argument("--step-s", type=float, default=0.0, help="a step lasts at least this long")
    p.add_argument("--rotate-kb", type=int, default=256, help="live files rotate at this size")
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--fault-gap", type=float, nargs=2, default=(3.0, 12.0), metavar=("MIN", "MAX"))
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--disk-mb", type=int, default=2048, help="size of the tmpfs the run (or spool) lives on")
    p.add_argument("--no-tmpfs", action="store_true", help="no tmpfs mount: no disk-full faults")
    p.add_argument("--no-flips", action="store_true", help="no byte flips in span files")
    p.add_argument("--s3", action="store_true", help="record into s3:// on a real moto server")
    p.add_argument(
        "--ui", action=argparse.BooleanOptionalAction, default=True, help="readers also load a UI page"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--keep", action="store_true", help="keep the state folder (run, ledgers, logs)")
    p.add_argument(
        "--one-process", type=int, metavar="STEPS", help="only one recording process, no faults: its RSS"
    )
    # a recording process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("slot", "gen", "first"):
        p.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    for name in ("run", "ledger", "state"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        record_worker(args)
        return
    if args.one_process:
        one_process(args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (unmount) when stopped
    soak = Soak(args)
    try:
        result = soak.go()
    finally:
        soak.close()
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for example in result["reader_refusal_examples"]:
        print("reader refusal: " + example[:500], file=sys.stderr)
    bad = failures(result)
    if bad:
        print("FAILED: " + "; ".join(bad), file=sys.stderr)
        for example in result["reader_error_examples"]:
            print("reader error: " + example[:1500], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
