"""The recorder at unit level: spans of every call shape, payload encoding, snapshots, fork, SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import enum
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pydantic
import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.model import decoded_rows
from rlreplay.recorder.api import get_recorder
from rlreplay.shards.layout import list_files


@pytest.fixture
def run_dir(tmp_path: Path):
    path = tmp_path / "run"
    rlreplay.init(path, experiment="unit", worker="w0")
    yield path
    rlreplay.close()


def spans_of(run_dir: Path) -> list[dict[str, Any]]:
    """Every recorded span as a dict, inputs/output/attributes decoded, ordered by start."""
    rows = decoded_rows(rlreplay.open_run(run_dir).spans())
    for r in rows:
        r["short"] = r["name"].rsplit(".", 1)[-1]  # a local function's name without its qualname
    return sorted(rows, key=lambda r: (r["start_ns"], r["span_id"]))


def by_name(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in rows if name in (r["name"], r["short"])]


# ---- call shapes ---------------------------------------------------------------------------------


@rlreplay.trace_op(kind="tool")
def add(a: int, b: int = 2, **kwargs: Any) -> int:
    return a + b


@rlreplay.trace_op(kind="llm", name="gen")
async def agen(request_id: str, *, prompt_ids: list[int]) -> dict:
    await asyncio.sleep(0)
    return {"token_ids": [i + 1 for i in prompt_ids]}


class Tool:
    @rlreplay.trace_op(kind="tool")
    def execute(self, instance_id: str, parameters: dict) -> tuple:
        return ("done", 0.5, {"n": len(parameters)})

    @rlreplay.trace_op(kind="agent")
    async def run(self, prompt_ids: list[int]) -> dict:
        out = await agen("r1", prompt_ids=prompt_ids)
        self.execute("i1", {"q": 1})
        return {"prompt_ids": prompt_ids, "response_ids": out["token_ids"], "reward_score": 0.75}


@rlreplay.trace_op
def fail(x: int) -> None:
    raise ValueError(f"boom {x}")


def test_sync_async_method_spans_and_attributes(run_dir: Path) -> None:
    before = time.time_ns()

    async def go() -> dict:
        async with rlreplay.trajectory(
            step=3, sample_index=7, rollout_n=1, validate=True, experiment="e1", name="agent_loop", tag="x"
        ):
            assert add(1, b=5, extra=9) == 6
            return await Tool().run([10, 11, 12])

    result = asyncio.run(go())
    assert result["response_ids"] == [11, 12, 13]
    rlreplay.flush()
    after = time.time_ns()
    rows = spans_of(run_dir)
    assert len(rows) == 5
    (root,) = [r for r in rows if r["parent_id"] is None]
    assert (root["name"], root["kind"], root["attributes"], root["inputs"]) == (
        "agent_loop",
        "trajectory",
        {"tag": "x"},
        None,
    )
    for r in rows:
        attrs = [r[k] for k in ("step", "sample_index", "rollout_n", "validate", "experiment", "worker")]
        assert attrs == [3, 7, 1, True, "e1", "w0"]
        assert r["trajectory_id"] == root["trajectory_id"] and len(r["trajectory_id"]) == 32
        assert before <= r["start_ns"] <= r["end_ns"] <= after
        assert r["status"] == "ok"
    (a,) = by_name(rows, "add")
    assert a["parent_id"] == root["span_id"] and a["kind"] == "tool"
    assert a["inputs"] == {"a": 1, "b": 5, "kwargs": {"extra": 9}} and a["output"] == 6
    (run,) = by_name(rows, "Tool.run")
    assert run["parent_id"] == root["span_id"] and run["kind"] == "agent"
    assert run["inputs"] == {"prompt_ids": [10, 11, 12]}  # self is not recorded
    assert run["reward"] == 0.75 and run["num_tokens"] == 9  # 3 in + 3 + 3 out
    (gen,) = by_name(rows, "gen")
    assert gen["parent_id"] == run["span_id"] and gen["kind"] == "llm"
    assert gen["inputs"] == {"request_id": "r1", "prompt_ids": [10, 11, 12]}
    assert gen["output"] == {"token_ids": [11, 12, 13]}
    (ex,) = by_name(rows, "Tool.execute")
    assert ex["parent_id"] == run["span_id"]
    assert ex["inputs"] == {"instance_id": "i1", "parameters": {"q": 1}}
    assert ex["output"] == ["done", 0.5, {"n": 1}]
    assert run["start_ns"] <= gen["start_ns"] <= gen["end_ns"] <= ex["start_ns"] <= run["end_ns"]


def test_exception_spans_and_error_root(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="boom 4") as info, rlreplay.trajectory(step=0, sample_index=1):
        fail(4)
    rlreplay.flush()
    rows = spans_of(run_dir)
    (op,) = by_name(rows, "fail")
    assert op["status"] == "error" and op["error"] == "ValueError: boom 4"
    assert op["output"]["__type__"] == "exception" and op["output"]["type"] == "ValueError"
    assert op["output"]["message"] == "boom 4" and "raise ValueError" in op["output"]["traceback"]
    (root,) = [r for r in rows if r["kind"] == "trajectory"]
    assert root["status"] == "error" and root["error"] == "ValueError: boom 4"
    assert info.value.args == ("boom 4",)


def test_nesting_and_calls_outside_a_trajectory(run_dir: Path) -> None:
    @rlreplay.trace_op
    def leaf(n: int) -> int:
        return n

    @rlreplay.trace_op
    def middle(n: int) -> int:
        return leaf(n) + leaf(n + 1)

    @rlreplay.trace_op
    def top() -> int:
        return middle(1)

    with rlreplay.trajectory(step=1):
        assert top() == 3
    assert middle(5) == 11  # outside any trajectory: its own implicit trajectory
    rlreplay.flush()
    rows = spans_of(run_dir)
    ids = {r["span_id"]: r for r in rows}
    inside = [r for r in rows if r["step"] == 1]
    assert sorted(r["short"] for r in inside) == ["leaf", "leaf", "middle", "top", "trajectory"]
    for r in inside:
        if r["short"] == "leaf":
            assert ids[r["parent_id"]]["short"] == "middle"
        elif r["short"] == "middle":
            assert ids[r["parent_id"]]["short"] == "top"
    outside = [r for r in rows if r["step"] is None]
    assert len({r["trajectory_id"] for r in outside}) == 1
    assert {r["trajectory_id"] for r in outside}.isdisjoint({r["trajectory_id"] for r in inside})
    (mid,) = by_name(outside, "middle")
    assert mid["parent_id"] is None and mid["output"] == 11
    assert all(ids[r["parent_id"]]["short"] == "middle" for r in outside if r["short"] == "leaf")


def test_disabled_and_trace_false_record_nothing(run_dir: Path) -> None:
    with rlreplay.disabled():
        assert add(1) == 3
        with rlreplay.trajectory(step=0, sample_index=0):
            assert add(2) == 4
    with rlreplay.trajectory(step=0, sample_index=1, trace=False):
        assert add(3) == 5
        with rlreplay.trajectory(step=0, sample_index=2):  # nested inside trace=False: still off
            assert add(4) == 6

    async def task_off() -> None:
        with rlreplay.disabled():
            await asyncio.sleep(0.01)
            add(5)

    async def task_on() -> None:
        async with rlreplay.trajectory(step=0, sample_index=3):
            await asyncio.sleep(0.01)
            add(6)

    async def both() -> None:
        await asyncio.gather(task_off(), task_on())

    asyncio.run(both())
    assert add(7) == 9  # recording resumes after the blocks
    rlreplay.flush()
    rows = spans_of(run_dir)
    recorded = sorted(r["inputs"]["a"] for r in rows if r["name"] == "add")
    assert recorded == [6, 7]
    assert [r["sample_index"] for r in rows if r["kind"] == "trajectory"] == [3]


def test_thousand_concurrent_trajectories_in_one_loop_never_mix(run_dir: Path) -> None:
    @rlreplay.trace_op(kind="llm")
    async def step_call(key: int, turn: int) -> int:
        await asyncio.sleep(0.001 * ((key * 7 + turn) % 5))
        return key * 100 + turn

    async def one(key: int) -> None:
        async with rlreplay.trajectory(step=0, sample_index=key, rollout_n=key % 4):
            for turn in range(3):
                assert await step_call(key, turn) == key * 100 + turn

    async def go() -> None:
        await asyncio.gather(*(one(k) for k in range(1000)))

    asyncio.run(go())
    rlreplay.flush()
    table = rlreplay.open_run(run_dir).spans(
        columns=[
            "trajectory_id",
            "span_id",
            "parent_id",
            "sample_index",
            "rollout_n",
            "kind",
            "inputs",
            "output",
        ]
    )
    rows = table.to_pylist()
    assert len(rows) == 4000
    roots = {r["trajectory_id"]: r for r in rows if r["kind"] == "trajectory"}
    assert len(roots) == 1000 and len({r["sample_index"] for r in roots.values()}) == 1000
    turns: dict[int, list[int]] = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == "llm":
            root = roots[r["trajectory_id"]]
            inputs = orjson.loads(r["inputs"])
            assert r["parent_id"] == root["span_id"]
            assert inputs["key"] == root["sample_index"] == r["sample_index"]
            assert r["rollout_n"] == inputs["key"] % 4
            assert orjson.loads(r["output"]) == inputs["key"] * 100 + inputs["turn"]
            turns[inputs["key"]].append(inputs["turn"])
    assert all(sorted(v) == [0, 1, 2] for v in turns.values()) and len(turns) == 1000


# ---- payloads ------------------------------------------------------------------------------------


class Color(enum.IntEnum):
    RED = 1


class Label(str):
    pass


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class Message(pydantic.BaseModel):
    role: str
    token_ids: list[int]
    raw: bytes = b""


@dataclasses.dataclass
class Step:
    prompt_ids: list[int]
    score: float
    tags: set[str]


Point = collections.namedtuple("Point", "x y")


def test_payload_edge_cases_through_the_recorder(run_dir: Path) -> None:
    import torch

    cyclic: list[Any] = [1, 2]
    cyclic.append(cyclic)
    cyc_dict: dict[str, Any] = {"name": "d"}
    cyc_dict["self"] = cyc_dict
    values = {
        "bytes": b"\x00\xffab",
        "nan": float("nan"),
        "inf_in_list": [1.5, float("inf"), -2.0],
        "nan_in_ids": [1, float("nan"), 3],
        "set": {3, 1, 2},
        "non_str_keys": {1: "a", (2, 3): "b", None: "c"},
        "cycle_list": cyclic,
        "cycle_dict": cyc_dict,
        "np_ids": np.arange(5, dtype=np.int64),
        "np_float": np.array([0.5, np.nan]),
        "np_scalar": np.int32(7),
        "tensor": torch.tensor([[1, 2], [3, 4]]),
        "tensor_bf16": torch.tensor([0.5, 1.5], dtype=torch.bfloat16),
        "model": Message(role="assistant", token_ids=[5, 6], raw=b"hi"),
        "dataclass": Step(prompt_ids=[9, 8], score=1.0, tags={"b", "a"}),
        "broken": BrokenRepr(),
        "int_enum": Color.RED,
        "str_sub": Label("lbl"),
        "big_int": 2**80,
        "big_in_list": [1, 2**70],
        "namedtuple": Point(1, 2),
        "defaultdict": collections.defaultdict(list, k=[1]),
        "obj": object(),
    }

    @rlreplay.trace_op
    def echo(**kw: Any) -> dict:
        return kw

    assert echo(**values) is not None
    rlreplay.flush()
    (span,) = spans_of(run_dir)
    out = span["output"]
    assert span["inputs"]["kw"].keys() == values.keys()
    assert out["bytes"] == {"__type__": "bytes", "base64": base64.b64encode(b"\x00\xffab").decode()}
    assert out["nan"] == {"__type__": "float", "value": "nan"}
    assert out["inf_in_list"] == [1.5, {"__type__": "float", "value": "inf"}, -2.0]
    assert out["nan_in_ids"] == [1, {"__type__": "float", "value": "nan"}, 3]
    assert out["set"] == {"__type__": "set", "items": [1, 2, 3]}
    assert out["non_str_keys"] == {"1": "a", "(2, 3)": "b", "None": "c"}
    cycle = {"__type__": "cycle", "class": "builtins.list"}
    assert out["cycle_list"] == [1, 2, [1, 2, cycle]]  # the outer list is the call-time snapshot copy
    assert out["cycle_dict"] == {"name": "d", "self": {"__type__": "cycle", "class": "builtins.dict"}}
    assert out["np_ids"] == [0, 1, 2, 3, 4]
    assert out["np_float"] == [0.5, {"__type__": "float", "value": "nan"}]
    assert out["np_scalar"] == 7
    assert out["tensor"] == [[1, 2], [3, 4]]
    assert out["tensor_bf16"] == [0.5, 1.5]
    assert out["model"] == {
        "role": "assistant",
        "token_ids": [5, 6],
        "raw": {"__type__": "bytes", "base64": base64.b64encode(b"hi").decode()},
    }
    assert out["dataclass"] == {
        "prompt_ids": [9, 8],
        "score": 1.0,
        "tags": {"__type__": "set", "items": ["a", "b"]},
    }
    assert out["broken"]["__type__"] == "repr" and out["broken"]["class"].endswith("BrokenRepr")
    assert "repr failed" in out["broken"]["repr"]
    assert out["int_enum"] == 1 and out["str_sub"] == "lbl"
    assert out["big_int"] == {"__type__": "int", "value": str(2**80)}
    assert out["big_in_list"] == [1, {"__type__": "int", "value": str(2**70)}]
    assert out["namedtuple"] == {"x": 1, "y": 2} and out["defaultdict"] == {"k": [1]}
    assert out["obj"]["__type__"] == "repr" and out["obj"]["repr"].startswith("<object object")
    assert rlreplay.stats()["encode_errors"] == 0


def test_field_size_cap_leaves_a_visible_marker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0", max_field_bytes=2000)

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids: list[str], note: str) -> list[str]:  # text: token arrays are never capped
        return [str(i) for i in range(5000)]

    with rlreplay.trajectory(step=0, sample_index=0):
        generate([str(i) for i in range(3000)], "small")
    rlreplay.close()
    (span,) = [r for r in spans_of(run_dir) if r["kind"] == "llm"]
    big = orjson.dumps([str(i) for i in range(3000)])
    assert span["inputs"]["note"] == "small"
    marker = span["inputs"]["prompt_ids"]
    assert marker["__type__"] == "truncated" and marker["bytes"] == len(big)
    assert big.decode().startswith(marker["preview"]) and 0 < len(marker["preview"]) < 2000
    assert span["output"]["__type__"] == "truncated"
    assert span["output"]["bytes"] == len(orjson.dumps([str(i) for i in range(5000)]))
    traj_id = span["trajectory_id"]
    assert main(["show", traj_id[:10], "--run", str(run_dir), "--no-text"]) == 0
    assert "truncated" in capsys.readouterr().out


def test_failing_reducers_and_encoders_never_reach_the_caller(run_dir: Path) -> None:
    class Evil:
        def model_dump(self) -> dict:
            raise RuntimeError("dump fails")

        def __repr__(self) -> str:
            raise RuntimeError("repr fails")

    def bad_reduce(x: Any) -> Any:
        raise KeyError("reducer bug")

    @rlreplay.trace_op(reduce_inputs=bad_reduce, reduce_output=bad_reduce, reward=bad_reduce)
    def work(x: Any) -> Any:
        return Evil()

    class BadStr(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str fails")

    @rlreplay.trace_op
    def raises_bad() -> None:
        raise BadStr()

    with rlreplay.trajectory(step=0):
        assert isinstance(work(Evil()), Evil)
        with pytest.raises(BadStr):
            raises_bad()
    rlreplay.flush()
    rows = spans_of(run_dir)
    (w,) = by_name(rows, "work")
    assert w["inputs"]["__type__"] == "error" and "reducer bug" in w["inputs"]["error"]
    assert w["output"]["__type__"] == "error" and w["reward"] is None
    (b,) = [r for r in rows if r["name"].endswith("raises_bad")]
    assert b["status"] == "error" and b["output"]["type"].endswith("BadStr")
    assert b["output"]["message"] == "<str() failed>"
    assert rlreplay.stats()["encode_errors"] == 0 and rlreplay.stats()["spans"] == 3


def test_payload_module_without_torch_and_never_raising() -> None:
    script = textwrap.dedent(
        """
        import sys
        from rlreplay.format import payload
        print(payload.encode({"ids": [1, 2], "b": b"x", "s": {1}}))
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    encoded, torch_loaded = out.splitlines()
    assert json.loads(encoded)["ids"] == [1, 2] and torch_loaded == "False"


# ---- snapshots -----------------------------------------------------------------------------------


def test_lists_mutated_after_the_call_are_recorded_as_at_call_time(run_dir: Path) -> None:
    @rlreplay.trace_op(kind="llm")
    async def generate(prompt_ids: list[int], *, extra: dict) -> list[int]:
        await asyncio.sleep(0)
        return [len(prompt_ids)]

    @rlreplay.trace_op
    def tool(history: list[int]) -> list[int]:
        return history

    async def agent() -> None:
        async with rlreplay.trajectory(step=0, sample_index=0):
            prompt = [1, 2, 3]
            extra = {"mask": [1]}
            for turn in range(50):  # the agent loop grows the same lists in place, like verl
                response = await generate(prompt, extra=extra)
                prompt += response
                extra["mask"].append(turn)
                returned = tool(prompt)
                returned.append(-1)  # the caller mutates what the op returned

    asyncio.run(agent())
    rlreplay.flush()
    rows = spans_of(run_dir)
    gens = by_name(rows, "generate")
    tools = [r for r in rows if r["name"].endswith(".tool")]
    assert len(gens) == len(tools) == 50
    prompt = [1, 2, 3]
    mask = [1]
    for turn, (g, t) in enumerate(zip(gens, tools)):
        assert g["inputs"] == {"prompt_ids": prompt, "extra": {"mask": mask}}
        assert g["output"] == [len(prompt)]
        prompt = [*prompt, len(prompt)]
        mask = [*mask, turn]
        assert t["inputs"] == {"history": prompt} and t["output"] == prompt
        prompt = [*prompt, -1]


class Metrics(pydantic.BaseModel):
    generate_s: float = 0.0
    score_s: float = 0.0


class LoopOutput(pydantic.BaseModel):
    """Shaped like verl's ``AgentLoopOutput``, which verl's post-processing changes in place."""

    response_ids: list[int]
    reward_score: float | None = None
    extra_fields: dict[str, Any] = {}
    metrics: Metrics = Metrics()


def test_a_model_the_caller_changes_after_the_call_is_recorded_as_returned(run_dir: Path) -> None:
    @rlreplay.trace_op(kind="agent")
    async def run_loop(n: int) -> LoopOutput:
        await asyncio.sleep(0)
        return LoopOutput(response_ids=list(range(n)), extra_fields={"turn_scores": [0.5]})

    async def postprocess(n: int) -> None:
        async with rlreplay.trajectory(step=0, sample_index=n):
            output = await run_loop(n)
            # what verl's _agent_loop_postprocess and _compute_score do to the returned object
            output.extra_fields["raw_prompt"] = [{"role": "user", "content": "hi"}]
            output.extra_fields["turn_scores"].append(1.0)
            output.reward_score = 1.0
            output.metrics.score_s = 2.5
            output.response_ids.append(-1)
            await asyncio.sleep(0.01)

    async def main_loop() -> None:
        await asyncio.gather(*(postprocess(n) for n in range(1, 9)))

    asyncio.run(main_loop())
    rlreplay.flush()
    spans = by_name(spans_of(run_dir), "run_loop")
    assert len(spans) == 8
    for span in spans:
        n = span["inputs"]["n"]
        expected = LoopOutput(response_ids=list(range(n)), extra_fields={"turn_scores": [0.5]})
        assert span["output"] == expected.model_dump()


# ---- durability: steps, flush, counters ------------------------------------------------------------


def test_step_boundary_seals_the_previous_step_and_flush_interval_writes(run_dir: Path) -> None:
    with rlreplay.trajectory(step=0, sample_index=0):
        add(1)
    time.sleep(0.8)  # no flush(): the writer writes ended trajectories on its own within its interval
    live = rlreplay.open_run(run_dir).spans(step=0)
    assert live.num_rows == 2
    sealed, partials = list_files(run_dir, step=0)
    assert sealed == [] and len(partials) == 1

    with rlreplay.trajectory(step=1, sample_index=0):
        add(2)
        rlreplay.flush()
        sealed, partials = list_files(run_dir, step=0)
        assert len(sealed) == 1 and partials == []  # step 0 sealed while step 1 still runs
        assert list_files(run_dir, step=1)[0] == []
    rlreplay.close()
    sealed, partials = list_files(run_dir)
    assert len(sealed) == 2 and partials == []
    (counters,) = [json.loads(p.read_text()) for p in (run_dir / "_workers").glob("*.json")]
    assert counters["spans"] == 4 and counters["pid"] == os.getpid() and counters["worker"] == "w0"
    assert counters["dropped"] == counters["lost"] == counters["spilled"] == 0


class _CountedWake(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_write_at_end_false_leaves_a_trajectory_to_the_writers_next_cycle(run_dir: Path) -> None:
    """An ended trajectory wakes the writer, unless its caller flushes whole batches itself (the verl
    recorder): then it is written at the writer's next cycle, within the flush interval."""
    rec = get_recorder()
    rec._wake = wakes = _CountedWake()  # the writer waits on it from its next cycle on
    time.sleep(0.3)
    with rlreplay.trajectory(step=0, sample_index=0):
        add(1)
    assert wakes.sets == 1
    with rlreplay.trajectory(step=0, sample_index=1, write_at_end=False):
        add(2)
    assert wakes.sets == 1
    time.sleep(0.8)
    assert rlreplay.open_run(run_dir).spans(step=0).num_rows == 4
    assert wakes.sets == 1


def test_trajectories_ending_close_together_are_written_together_within_the_write_interval(
    run_dir: Path,
) -> None:
    """Each ended trajectory is on disk within ``min_write_interval_s`` of the step's last batch,
    without a flush and long before the writer's next cycle; those that end meanwhile share a batch
    (one batch per trajectory costs the writer more than the trajectory's numbers)."""
    from rlreplay.shards.live import read_partial

    rec = get_recorder()
    rec.config.flush_interval_s = 60.0  # no cycle writes anything during the test
    time.sleep(0.5)  # the writer waits on the new interval from its next cycle on
    started = time.monotonic()
    for i in range(20):
        with rlreplay.trajectory(step=0, sample_index=i):
            add(i)
        time.sleep(0.005)
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 20
    while rlreplay.open_run(run_dir).spans(step=0).num_rows < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rlreplay.open_run(run_dir).spans(step=0).num_rows == 40
    (live,) = list_files(run_dir, step=0)[1]
    batches = read_partial(live).batches
    assert batches <= elapsed / rec.config.min_write_interval_s + 2, (batches, elapsed)


def test_a_queue_growing_past_wake_bytes_wakes_the_writer_before_its_cycle(run_dir: Path) -> None:
    from rlreplay.recorder.writer import WAKE_BYTES

    rec = get_recorder()
    rec._wake = wakes = _CountedWake()
    time.sleep(0.3)
    with rlreplay.trajectory(step=0, sample_index=0, write_at_end=False):
        add(1)  # a few hundred bytes queued: left to the next cycle
    assert wakes.sets == 0
    with rlreplay.trajectory(step=0, sample_index=1, write_at_end=False):
        add(1, ids=list(range(WAKE_BYTES // 8)))  # ints and their list: more than WAKE_BYTES
    assert wakes.sets == 1


def test_queue_accounting_does_not_leak(tmp_path: Path) -> None:
    """Opens, exceptions and flushes give back their queue bytes: a tiny queue never fills when drained."""
    rlreplay.init(tmp_path / "run", worker="w0", policy="drop", max_queue_mb=8 / 1024)
    for i in range(400):
        with rlreplay.trajectory(step=0, sample_index=i), pytest.raises(ValueError):
            fail(i)
        if i % 10 == 9:
            rlreplay.flush()
    assert rlreplay.stats()["dropped"] == 0
    rlreplay.close()
    assert rlreplay.open_run(tmp_path / "run").spans().num_rows == 800


def test_env_init_lazy_and_atexit_seals(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        """
        import rlreplay

        @rlreplay.trace_op
        def op(x):
            return x * 2

        for i in range(5):
            with rlreplay.trajectory(step=i % 2, sample_index=i):
                op(i)
        """
    )
    env = {**os.environ, "RLREPLAY_DIR": str(run_dir), "RLREPLAY_WORKER": "envw", "RLREPLAY_EXPERIMENT": "ex"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) == 2
    rows = spans_of(run_dir)
    assert (
        len(rows) == 10
        and {r["worker"] for r in rows} == {"envw"}
        and {r["experiment"] for r in rows} == {"ex"}
    )


# ---- processes: fork and SIGTERM --------------------------------------------------------------------


def _forked_child(tag: int) -> None:
    with rlreplay.trajectory(step=0, sample_index=100 + tag):
        add(100 + tag)
    # no flush/close: the multiprocessing exit hook must seal this process's files


def test_fork_child_records_into_its_own_files(run_dir: Path) -> None:
    with rlreplay.trajectory(step=0, sample_index=1):
        add(1)  # still queued in the parent when it forks
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_forked_child, args=(i,)) for i in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    with rlreplay.trajectory(step=0, sample_index=2):
        add(2)
    rlreplay.close()

    rows = spans_of(run_dir)
    adds = sorted(r["inputs"]["a"] for r in rows if r["name"] == "add")
    assert adds == [1, 2, 100, 101]  # the parent's queued span is not written twice
    trajectories = {r["trajectory_id"] for r in rows}
    assert len(trajectories) == 4
    sealed, partials = list_files(run_dir)
    assert partials == []
    pids = {p.name.split("-")[2] for p in sealed}
    assert pids == {str(os.getpid())} | {str(c.pid) for c in children}
    table = rlreplay.open_run(run_dir).spans(columns=["sample_index"])
    by_file = {}
    for path in sealed:
        by_file[path.name.split("-")[2]] = sorted(
            set(pq.read_table(path, columns=["sample_index"])["sample_index"].to_pylist())
        )
    assert by_file[str(os.getpid())] == [1, 2]
    assert sorted(by_file[str(c.pid)][0] for c in children) == [100, 101]
    assert table.num_rows == 8
    counters = sorted(p.name for p in (run_dir / "_workers").glob("*.json"))
    assert len(counters) == 3


def test_sigterm_while_the_calling_thread_holds_the_writers_lock(tmp_path: Path) -> None:
    """SIGTERM arriving while the main thread encodes queued spans itself (queue full): the handler
    waits until the thread lets go of the writer's lock, then seals and stops the process at once."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        import rlreplay
        from rlreplay import recorder
        from rlreplay.recorder import writer
        rlreplay.init(sys.argv[1], worker="w", max_queue_mb=0.001, policy="spill")
        rec = recorder.get_recorder()
        rec._wake.wait = lambda timeout=None: time.sleep(0.05) or False  # a slow writer: the queue fills
        ingest = writer.Recorder._ingest

        def ingest_then_term(self, event, spilled=False):
            if spilled and not getattr(self, "termed", False):
                self.termed = True
                os.kill(os.getpid(), signal.SIGTERM)  # handled while the lock is held
            return ingest(self, event, spilled)

        writer.Recorder._ingest = ingest_then_term

        @rlreplay.trace_op(kind="llm")
        def generate(prompt_ids):
            return list(reversed(prompt_ids))

        for i in range(1000):
            print("call", i, flush=True)
            with rlreplay.trajectory(step=0, sample_index=i):
                generate(list(range(i, i + 300)))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        proc.kill()
    assert proc.stdout is not None
    calls = [line for line in proc.stdout.read().splitlines() if line.startswith("call")]
    assert 1 <= len(calls) < 1000
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) >= 1
    gens = [r for r in spans_of(run_dir) if r["kind"] == "llm"]
    assert len(gens) == len(calls)  # every call made before the signal, none lost
    assert all(r["output"] == list(reversed(r["inputs"]["prompt_ids"])) for r in gens)


def test_sigterm_seals_shards(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        """
        import sys, time
        import rlreplay
        rlreplay.init(sys.argv[1], worker="term")

        @rlreplay.trace_op(kind="llm")
        def generate(prompt_ids):
            return list(reversed(prompt_ids))

        for step in range(2):
            for i in range(20):
                with rlreplay.trajectory(step=step, sample_index=i):
                    generate(list(range(i, i + 50)))
        with rlreplay.trajectory(step=2, sample_index=0):
            generate([1])
            print("ready", flush=True)
            time.sleep(60)  # killed inside an open trajectory
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) == 3
    rows = spans_of(run_dir)
    gens = [r for r in rows if r["kind"] == "llm"]
    assert len(gens) == 41
    assert all(r["output"] == list(reversed(r["inputs"]["prompt_ids"])) for r in gens)
    assert len([r for r in rows if r["kind"] == "trajectory"]) == 40  # the open one has no root yet
