"""The proxy never makes a client's answer wait for the disk: with the recorder's disk stalled and
its queue full, calls through the proxy (in front of the real model server, which stands in for
vLLM/SGLang) are still answered, and once the disk comes back every call is recorded, none lost."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlreplay.format import manifest
from rlreplay.format.keys import TrajectoryKey
from rlreplay.proxy.server import Proxy, ProxySettings, serve
from rlreplay.proxy.trajectories import ProxyTrajectory, Trajectories
from rlreplay.read.open import open_run
from rlreplay.recorder.writer import LOSS_COUNTERS, Recorder, RecorderConfig
from rlreplay.shards.sink import ShardSink

pytestmark = pytest.mark.timeout(600)
CALLS = 12
ANSWER_BOUND_S = 60.0  # generous: a call takes well under a second on this model; a stalled one, forever
DURABLE_WAIT_S = 0.5  # how long an answer's end waits for its call to be written (the proxy's default: 5 s)


def stalled_disk() -> tuple[type[ShardSink], threading.Event, threading.Event]:
    """A sink whose writes wait until ``resume`` is set (a disk that stops answering); ``stalled``
    is set once a write waits."""
    stalled, resume = threading.Event(), threading.Event()

    class StalledDisk(ShardSink):
        def export(self, step: Any, batch: Any) -> Any:
            stalled.set()
            resume.wait()
            return super().export(step, batch)

    return StalledDisk, stalled, resume


def stalled_recorder(run_dir: Path) -> tuple[Recorder, threading.Event, threading.Event]:
    """A recorder writing to a stalling disk, with a queue of one span: the second one finds it
    full (policy spill: whoever queues it would encode and write it)."""
    run_dir.mkdir()
    manifest.ensure_manifest(run_dir, None)
    sink, stalled, resume = stalled_disk()
    config = RecorderConfig(run_dir, worker="proxy", max_queue_bytes=1, max_batch_age_s=0.0, sink=sink)
    return Recorder(config), stalled, resume


class InProcessProxy:
    """The proxy's server on its own thread and event loop, recording with ``recorder``."""

    def __init__(self, upstream: str, recorder: Recorder, durable_wait_s: float) -> None:
        self.trajectories = Trajectories(recorder, idle_s=0.5)
        self.proxy = Proxy(ProxySettings(upstream, durable_wait_s=durable_wait_s), self.trajectories)
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        listening = threading.Event()

        def ready(url: str) -> None:
            self.url, self.loop = url, asyncio.get_running_loop()
            listening.set()

        async def main() -> None:
            self.stop_event = asyncio.Event()
            await serve(self.proxy, "127.0.0.1", 0, ready, self.stop_event)

        self.thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self.thread.start()
        assert listening.wait(30), "the proxy did not start"

    def stop(self) -> None:
        assert self.loop is not None and self.stop_event is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(120)
        assert not self.thread.is_alive(), "the proxy did not stop"


def test_answers_do_not_wait_for_a_stalled_disk(model_server: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    recorder, stalled, resume = stalled_recorder(run_dir)
    proxy = InProcessProxy(model_server, recorder, DURABLE_WAIT_S)
    answered: list[float] = []
    try:
        with httpx.Client(timeout=ANSWER_BOUND_S) as client:

            def call(k: int) -> None:
                started = time.monotonic()
                got = client.post(
                    f"{proxy.url}/v1/chat/completions",
                    json={
                        "model": "m",
                        "messages": [{"role": "user", "content": f"Say {k}."}],
                        "max_tokens": 2,
                        "stream": k % 3 == 0,
                    },
                    headers={"X-Rlreplay-Trajectory": f"step=0,sample_index={k}"},
                )
                assert got.status_code == 200, got.text
                answered.append(time.monotonic() - started)

            call(0)
            assert stalled.wait(30), "the recorder never wrote"  # the disk is stalled now
            for k in range(1, CALLS):
                call(k)  # a call whose answer waited for the disk would time out here
            assert len(answered) == CALLS and max(answered) < ANSWER_BOUND_S
            assert min(answered[1:]) >= DURABLE_WAIT_S  # each waited as long as it may, then was answered
            assert proxy.trajectories.handoff.waiting > 0  # what the stalled disk holds up waits here
    finally:
        resume.set()  # the disk answers again
        proxy.stop()
        recorder.close()
    assert all(recorder.counters[name] == 0 for name in LOSS_COUNTERS), recorder.counters
    run = open_run(run_dir)
    listing = run.trajectories()
    assert sorted(listing["sample_index"].to_pylist()) == list(range(CALLS))
    spans = [s for t in run.load(listing["id"].to_pylist()) for s in t.spans if s.kind == "llm"]
    assert len(spans) == CALLS and all(s.output["token_ids"] for s in spans)


def test_what_waits_for_the_disk_is_bounded_and_counted(tmp_path: Path) -> None:
    """Beyond the hand-off's bound a call's span is dropped and counted, never waited for; the
    trajectory's root span is kept, and what was kept is all written once the disk answers."""
    recorder, stalled, resume = stalled_recorder(tmp_path / "run")
    trajectories = Trajectories(recorder)
    trajectories.handoff.max_bytes = 64 << 10
    traj = ProxyTrajectory(TrajectoryKey.of(3, 0), explicit=True)
    calls = 200
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}]}
    try:
        for k in range(calls):
            trajectories.record(
                traj, "chat.completions", body, {"token_ids": [k], "log_probs": [-0.5]}, k, k + 1
            )
            if k == 0:
                assert stalled.wait(30), "the recorder never wrote"
        trajectories.close(traj)
        dropped = recorder.counters["dropped"]
        assert 0 < dropped < calls
    finally:
        resume.set()
        assert trajectories.close_all(timeout=120)
        recorder.close()
    assert recorder.counters["lost"] == 0 and recorder.counters["dropped"] == dropped
    run = open_run(tmp_path / "run")
    [loaded] = run.load(run.trajectories()["id"].to_pylist())
    kept = sorted(s.output["token_ids"][0] for s in loaded.spans if s.kind == "llm")
    assert len(kept) == calls - dropped and kept[0] == 0 and any(s.kind == "trajectory" for s in loaded.spans)
