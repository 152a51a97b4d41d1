"""Turn segmentation on trajectories recorded by the real recorder into real files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import rlreplay
from rlreplay.text.conversation import Turn, turns

PROMPT = [101, 102, 103, 104]
# (role, ids) of the response, in order: the agent span's mask is built from these
SCRIPT = [
    ("assistant", [11, 12, 13]),
    ("tool", [90, 91]),
    ("assistant", [21, 22]),
    ("tool", [92, 93, 94]),
    ("assistant", [31]),
]
CALLS = [
    [{"name": "calc", "arguments": json.dumps({"answer": "7"})}],
    [{"name": "calc", "arguments": json.dumps({"answer": "8"})}, {"name": "lookup", "arguments": "{bad"}],
    [],
]


class FunctionCall:
    """Shaped like verl's pydantic FunctionCall (model_dump → name, arguments, tool_call_id)."""

    def __init__(self, name: str, arguments: str) -> None:
        self.name, self.arguments = name, arguments

    def model_dump(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "tool_call_id": None}


class Server:
    @rlreplay.trace_op(kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(0)
        turn = sum(1 for role, _ in SCRIPT[: self.cursor] if role == "assistant")
        ids = [ids for role, ids in SCRIPT if role == "assistant"][turn]
        return {"token_ids": ids, "log_probs": [-0.5] * len(ids)}


class Parser:
    @rlreplay.trace_op(kind="parser")
    async def extract_tool_calls(self, responses_ids: list[int]) -> tuple:
        return "content", [FunctionCall(**c) for c in CALLS[self.turn]]


class Tool:
    @rlreplay.trace_op(kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
        return ({"text": "ok"}, 0.0, {})


class Loop:
    def __init__(self, with_agent_output: bool) -> None:
        self.with_agent_output = with_agent_output

    async def body(self) -> dict:
        server, parser, tool = Server(), Parser(), Tool()
        context = list(PROMPT)
        response: list[int] = []
        mask: list[int] = []
        parser.turn = 0
        for i, (role, ids) in enumerate(SCRIPT):
            if role == "assistant":
                server.cursor = i
                out = await server.generate("req", prompt_ids=context, sampling_params={})
                parser.turn = sum(1 for r, _ in SCRIPT[:i] if r == "assistant")
                await parser.extract_tool_calls(out["token_ids"])
                for call in CALLS[parser.turn]:
                    await tool.execute("inst", {"raw": call["arguments"]}, agent_data={"k": 1})
            context = context + ids
            response += ids
            mask += [1 if role == "assistant" else 0] * len(ids)
        return {
            "prompt_ids": PROMPT,
            "response_ids": response,
            "response_mask": mask,
            "reward_score": 1.0,
            "num_turns": 6,
        }

    @rlreplay.trace_op(kind="agent", name="ToolAgentLoop.run")
    async def run(self, sampling_params: dict, **kwargs) -> dict:
        out = await self.body()
        return out if self.with_agent_output else {"reward_score": out["reward_score"]}


def _record(run_dir: Path) -> None:
    rlreplay.init(run_dir, experiment="conv", worker="w0")

    async def go() -> None:
        for n, with_output in enumerate([True, False]):
            async with rlreplay.trajectory(step=0, sample_index=0, rollout_n=n, name="agent_loop"):
                await Loop(with_output).run({"temperature": 1.0}, raw_prompt=[])

    asyncio.run(go())
    rlreplay.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[int, rlreplay.Trajectory]:
    run_dir = tmp_path_factory.mktemp("conv") / "run"
    _record(run_dir)
    run = rlreplay.open_run(run_dir)
    rows = run.trajectories().to_pylist()
    trajs = run.load([r["id"] for r in rows])
    return {t.rollout_n: t for t in trajs}


def _expected_roles_ids() -> list[tuple[str, list[int]]]:
    return [("prompt", PROMPT), *SCRIPT]


def test_mask_runs_give_roles_ids_and_offsets(recorded: dict) -> None:
    result = turns(recorded[0])
    assert [(t.role, t.token_ids) for t in result] == _expected_roles_ids()
    starts = [t.start for t in result]
    lengths = [len(ids) for _, ids in SCRIPT]
    assert starts == [0] + [sum(lengths[:i]) for i in range(len(SCRIPT))]
    assert all(t.text is None for t in result)


def test_assistant_turns_carry_llm_span_ids_and_parsed_tool_calls(recorded: dict) -> None:
    traj = recorded[0]
    llm_ids = [s.span_id for s in sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)]
    result = turns(traj)
    assistant = [t for t in result if t.role == "assistant"]
    assert [t.span_id for t in assistant] == llm_ids
    assert assistant[0].tool_calls == [{"name": "calc", "arguments": {"answer": "7"}}]
    # valid JSON arguments are parsed; invalid ones stay as the model wrote them
    assert assistant[1].tool_calls == [
        {"name": "calc", "arguments": {"answer": "8"}},
        {"name": "lookup", "arguments": "{bad"},
    ]
    assert assistant[2].tool_calls == []
    assert all(t.tool_calls == [] and t.span_id is None for t in result if t.role != "assistant")


def test_fallback_to_llm_spans_without_a_mask(recorded: dict) -> None:
    traj = recorded[1]
    agent = traj.by_kind("agent")[0]
    assert "response_mask" not in agent.output
    result = turns(traj)
    # each model call is an assistant turn; what the next call's prompt adds is a tool turn
    assert [(t.role, t.token_ids) for t in result] == _expected_roles_ids()
    assert next(t.tool_calls for t in result if t.role == "assistant")[0]["arguments"] == {"answer": "7"}


class CountingDecoder:
    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def decode_many(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        self.calls.append(ids)
        return [" ".join(map(str, x)) for x in ids]


def test_decoder_fills_text_in_one_batched_call(recorded: dict) -> None:
    decoder = CountingDecoder()
    result = turns(recorded[0], decoder=decoder)
    assert len(decoder.calls) == 1
    assert [t.text for t in result] == [" ".join(map(str, t.token_ids)) for t in result]


def test_merged_assistant_run_splits_by_llm_outputs(tmp_path: Path) -> None:
    """Two model calls with no tool turn between them: one mask run, two assistant turns."""

    class Gen:
        @rlreplay.trace_op(kind="llm")
        def generate(self, prompt_ids: list[int], out: list[int]) -> dict:
            return {"token_ids": out}

    @rlreplay.trace_op(kind="agent")
    def run() -> dict:
        gen = Gen()
        gen.generate([1], [5, 6])
        gen.generate([1, 5, 6], [7])
        return {"prompt_ids": [1], "response_ids": [5, 6, 7, 8], "response_mask": [1, 1, 1, 0]}

    rlreplay.init(tmp_path / "run", worker="w0")
    with rlreplay.trajectory(step=1, sample_index=0, rollout_n=0):
        run()
    rlreplay.close()
    run_ = rlreplay.open_run(tmp_path / "run")
    traj = run_.load(run_.trajectories()["id"].to_pylist())[0]
    result = turns(traj)
    assert [(t.role, t.token_ids, t.start) for t in result] == [
        ("prompt", [1], 0),
        ("assistant", [5, 6], 0),
        ("assistant", [7], 2),
        ("tool", [8], 3),
    ]
    assert isinstance(result[0], Turn) and result[1].span_id != result[2].span_id


def test_trajectory_without_model_calls_is_empty(tmp_path: Path) -> None:
    rlreplay.init(tmp_path / "run", worker="w0")

    @rlreplay.trace_op
    def step() -> int:
        return 1

    with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
        step()
    rlreplay.close()
    run = rlreplay.open_run(tmp_path / "run")
    traj = run.load(run.trajectories()["id"].to_pylist())[0]
    assert turns(traj) == []
