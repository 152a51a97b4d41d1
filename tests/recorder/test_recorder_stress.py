"""Many processes, each with hundreds of concurrent asyncio trajectories: every span lands under the right
parent with the right attributes; a SIGKILLed process loses only what ended within the last flush interval."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import orjson

import rlreplay

PROCESSES = 4
CONCURRENT = 256  # trajectories in flight at once in each process
STEPS = 2
FLUSH_INTERVAL_S = 0.2  # RecorderConfig.flush_interval_s
MARGIN_S = 0.8


# ---- the workload, shared by the recording processes and the checks --------------------------------


def ids(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_000) for _ in range(n)]


def shape(key: str, sample: int, rollout: int) -> tuple[int, list[int]]:
    """Turns and initial prompt of one trajectory."""
    return 1 + (sample + rollout) % 3, ids(f"{key}/prompt", 20 + sample % 30)


def tool_fails(sample: int, turn: int) -> bool:
    return (sample + turn) % 5 == 0


def expected_spans(key: str, sample: int, rollout: int) -> list[dict[str, Any]]:
    """The spans one trajectory must produce, in start order (root first)."""
    turns, prompt = shape(key, sample, rollout)
    context = list(prompt)
    response: list[int] = []
    out: list[dict[str, Any]] = [
        {
            "name": "agent_loop",
            "kind": "trajectory",
            "parent": None,
            "inputs": None,
            "output": None,
            "status": "ok",
        }
    ]
    children = []
    for turn in range(turns):
        tokens = ids(f"{key}/{turn}", 10 + turn)
        children.append(
            {
                "name": "Agent.generate",
                "kind": "llm",
                "parent": "Agent.run",
                "inputs": {
                    "request_id": f"{key}/{turn}",
                    "prompt_ids": list(context),
                    "sampling_params": {"temperature": 1.0, "turn": turn},
                },
                "output": {"token_ids": tokens},
                "status": "ok",
            }
        )
        context += tokens
        response += tokens
        children.append(
            {
                "name": "parse",
                "kind": "parser",
                "parent": "Agent.run",
                "inputs": {"text": f"{key}/{turn}"},
                "output": [{"name": "calc", "arguments": {"turn": turn}}],
                "status": "ok",
            }
        )
        fails = tool_fails(sample, turn)
        children.append(
            {
                "name": "Agent.execute",
                "kind": "tool",
                "parent": "Agent.run",
                "inputs": {"instance_id": key, "parameters": {"turn": turn}, "kwargs": {}},
                "output": None if fails else [f"result {key}/{turn}", 0.5, {}],
                "status": "error" if fails else "ok",
            }
        )
    agent = {
        "name": "Agent.run",
        "kind": "agent",
        "parent": "agent_loop",
        "inputs": {"key": key, "prompt_ids": prompt, "turns": turns},
        "output": {"prompt_ids": prompt, "response_ids": response, "reward_score": float(sample % 2)},
        "status": "ok",
    }
    return [out[0], agent, *children]


@rlreplay.trace_op(kind="parser")
def parse(text: str) -> list[dict]:
    return [{"name": "calc", "arguments": {"turn": int(text.rsplit("/", 1)[1])}}]


class Agent:
    def __init__(self, sample: int) -> None:
        self.sample = sample

    @rlreplay.trace_op(kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(random.random() * 0.004)
        turn = int(request_id.rsplit("/", 1)[1])
        return {"token_ids": ids(request_id, 10 + turn)}

    @rlreplay.trace_op(kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple:
        await asyncio.sleep(random.random() * 0.002)
        turn = parameters["turn"]
        if tool_fails(self.sample, turn):
            raise RuntimeError(f"tool failed {instance_id}/{turn}")
        return (f"result {instance_id}/{turn}", 0.5, {})

    @rlreplay.trace_op(kind="agent")
    async def run(self, key: str, prompt_ids: list[int], turns: int) -> dict:
        context = list(prompt_ids)
        response: list[int] = []
        for turn in range(turns):
            out = await self.generate(
                f"{key}/{turn}", prompt_ids=context, sampling_params={"temperature": 1.0, "turn": turn}
            )
            context += out["token_ids"]  # in place, as verl's agent loop does
            response += out["token_ids"]
            parse(f"{key}/{turn}")
            with contextlib.suppress(RuntimeError):
                await self.execute(key, {"turn": turn})
            if _pace:
                await asyncio.sleep(random.random() * _pace)
        return {"prompt_ids": prompt_ids, "response_ids": response, "reward_score": float(self.sample % 2)}


def traj_key(proc: int, step: int, sample: int, rollout: int) -> str:
    return f"p{proc}-s{step}-i{sample}-r{rollout}"


async def one_trajectory(proc: int, step: int, sample: int, rollout: int, ack_fd: int | None) -> None:
    key = traj_key(proc, step, sample, rollout)
    turns, prompt = shape(key, sample, rollout)
    async with rlreplay.trajectory(
        step=step,
        sample_index=sample,
        rollout_n=rollout,
        validate=sample % 7 == 0,
        name="agent_loop",
        key=key,
    ):
        # "run" is recorded as a method of Agent; the key in its inputs ties it to this trajectory
        await Agent(sample).run(key, prompt, turns)
    if ack_fd is not None:  # acknowledged: the trajectory's end returned to the caller
        os.write(ack_fd, f"{key} {time.monotonic_ns()}\n".encode())


_pace = 0.0  # extra seconds per turn (at most), to stretch trajectories over time


def worker_main(
    proc: int, run_dir: str, steps: int, concurrent: int, ack_path: str | None = None, pace: float = 0.0
) -> None:
    global _pace
    _pace = pace
    rlreplay.init(run_dir, experiment="stress", worker=f"p{proc}")
    ack_fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if ack_path else None

    async def main() -> None:
        for step in range(steps):
            jobs = [
                one_trajectory(proc, step, sample, rollout, ack_fd)
                for sample in range(concurrent // 4)
                for rollout in range(4)
            ]
            random.Random(step).shuffle(jobs)
            await asyncio.gather(*jobs)

    asyncio.run(main())
    # no explicit close: the process's exit hooks flush and seal


def parse_key(key: str) -> tuple[int, int, int, int]:
    p, s, i, r = key.split("-")
    return int(p[1:]), int(s[1:]), int(i[1:]), int(r[1:])


def check_trajectory(rows: list[dict[str, Any]], complete: bool) -> str:
    """Compare one recorded trajectory with what its process generated, span by span; returns its key.

    ``complete``: every span must be there; otherwise (cut by a kill) what is there must still be exact.
    """
    by_id = {r["span_id"]: r for r in rows}
    roots = [r for r in rows if r["parent_id"] is None]
    # without a root, the trajectory was still running at a kill: its key is in its spans' inputs
    key = orjson.loads(roots[0]["attributes"])["key"] if roots else _key_from_inputs(rows[0])
    proc, step, sample, rollout = parse_key(key)
    for r in rows:
        assert (r["step"], r["sample_index"], r["rollout_n"], r["validate"]) == (
            step,
            sample,
            rollout,
            sample % 7 == 0,
        )
        assert (r["experiment"], r["worker"]) == ("stress", f"p{proc}")
    remaining = expected_spans(key, sample, rollout)
    if complete:
        assert len(rows) == len(remaining), key
    for r in rows:
        inputs = orjson.loads(r["inputs"]) if r["inputs"] is not None else None
        matches = [e for e in remaining if e["name"] == r["name"] and e["inputs"] == inputs]
        assert len(matches) == 1, (key, r["name"], inputs)  # a span of another trajectory never matches
        want = matches[0]
        remaining.remove(want)
        assert (r["kind"], r["status"]) == (want["kind"], want["status"]), key
        output = orjson.loads(r["output"]) if r["output"] is not None else None
        if want["status"] == "ok":
            assert output == want["output"], (key, r["name"])
        else:
            assert output["__type__"] == "exception" and key in output["message"]
        if r["parent_id"] is None:
            assert want["parent"] is None, key
        elif r["parent_id"] in by_id:
            assert by_id[r["parent_id"]]["name"] == want["parent"], (key, r["name"])
        else:  # its parent, still running at the kill, was never written
            assert not complete, (key, r["name"])
    return key


def _key_from_inputs(row: dict[str, Any]) -> str:
    inputs = orjson.loads(row["inputs"])
    if row["name"] == "Agent.run":
        return inputs["key"]
    if row["name"] == "Agent.execute":
        return inputs["instance_id"]
    return (inputs.get("request_id") or inputs["text"]).rsplit("/", 1)[0]


def group_by_trajectory(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    t0 = time.perf_counter()
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    from rlreplay.model import decoded_rows

    for r in decoded_rows(rlreplay.open_run(run_dir).spans()):
        for k in ("inputs", "output", "attributes"):  # as JSON text, as the checks below read it
            r[k] = None if r[k] is None else orjson.dumps(r[k]).decode()
        groups[r["trajectory_id"]].append(r)
    print(f"read {sum(map(len, groups.values()))} spans in {time.perf_counter() - t0:.2f}s")
    return groups


def test_thousand_concurrent_trajectories_across_processes_land_exactly(tmp_path: Path) -> None:
    from rlreplay.shards.layout import list_files

    t0 = time.perf_counter()
    run_dir = tmp_path / "run"
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=worker_main, args=(p, str(run_dir), STEPS, CONCURRENT, None))
        for p in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    print(f"recorded in {time.perf_counter() - t0:.2f}s")
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) == PROCESSES * STEPS  # one sealed shard per worker and step
    groups = group_by_trajectory(run_dir)
    keys = [check_trajectory(rows, complete=True) for rows in groups.values()]
    assert len(keys) == len(set(keys)) == PROCESSES * STEPS * CONCURRENT
    assert set(keys) == {
        traj_key(p, s, i, r)
        for p in range(PROCESSES)
        for s in range(STEPS)
        for i in range(CONCURRENT // 4)
        for r in range(4)
    }
    assert rlreplay.open_run(run_dir).counters()["spans"] == sum(len(v) for v in groups.values())


def test_sigkill_mid_step_loses_only_the_last_flush_interval(tmp_path: Path) -> None:
    from rlreplay.read.summary import recover
    from rlreplay.shards.layout import list_files

    run_dir = tmp_path / "run"
    ack_path = tmp_path / "acks"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=worker_main, args=(0, str(run_dir), 1000, 64, str(ack_path), 0.1))
    proc.start()
    first_ack = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        acks = ack_path.read_text().count("\n") if ack_path.exists() else 0
        if acks and first_ack is None:
            first_ack = time.monotonic()
        if first_ack is not None and time.monotonic() - first_ack > 3.0 and acks >= 300:
            break
        time.sleep(0.05)
    killed_at = time.monotonic_ns()
    proc.kill()
    proc.join(30)
    assert proc.exitcode == -9

    acked = {}
    for line in ack_path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            acked[parts[0]] = int(parts[1])
    last_step = max(parse_key(k)[1] for k in acked)
    assert last_step >= 3
    sealed, partials = list_files(run_dir)
    sealed_steps = {int(p.parent.parent.name.split("=")[1]) for p in sealed}
    assert set(range(last_step - 1)) <= sealed_steps  # finished steps were sealed while running
    assert all(int(p.parent.parent.name.split("=")[1]) >= last_step - 1 for p in partials)

    totals = recover(run_dir)
    assert totals["recovered_shards"] <= len(partials) and totals["live_partials"] == 0
    assert list_files(run_dir)[1] == []
    groups = group_by_trajectory(run_dir)
    present: dict[str, bool] = {}
    for rows in groups.values():
        complete = any(r["parent_id"] is None for r in rows)
        key = check_trajectory(rows, complete=complete)  # whatever survived is exact, never mixed
        present[key] = complete
    bound_ns = int((FLUSH_INTERVAL_S + MARGIN_S) * 1e9)
    old_enough = [k for k, t in acked.items() if t < killed_at - bound_ns]
    assert len(old_enough) >= 200
    lost = [(killed_at - t) / 1e9 for k, t in acked.items() if not present.get(k)]
    print(f"{len(acked)} acknowledged, {len(lost)} lost, oldest {max(lost, default=0):.3f}s before the kill")
    missing = [k for k in old_enough if not present.get(k)]
    assert missing == [], f"{len(missing)} trajectories acknowledged > {bound_ns / 1e9}s before the kill lost"
