"""Shared fixtures: a run recorded with the real recorder, and a real local MLflow server."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest
from support import (
    EXPERIMENT,
    ROLLOUTS,
    TRAIN_SAMPLES,
    TRAIN_STEPS,
    VAL_ROLLOUTS,
    VAL_SAMPLES,
    VAL_STEPS,
    free_port,
    mlflow_server_command,
    qwen_tokenizer_dir,
    start_server,
    stop_server,
)


def _record_run(run_dir: Path) -> None:
    import random

    from tokenizers import Tokenizer

    import rlreplay
    from rlreplay.format import manifest

    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))

    def ids(text: str) -> list[int]:
        return tok.encode(text).ids

    class LLMServerClient:
        @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            await asyncio.sleep(0.001)
            text = (
                f"<tool_call>calc {len(prompt_ids)} * 2</tool_call>"
                if sampling_params["turn"] == 0
                else (f"The answer is {len(prompt_ids) % 97}.")
            )
            return {"token_ids": ids(text), "stop_reason": "stop"}

    class HermesToolParser:
        @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
        async def extract_tool_calls(self, responses_ids: list[int]) -> list[dict]:
            return [{"name": "calc", "arguments": "{}"}]

    class Gsm8kTool:
        @rlreplay.trace_op(name="Gsm8kTool.execute", kind="tool")
        async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
            if parameters.get("fail"):
                raise ValueError("calculator overflow")
            return ({"text": "42"}, 0.0, {})

    class ToolAgentLoop:
        @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
        async def run(self, sample: int, rollout: int, rng: random.Random) -> dict:
            prompt = ids(f"Question {sample}: Natalia sold clips to {sample * 7} friends. How many? " * 3)
            client, parser, tool = LLMServerClient(), HermesToolParser(), Gsm8kTool()
            first = await client.generate("r0", prompt_ids=prompt, sampling_params={"turn": 0})
            await parser.extract_tool_calls(first["token_ids"])
            with contextlib.suppress(ValueError):
                await tool.execute("t0", {"expr": "2*2", "fail": rollout == 1 and sample % 2 == 0})
            observation = ids("<tool_response>42</tool_response>")
            second = await client.generate(
                "r1", prompt_ids=prompt + first["token_ids"] + observation, sampling_params={"turn": 1}
            )
            if rollout == 2 and sample == 1:
                raise RuntimeError("agent loop crashed")
            response = first["token_ids"] + observation + second["token_ids"]
            mask = [1] * len(first["token_ids"]) + [0] * len(observation) + [1] * len(second["token_ids"])
            return {
                "prompt_ids": prompt,
                "response_ids": response,
                "response_mask": mask,
                "reward_score": round(rng.random(), 3),
                "num_turns": 3,
            }

    rlreplay.init(run_dir, experiment=EXPERIMENT, worker="w0")
    rng = random.Random(7)

    async def one(step: int, sample: int, n: int, validate: bool) -> None:
        try:
            async with rlreplay.trajectory(
                step=step, sample_index=sample, rollout_n=n, validate=validate, name="agent_loop"
            ):
                await ToolAgentLoop().run(sample, n, rng)
        except RuntimeError:
            pass

    async def go() -> None:
        for step in TRAIN_STEPS:
            await asyncio.gather(
                *(one(step, s, n, False) for s in range(TRAIN_SAMPLES) for n in range(ROLLOUTS))
            )
            if step in VAL_STEPS:
                await asyncio.gather(
                    *(one(step, 100 + s, n, True) for s in range(VAL_SAMPLES) for n in range(VAL_ROLLOUTS))
                )

    asyncio.run(go())
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(qwen_tokenizer_dir()))


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small verl-shaped run recorded with the real recorder (do not modify; copy it)."""
    run_dir = tmp_path_factory.mktemp("runs") / "fixture-run"
    _record_run(run_dir)
    return run_dir


@pytest.fixture
def run_copy(recorded_run: Path, tmp_path: Path) -> Path:
    """A private copy of the recorded run (uploads write their ledger into the run directory)."""
    dest = tmp_path / recorded_run.name
    shutil.copytree(recorded_run, dest)
    return dest


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``mlflow server`` on 127.0.0.1 (sqlite backend); yields its URI."""
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    cmd, env = mlflow_server_command(home, port)
    uri = f"http://127.0.0.1:{port}"
    proc = start_server(cmd, home=home, env=env, health=f"{uri}/health", timeout=120)
    yield uri
    stop_server(proc, 15)
