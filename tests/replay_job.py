"""A small tool-calling agent loop on the generic API, for the replay and compare tests.

Each trajectory (step, sample_index, rollout_n) calls a model (``kind="llm"``), a parser and, when
the parser finds a call, a tool, for up to three turns. The "model" is a seeded generator of the
prompt: the same config gives the same run. Every call that reaches the engine is appended to
``$REPLAY_JOB_ENGINE_LOG``; with ``$REPLAY_JOB_ENGINE_DOWN`` set the engine refuses to answer.

Config (a dict, or JSON as the one argument): ``steps``, ``samples``, ``rollouts``, ``seed``,
``parser`` (``"v1"`` or ``"v2"``), ``changes`` (``"step:sample:rollout:call"`` -> another seed for
that model call), ``extra`` and ``skip`` (lists of ``[step, sample, rollout]``), ``tool_seed``,
``tool_shape`` (more keys of every tool reply, e.g. a ``__type__``),
``spawn`` (each step in its own process), ``exit_zero`` (exit 0 even when a trajectory
raised), ``exit_code`` (the code to exit with when one did; default 1), ``remove`` (a run
directory or URI deleted before the first trajectory: a replay's source going away while the
replay runs), ``remove_after`` (``[n, run]``: deleted after the first ``n`` trajectories).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import sys
import uuid
from typing import Any

import rlreplay

AGENT = "ToolAgentLoop.run"
GENERATE = "LLMServerClient.generate"
PARSE = "ToolParser.extract_tool_calls"
EXECUTE = "CalcTool.execute"
MAX_TURNS = 3


def f32(x: float) -> float:
    """``x`` rounded to float32 (log-probs are kept as float32)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def model_output(prompt_ids: list[int], seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{prompt_ids}")
    ids = [rng.randint(10, 99) for _ in range(rng.randint(3, 6))]
    return {
        "token_ids": ids,
        "log_probs": [f32(-rng.random()) for _ in ids],
        "stop_reason": "stop",
        "score": rng.random() / 3,  # a float64 that must come back bit for bit
        "extra": {"flag": True, "none": None, "name": f"m{seed}"},
    }


class LLMServerClient:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @rlreplay.trace_op(name=GENERATE, kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        log = os.environ.get("REPLAY_JOB_ENGINE_LOG")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(sampling_params["where"]) + "\n")
        if os.environ.get("REPLAY_JOB_ENGINE_DOWN"):
            raise ConnectionError("no model server at 127.0.0.1:1")
        where = ":".join(map(str, sampling_params["where"]))
        seed = self.config.get("changes", {}).get(where, self.config.get("seed", 0))
        await asyncio.sleep(0)
        return model_output(prompt_ids, seed)


class ToolParser:
    def __init__(self, version: str) -> None:
        self.version = version

    @rlreplay.trace_op(name=PARSE, kind="parser")
    async def extract_tool_calls(self, responses_ids: list[int]) -> list[dict[str, Any]]:
        last = responses_ids[-1]
        wanted = last % 2 == 0 if self.version == "v1" else last % 4 == 0
        return [{"name": "calc", "arguments": {"x": last}}] if wanted else []


class CalcTool:
    def __init__(self, seed: int, shape: dict[str, Any] | None = None) -> None:
        self.seed = seed
        self.shape = shape or {}

    @rlreplay.trace_op(name=EXECUTE, kind="tool")
    async def execute(self, instance_id: str, parameters: dict) -> dict:
        return {**self.shape, "text": f"result={parameters['x'] * 2 + self.seed}"}


class ToolAgentLoop:
    def __init__(self, config: dict[str, Any]) -> None:
        self.client = LLMServerClient(config)
        self.parser = ToolParser(config.get("parser", "v1"))
        self.tool = CalcTool(config.get("tool_seed", 0), config.get("tool_shape"))
        self.outputs: dict[tuple[int, int, int], list[dict[str, Any]]] = {}

    @rlreplay.trace_op(name=AGENT, kind="agent")
    async def run(self, sampling_params: dict, *, step: int, sample_index: int, rollout_n: int) -> dict:
        prompt = [1, 100 + sample_index, 2]
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        outputs = self.outputs.setdefault((step, sample_index, rollout_n), [])
        turns = 0
        for call in range(MAX_TURNS):
            params = {**sampling_params, "where": [step, sample_index, rollout_n, call]}
            out = await self.client.generate(
                uuid.uuid4().hex, prompt_ids=prompt + response, sampling_params=params
            )
            outputs.append(out)
            response += out["token_ids"]
            mask += [1] * len(out["token_ids"])
            logprobs += out["log_probs"]
            turns += 1
            calls = await self.parser.extract_tool_calls(out["token_ids"])
            if not calls:
                break
            result = await self.tool.execute(uuid.uuid4().hex, calls[0]["arguments"])
            observation = [3, *(ord(c) % 50 + 100 for c in result["text"]), 4]
            response += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
            turns += 1
        return {
            "prompt_ids": prompt,
            "response_ids": response,
            "response_mask": mask,
            "response_logprobs": logprobs,
            "reward_score": float(sum(response) % 5) / 4,
            "num_turns": turns,
            "model_outputs": len(outputs),
        }


def keys(config: dict[str, Any]) -> list[tuple[int, int, int]]:
    skip = {tuple(k) for k in config.get("skip", [])}
    out = [
        (step, sample, n)
        for step in range(config.get("steps", 2))
        for sample in range(config.get("samples", 3))
        for n in range(config.get("rollouts", 2))
        if (step, sample, n) not in skip and config.get("only_step", step) == step
    ]
    return out + [tuple(k) for k in config.get("extra", [])]


def remove(run: str) -> None:
    """Delete a run directory, or every object of a run on an object store (gone already: fine)."""
    import contextlib
    import shutil

    from rlreplay.remote import location

    uri = location.as_uri(run)
    if uri is None:
        shutil.rmtree(run, ignore_errors=True)
        return
    loc = location.location(uri)
    with contextlib.suppress(FileNotFoundError):
        loc.fs.delete_dir(loc.root)


def run_job(config: dict[str, Any]) -> dict[tuple[int, int, int], Any]:
    """Run every trajectory of ``config`` (recording wherever recording is on); returns, by keys,
    what each agent loop returned and the model outputs it got, or the error it raised."""
    if config.get("remove"):
        remove(config["remove"])
    loop = ToolAgentLoop(config)
    results: dict[tuple[int, int, int], Any] = {}

    async def one(step: int, sample: int, n: int) -> None:
        async with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=n, name="agent_loop"):
            try:
                out = await loop.run({"temperature": 1.0}, step=step, sample_index=sample, rollout_n=n)
                results[(step, sample, n)] = (out, loop.outputs.get((step, sample, n), []))
            except Exception as exc:
                results[(step, sample, n)] = exc

    async def go() -> None:
        remove_after = config.get("remove_after")
        for done, k in enumerate(keys(config)):
            if remove_after and done == remove_after[0]:
                remove(remove_after[1])
            await one(*k)

    asyncio.run(go())
    return results


def _main(config: dict[str, Any]) -> None:
    result = run_job(config)
    errors = [k for k, v in result.items() if isinstance(v, Exception)]
    print(f"{len(result)} trajectories, {len(errors)} errors", file=sys.stderr)
    if errors and not config.get("exit_zero"):
        sys.exit(config.get("exit_code", 1))


if __name__ == "__main__":
    import multiprocessing

    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if config.get("spawn"):  # each step in a fresh interpreter: recording and replay reach it through the env
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_main, args=({**config, "only_step": s},)) for s in range(config["steps"])
        ]
        [p.start() for p in procs]
        [p.join() for p in procs]
        sys.exit(max(p.exitcode or 0 for p in procs))
    _main(config)
