"""The end of a verl batch: the rollout's event loop never waits for the recorder's I/O, and a worker
killed right after its batch returned still has that batch on disk (real verl rollout_trace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import rlreplay
from rlreplay.read.summary import recover

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, threading, time
    from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
    import rlreplay
    from rlreplay.recorders import verl as verl_hook

    run_dir, mode = sys.argv[1], sys.argv[2]
    rec = rlreplay.init(run_dir, worker="w0")
    verl_hook.install(sys.modules["verl.utils.rollout_trace"])
    RolloutTraceConfig.init("proj", "flush", "rlreplay")

    class Client:
        @rollout_trace_op
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            await asyncio.sleep(0.001)
            return {"token_ids": [i + 1 for i in prompt_ids[-50:]]}

    class Loop:
        @rollout_trace_op
        async def run(self, sampling_params, **kwargs):
            out = []
            for turn in range(3):
                res = await Client().generate(f"r{turn}", prompt_ids=list(range(300)) + out,
                                              sampling_params=sampling_params)
                out += res["token_ids"]
            return {"response_ids": out}

    async def one(step, i):
        with rollout_trace_attr(step=step, sample_index=i, rollout_n=0, name="agent_loop"):
            return await Loop().run({"temperature": 1.0})

    if mode == "blocked-writer":
        # The writer thread is stuck (a slow disk): the last loop's exit must not wait for it.
        verl_hook.BATCH_FLUSH_TIMEOUT_S = 20.0
        release = threading.Event()
        cycle = rec._cycle
        def stuck(*a, **k):
            release.wait()
            return cycle(*a, **k)
        rec._cycle = stuck

        async def timed():
            started = time.perf_counter()
            await one(1, 0)
            return time.perf_counter() - started

        took = asyncio.run(timed())
        release.set()
        rlreplay.close()
        print(json.dumps({"loop_s": took, "spans": rec.counters["spans"]}), flush=True)
    """
)

# verl's real AgentLoopWorker (tool agent loop, Hermes parser, calculator tool) on CPU, no Ray.
WORKER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import verl_parts
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from rlreplay import recorder

    from rlreplay.shards import sink

    export = sink.ShardSink.export
    def slow_disk(self, *args, **kwargs):  # a slow shared filesystem: each write takes 0.3 s
        time.sleep(0.3)
        return export(self, *args, **kwargs)
    sink.ShardSink.export = slow_disk

    workdir = sys.argv[1]
    model_dir = verl_parts.make_model_dir(os.path.join(workdir, "model"))
    tools = verl_parts.write_tool_yaml(os.path.join(workdir, "tools.yaml"))
    config = verl_parts.build_config(model_dir, tools, backend="rlreplay")
    worker = AgentLoopWorker(config, llm_client=verl_parts.ScriptedLLMClient(config, model_dir))
    output = asyncio.run(worker.generate_sequences(verl_parts.make_batch(list(range(8)), 2, 5, False)))
    print("RETURNED", len(output), flush=True)  # the batch went back to the caller
    os.kill(os.getpid(), 9)  # the trainer stops this worker at once: no time left for the writer
    """
)


def _script(run_dir: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(run_dir), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_last_loop_of_a_batch_never_waits_for_the_writer(tmp_path: Path) -> None:
    proc = _script(tmp_path / "run", "blocked-writer")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["loop_s"] < 10, report  # the writer was stuck for the whole loop
    assert report["spans"] == 5  # root, agent, 3 generate: written once the writer came back


def test_worker_killed_right_after_its_batch_returned_keeps_the_batch(tmp_path: Path) -> None:
    from rlreplay.cli.launch import child_env

    run_dir = tmp_path / "run"
    env = child_env(run_dir, None)
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).parents[1] / "verl_scripts")
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    assert [line.split() for line in out.splitlines() if line.startswith("RETURNED")] == [["RETURNED", "16"]]
    recover(run_dir)
    table = rlreplay.open_run(run_dir).trajectories(step=5)
    assert sorted(zip(table["sample_index"].to_pylist(), table["rollout_n"].to_pylist())) == [
        (i, n) for i in range(8) for n in range(2)
    ]
    assert all(s == "ok" for s in table["status"].to_pylist())
