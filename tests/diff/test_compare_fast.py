"""``compare``'s step scan (spans compared as stored, column by column) gives what the span-by-span
comparison gives, on two recorded runs with long token arrays (stored once, shared between spans)
and planted differences of every kind.

Which pairs differ is known here from what was planted, never from ``rlreplay.compare``.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rlreplay
from rlreplay.adapters.generic import GenericAdapter
from rlreplay.compare import compare_runs
from rlreplay.read.samestep import equal_as_stored
from rlreplay.read.scan import step_spans

STEPS, SAMPLES, ROLLOUTS = 2, 6, 4
#: what B changes, by keys: every kind of difference the comparison must see
PLANTED = {
    (0, 0, 1): "response id",
    (0, 1, 2): "log-prob",
    (0, 2, 0): "tool output",
    (0, 3, 3): "extra turn",
    (1, 0, 0): "tool error",
    (1, 1, 1): "sampling param",
    (1, 2, 2): "first prompt id",
    (1, 4, 0): "NaN log-prob",  # in both runs: a NaN read back is not equal to itself
}
ONLY_A, ONLY_B = (1, 5, 3), (2, 0, 0)
PLANTING = False  # recording run B


def _f32(values: Any) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


@rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
async def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
    return dict(sampling_params["reply"])


@rlreplay.trace_op(name="CalcTool.execute", kind="tool")
async def execute(instance_id: str, parameters: dict) -> dict:
    if parameters.get("fail"):
        raise RuntimeError("sandbox died")
    return {"text": parameters["text"]}


@rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
async def agent(keys: list[int]) -> dict:
    rng = random.Random(str(keys))
    what = PLANTED.get(tuple(keys)) if PLANTING else None
    prompt = [rng.randrange(10, 150_000) for _ in range(rng.randrange(100, 300))]
    if what == "first prompt id":
        prompt[0] += 1
    response: list[int] = []
    turns = rng.randrange(2, 6) + (1 if what == "extra turn" else 0)
    for turn in range(turns):
        ids = [rng.randrange(10, 150_000) for _ in range(rng.randrange(70, 200))]
        logprobs = _f32([-rng.random() * 3 for _ in ids])
        last = turn == turns - 1
        if last and what == "response id":
            ids[-7] += 1
        if last and what == "log-prob":
            logprobs[3] = _f32([logprobs[3] / 2])[0]
        if what == "NaN log-prob":
            logprobs[0] = float("nan")
        params = {"temperature": 0.7 if what == "sampling param" and last else 1.0, "max_tokens": 512}
        reply = {"token_ids": ids, "log_probs": logprobs, "stop_reason": "stop"}
        out = await generate(
            uuid.uuid4().hex, prompt_ids=prompt + response, sampling_params={**params, "reply": reply}
        )
        response += out["token_ids"]
        if last:
            break
        text = f"result {turn} {rng.random():.6f}"
        parameters: dict[str, Any] = {"text": text + ("!" if what == "tool output" and turn == 0 else "")}
        if what == "tool error" and turn == 0:
            parameters["fail"] = True
        try:
            result = (await execute(uuid.uuid4().hex, parameters))["text"]
        except RuntimeError:
            result = "error"
        response += [3, *(ord(c) for c in result), 4]
    return {"prompt_ids": prompt, "response_ids": response, "reward_score": float(len(response) % 3)}


def record(run_dir: Path, plant: bool) -> None:
    everything = [(s, i, n) for s in range(STEPS) for i in range(SAMPLES) for n in range(ROLLOUTS)]
    chosen = [k for k in everything if k != ONLY_A] + [ONLY_B] if plant else everything

    async def go() -> None:
        for keys in chosen:
            async with rlreplay.trajectory(step=keys[0], sample_index=keys[1], rollout_n=keys[2]):
                await agent(list(keys))

    global PLANTING
    PLANTING = plant
    rlreplay.init(run_dir, worker="w0")
    try:
        asyncio.run(go())
    finally:
        rlreplay.close()
        PLANTING = False


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    base = tmp_path_factory.mktemp("compare-fast")
    record(base / "a", plant=False)
    record(base / "b", plant=True)
    return rlreplay.open_run(base / "a"), rlreplay.open_run(base / "b")


def test_the_step_scan_gives_what_the_span_by_span_comparison_gives(runs) -> None:
    run_a, run_b = runs
    fast = [p.to_dict() for p in compare_runs(run_a, run_b, fast=True)]
    slow = [p.to_dict() for p in compare_runs(run_a, run_b, fast=False)]
    assert fast == slow
    by_keys = {(p["step"], p["sample_index"], p["rollout_n"]): p for p in fast}
    assert by_keys[ONLY_A]["b"] is None and by_keys[ONLY_B]["a"] is None
    changed = {k for k, p in by_keys.items() if p["a"] and p["b"] and not p["same"]}
    assert changed == set(PLANTED)
    assert all(by_keys[k]["first_difference"] for k in PLANTED)


def test_the_step_scan_finds_every_unchanged_pair_equal_as_stored(runs) -> None:
    """The scan itself decides the unchanged pairs (no trajectory built for them): its job."""
    run_a, run_b = runs
    rows_a = {
        (r["step"], r["sample_index"], r["rollout_n"]): r["id"] for r in run_a.trajectories().to_pylist()
    }
    rows_b = {
        (r["step"], r["sample_index"], r["rollout_n"]): r["id"] for r in run_b.trajectories().to_pylist()
    }
    for step in range(STEPS):
        keys = sorted(k for k in rows_a.keys() & rows_b.keys() if k[0] == step)
        spans_a = step_spans(run_a, step, [rows_a[k] for k in keys])
        spans_b = step_spans(run_b, step, [rows_b[k] for k in keys])
        equal = equal_as_stored(spans_a, spans_b, GenericAdapter().volatile_keys())
        assert {k for k, e in zip(keys, equal) if e} == {k for k in keys if k not in PLANTED}
