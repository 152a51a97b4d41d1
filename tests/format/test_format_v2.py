"""Span format 2: typed token arrays and shared prefixes read back exactly, typed keys, the trajectory
index, format 1 runs still read, one bad value costs only itself, and live files survive SIGKILL."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.format import index as tindex
from rlreplay.format.index import summarize
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.model import listing_rows
from rlreplay.read.filters import Filters
from rlreplay.recorder.rows import StepBuffer
from rlreplay.rewrite import rewrite_run
from rlreplay.shards import seal as seal_module
from rlreplay.shards.layout import list_files
from rlreplay.shards.recover import recover_run
from rlreplay.shards.seal import write_sealed

FIXTURES = Path(__file__).parents[1] / "fixtures"
V1_RUN = FIXTURES / "v1-run"
VOCAB = 151_643  # Qwen3's vocabulary size


def _conversation(seed: int, turns: int) -> tuple[list[int], list[tuple[list[int], list[float], list[int]]]]:
    """A first prompt, then per turn (generated ids, their float32 log-probs, the observation ids)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 300).tolist()
    script = []
    for _ in range(turns):
        ids = rng.integers(0, VOCAB, int(rng.integers(70, 200))).tolist()
        log_probs = (-np.abs(rng.normal(0, 1.5, len(ids)))).astype(np.float32).tolist()
        observation = rng.integers(0, VOCAB, int(rng.integers(5, 40))).tolist()
        script.append((ids, log_probs, observation))
    return prompt, script


@rlreplay.trace_op(kind="llm")
async def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict:
    ids, log_probs, _ = _SCRIPTS[request_id].pop(0)
    return {"token_ids": ids, "log_probs": log_probs, "stop_reason": "completed"}


@rlreplay.trace_op(kind="agent")
async def agent_loop(request_id: str, prompt: list[int], turns: int) -> dict:
    context = list(prompt)
    mask: list[int] = []
    log_probs: list[float] = []
    for turn in range(turns):
        out = await generate(
            request_id, prompt_ids=context, sampling_params={"temperature": 1.0, "logprobs": 1}
        )
        observation = _OBSERVATIONS[request_id][turn]
        context = context + out["token_ids"] + observation
        mask += [1] * len(out["token_ids"]) + [0] * len(observation)
        log_probs += out["log_probs"] + [0.0] * len(observation)
    return {
        "prompt_ids": prompt,
        "response_ids": context[len(prompt) :],
        "response_mask": mask,
        "response_logprobs": log_probs,
        "reward_score": 1.0,
    }


_SCRIPTS: dict[str, list] = {}
_OBSERVATIONS: dict[str, list] = {}


def _record(run_dir: Path, n: int, turns: int, worker: str = "w0") -> dict[str, tuple]:
    import asyncio

    rlreplay.init(run_dir, experiment="v2", worker=worker)
    expected = {}

    async def one(i: int) -> None:
        prompt, script = _conversation(i, turns)
        request_id = f"req-{i}"
        _SCRIPTS[request_id] = list(script)
        _OBSERVATIONS[request_id] = [s[2] for s in script]
        async with rlreplay.trajectory(step=0, sample_index=i // 2, rollout_n=i % 2) as t:
            await agent_loop(request_id, prompt, turns)
        expected[t.id] = (prompt, script)

    async def all_() -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(all_())
    rlreplay.close()
    return expected


def _bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_token_arrays_and_20_turn_prefixes_read_back_exactly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    expected = _record(run_dir, n=4, turns=20)
    run = rlreplay.open_run(run_dir)
    recorded_ids = 0
    final_context = 0
    for traj_id, (prompt, script) in expected.items():
        traj = run.trajectory(traj_id)
        llm = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
        assert len(llm) == 20
        context = list(prompt)
        for span, (ids, log_probs, observation) in zip(llm, script):
            assert span.inputs["prompt_ids"] == context
            assert all(type(x) is int for x in span.inputs["prompt_ids"])
            assert span.output["token_ids"] == ids
            assert span.output["log_probs"] == log_probs
            assert _bits(span.output["log_probs"]) == _bits(log_probs)  # float32 bit-exact
            assert span.prompt_tokens == len(context) and span.response_tokens == len(ids)
            recorded_ids += len(context) + len(ids)
            context = context + ids + observation
        (agent,) = traj.by_kind("agent")
        assert agent.output["prompt_ids"] == prompt
        assert agent.output["response_ids"] == context[len(prompt) :]
        mask = agent.output["response_mask"]
        assert set(mask) == {0, 1} and all(type(x) is int for x in mask)
        assert agent.prompt_tokens == len(prompt) and agent.response_tokens == len(context) - len(prompt)
        recorded_ids += len(context)
        final_context += len(context)
    # every model call re-sends the growing prompt; what is stored is about the final contexts
    stored = pa.concat_arrays([c for c in run.spans(columns=["token_ids"])["token_ids"].chunks])
    stored_ids = len(stored.values)
    assert recorded_ids > 8 * final_context
    assert stored_ids <= 1.05 * final_context
    generated = sum(len(ids) for _, script in expected.values() for ids, _, _ in script)
    stored_log_probs = run.spans(columns=["token_logprobs"])["token_logprobs"].combine_chunks().values
    nonzero = int(np.count_nonzero(stored_log_probs.to_numpy()))
    assert nonzero <= 1.05 * generated  # the agent's response_logprobs are the calls'
    row = run.trajectories().to_pylist()[0]
    assert row["model_calls"] == 20 and row["tool_calls"] == 0 and row["reward"] == 1.0


def test_sealed_files_have_trajectory_row_groups_and_an_index(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setattr(seal_module, "ROW_GROUP_BYTES", 16 << 10)
    _record(run_dir, n=24, turns=6)
    (sealed,), partials = list_files(run_dir)
    assert partials == []
    pf = pq.ParquetFile(sealed)
    assert pf.num_row_groups > 1
    index = tindex.read(tindex.index_path(sealed), sealed.stat().st_size)
    assert index is not None and index.num_rows == 24
    for groups in index["row_groups"].to_pylist():
        assert len(groups) == 1  # one trajectory is read without its step
    run = rlreplay.open_run(run_dir)

    def no_span_reads(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the listing read span rows")

    with monkeypatch.context() as m:
        m.setattr(pq.ParquetFile, "read_row_groups", no_span_reads)
        listing = run.trajectories()  # from the index files only
    assert listing.equals(summarize(run.spans(columns=tindex.SPAN_COLUMNS)))
    read_groups: list[list[int]] = []
    original = pq.ParquetFile.read_row_groups

    def spy(self: pq.ParquetFile, row_groups: list[int], *args: Any, **kwargs: Any) -> pa.Table:
        read_groups.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    traj = run.trajectory(listing["id"][5].as_py())
    assert read_groups == [index["row_groups"][index["id"].to_pylist().index(traj.id)].as_py()]
    # a lost index is rebuilt from the shard
    tindex.index_path(sealed).unlink()
    assert rlreplay.open_run(run_dir).trajectories().equals(listing)


def test_keys_keep_their_type_and_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0")

    @rlreplay.trace_op
    def op() -> int:
        return 1

    with rlreplay.trajectory(step=np.int64(3), sample_index="s1-3", rollout_n=np.int32(0)):
        op()
    with rlreplay.trajectory(step=3, sample_index=7, rollout_n=2.5):  # a float key: kept as its str()
        op()
    rlreplay.flush()
    stats = rlreplay.stats()
    rlreplay.close()
    assert stats["encode_errors"] == 2  # the float key, on each of its trajectory's two spans
    run = rlreplay.open_run(run_dir)
    rows = {r["sample_index"]: r for r in listing_rows(run.trajectories())}
    assert set(rows) == {"s1-3", 7}
    assert rows["s1-3"]["step"] == 3 and type(rows["s1-3"]["step"]) is int and rows["s1-3"]["rollout_n"] == 0
    assert rows[7]["rollout_n"] == "2.5"
    assert run.trajectories(Filters(sample_index="s1-3")).num_rows == 1
    assert run.trajectories(sample_index=["s1-3", 7]).num_rows == 2
    traj = run.trajectory(rows["s1-3"]["id"])
    assert (traj.step, traj.sample_index, traj.rollout_n) == (3, "s1-3", 0)
    capsys.readouterr()
    assert main(["ls", str(run_dir), "--sample-index", "s1-3", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["sample_index"] == "s1-3" and json.loads(line)["step"] == 3
    assert main(["ls", str(run_dir), "--sample-index", "7", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["sample_index"] == 7


class Hostile(list):
    def __iter__(self) -> Any:
        raise RuntimeError("cannot iterate")


def test_one_bad_value_costs_only_itself(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, experiment="x\udcff", worker="w0")

    @rlreplay.trace_op(kind="tool")
    def tool(fine: str, bad: Any) -> dict:
        return {"kept": [1, 2, 3], "bad": Hostile([1])}

    @rlreplay.trace_op(kind="parser")
    def parse(name: str) -> None:
        raise ValueError(f"cannot parse {name}")

    for i in range(60):
        with rlreplay.trajectory(step=0, sample_index=i):
            tool("fine", Hostile([1, 2]))
            with pytest.raises(ValueError):
                parse("caf\udce9.txt")
    rlreplay.flush()
    stats = rlreplay.stats()
    rlreplay.close()
    assert stats["lost"] == 0 and stats["spans"] == 180
    # per trajectory: the experiment on 3 spans, the hostile input and output, the parse error
    assert stats["encode_errors"] == 60 * 6
    run = rlreplay.open_run(run_dir)
    listing = run.trajectories()
    assert listing.num_rows == 60 and set(listing["experiment"].to_pylist()) == {"x\\udcff"}
    traj = run.trajectory(listing["id"][0].as_py())
    (t,) = traj.by_kind("tool")
    assert t.inputs["fine"] == "fine" and t.inputs["bad"]["__type__"] == "error"
    assert t.output["kept"] == [1, 2, 3] and t.output["bad"]["__type__"] == "error"
    (p,) = traj.by_kind("parser")
    assert p.status == "error" and p.error == "ValueError: cannot parse caf\\udce9.txt"
    assert p.inputs["name"] == "caf\\udce9.txt"


def test_take_batch_never_loses_the_batch() -> None:
    buf = StepBuffer()
    good = ("a" * 32, "b" * 16, None, "op", "op", 1, 2, "ok", None, "w0", "e", False) + (None,) * 17
    good = (*good, None, None, None)
    assert len(good) == len(SPAN_SCHEMA)
    bad = list(good)
    bad[3] = 12345  # not a string
    bad[10] = "x\udcff"
    for row in (good, tuple(bad), good):
        buf.append(row, 0)
    batch, problems = buf.take_batch()
    assert batch.num_rows == 3 and buf.rows == 0
    assert batch.column("name").to_pylist() == ["op", "", "op"]
    assert batch.column("experiment").to_pylist() == ["e", "x\\udcff", "e"]
    # each value Arrow refused comes back as one counted problem, naming its column
    assert [(p.key, p.counted) for p in problems] == [("encode:column", True)] * 2
    assert ["column name" in p.message for p in problems] == [True, False]
    assert ["column experiment" in p.message for p in problems] == [False, True]


DIGEST_FIELDS = (
    "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "status", "error", "reward",
    "inputs", "output", "attributes",
)  # fmt: skip


def _digests(run_dir: Path) -> dict[str, str]:
    run = rlreplay.open_run(run_dir)
    out = {}
    for tid in run.trajectories()["id"].to_pylist():
        spans = sorted(
            [
                [
                    s.span_id,
                    s.parent_id,
                    s.name,
                    s.kind,
                    s.start_ns,
                    s.end_ns,
                    s.status,
                    s.error,
                    s.reward,
                    s.inputs,
                    s.output,
                    s.attributes,
                ]
                for s in run.trajectory(tid).spans
            ],
            key=lambda r: r[0],
        )
        out[tid] = hashlib.sha256(orjson.dumps(spans, option=orjson.OPT_SORT_KEYS)).hexdigest()
    assert run.warnings == []
    return out


def test_format_1_runs_read_rewrite_and_recover_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = json.loads((FIXTURES / "v1-run.digests.json").read_text())
    assert _digests(V1_RUN) == expected
    assert main(["ls", str(V1_RUN)]) == 0
    some = sorted(expected)[0]
    assert main(["show", some, "--run", str(V1_RUN), "--no-text"]) == 0
    # rewritten into format 2: same values
    rewritten = tmp_path / "v2"
    rewrite_run(V1_RUN, rewritten)
    sealed, partials = list_files(rewritten)
    assert partials == [] and all(
        pq.read_schema(p).metadata[b"rlreplay.format_version"] == b"2" for p in sealed
    )
    assert _digests(rewritten) == expected
    # the format 1 live file recovered into a format 2 shard
    copy = tmp_path / "copy"
    shutil.copytree(V1_RUN, copy)
    recovery = recover_run(copy)
    results, live = recovery.sealed, recovery.live
    assert live == [] and len(results) == 1 and results[0].rows > 0
    assert list_files(copy)[1] == [] and _digests(copy) == expected


def test_early_format_2_files_read_exactly() -> None:
    expected = json.loads((FIXTURES / "v2-early-run.digests.json").read_text())
    assert _digests(FIXTURES / "v2-early-run") == expected


def test_garbage_in_a_payload_column_warns_and_the_rest_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _record(run_dir, n=2, turns=2)
    (sealed,), _ = list_files(run_dir)
    table = pq.read_table(sealed)
    inputs = table["inputs"].to_pylist()
    kinds = table["kind"].to_pylist()
    victim = kinds.index("agent")
    inputs[victim] = '{"prompt": [1, 2'  # cut short
    table = table.set_column(
        table.schema.get_field_index("inputs"), "inputs", pa.array(inputs, pa.large_string())
    )
    sealed.unlink()
    write_sealed(table, sealed)
    tid = table["trajectory_id"][victim].as_py()
    capsys.readouterr()
    assert main(["show", tid, "--run", str(run_dir), "--no-text"]) == 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and sealed.name in err and "unreadable payload" in err
    traj = rlreplay.open_run(run_dir).trajectory(tid)
    (agent,) = traj.by_kind("agent")
    assert agent.inputs["__type__"] == "error" and agent.output["prompt_ids"]  # the rest of the span reads


def test_a_span_whose_shared_ids_are_not_on_disk_reads_as_an_error_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never a reference handed back, never wrong ids: a model call whose prompt shares the ids of a
    span that is gone (a file damaged outside rlreplay) reads as an ``error`` marker, with a warning."""
    run_dir = tmp_path / "run"
    expected = _record(run_dir, n=2, turns=3)
    (sealed,), _ = list_files(run_dir)
    table = pq.read_table(sealed)
    tid = next(iter(expected))
    rows = [
        (r["start_ns"], i)
        for i, r in enumerate(table.select(["trajectory_id", "kind", "start_ns"]).to_pylist())
        if r["trajectory_id"] == tid and r["kind"] == "llm"
    ]
    first = min(rows)[1]
    sealed.unlink()
    write_sealed(table.filter(pa.array([i != first for i in range(table.num_rows)])), sealed)
    capsys.readouterr()
    assert main(["show", tid, "--run", str(run_dir), "--no-text", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "unreadable token array" in captured.err
    assert '"tokens"' not in captured.out  # no placeholder reaches the user
    traj = rlreplay.open_run(run_dir).trajectory(tid)
    llms = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
    assert len(llms) == 2
    assert llms[0].inputs["prompt_ids"]["__type__"] == "error"  # it repeated the lost call's ids


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import test_format_v2 as t
    import rlreplay
    expected = t._record_live(sys.argv[1])
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _record_live(run_dir: str) -> None:
    """Record in this process without closing: the live files stay open (for the SIGKILL test)."""
    import asyncio

    rlreplay.init(run_dir, experiment="live", worker="w0")

    async def one(i: int) -> None:
        prompt, script = _conversation(i, 5)
        request_id = f"req-{i}"
        _SCRIPTS[request_id] = list(script)
        _OBSERVATIONS[request_id] = [s[2] for s in script]
        async with rlreplay.trajectory(step=1, sample_index=i, rollout_n=0):
            await agent_loop(request_id, prompt, 5)

    async def all_() -> None:
        await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(all_())
    assert rlreplay.flush(30)


def test_live_format_2_files_survive_sigkill(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run_dir), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        sealed, partials = list_files(run_dir)
        assert sealed == [] and partials
        live = rlreplay.open_run(run_dir).trajectories()  # readable while the writer lives
        assert live.num_rows == 6 and set(live["status"].to_pylist()) == {"ok"}
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    recovery = recover_run(run_dir)
    results, still_live = recovery.sealed, recovery.live
    assert still_live == [] and sum(r.rows for r in results) == 6 * 7
    run = rlreplay.open_run(run_dir)
    rows = run.trajectories().to_pylist()
    assert len(rows) == 6
    for row in rows:
        prompt, script = _conversation(row["sample_index"], 5)
        traj = run.trajectory(row["id"])
        llm = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
        context = list(prompt)
        for span, (ids, log_probs, observation) in zip(llm, script):
            assert span.inputs["prompt_ids"] == context and span.output["token_ids"] == ids
            assert _bits(span.output["log_probs"]) == _bits(log_probs)
            context = context + ids + observation
    (sealed,), _ = list_files(run_dir)
    assert tindex.index_path(sealed).exists()


SIGNALS = textwrap.dedent(
    """
    import sys
    import numpy as np
    from rlreplay.recorder.signals import record_signals
    trajectory_id, root = sys.argv[1], sys.argv[2]
    lp = np.linspace(-2, 0, 16, dtype=np.float32).tolist()
    ok = record_signals(trajectory_id, step=0, sample_index=0, rollout_n=1, validate=False, reward=1.5,
                        advantage=-0.25, logprob_diff_mean=0.01, logprob_diff_max=0.2, importance_ratio=1.02,
                        attributes={"reward_extra": {"acc": 1.0}}, output={"old_log_probs": lp},
                        root_span_id=root)
    print(ok)
    """
)


def test_signals_from_another_process_set_the_reward(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _record(run_dir, n=2, turns=1)
    run = rlreplay.open_run(run_dir)
    row = run.trajectories(rollout_n=1).to_pylist()[0]
    assert row["reward"] == 1.0 and row["advantage"] is None
    root = next(s for s in run.trajectory(row["id"]).spans if s.parent_id is None)
    env = {**os.environ, "RLREPLAY_DIR": str(run_dir), "RLREPLAY_WORKER": "driver"}
    out = subprocess.run(
        [sys.executable, "-c", SIGNALS, row["id"], root.span_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True", out.stderr
    run = rlreplay.open_run(run_dir)
    after = run.trajectories(rollout_n=1).to_pylist()[0]
    assert after["reward"] == 1.5 and after["advantage"] == -0.25 and after["importance_ratio"] == 1.02
    assert after["worker"] == "w0" and after["num_spans"] == row["num_spans"] + 1 and after["status"] == "ok"
    traj = run.trajectory(row["id"])
    assert traj.reward == 1.5 and traj.row["logprob_diff_max"] == 0.2
    (sig,) = traj.by_kind("signals")
    assert sig.parent_id == root.span_id and sig.attributes == {"reward_extra": {"acc": 1.0}}
    assert sig.output["old_log_probs"] == np.linspace(-2, 0, 16, dtype=np.float32).tolist()
    other = run.trajectories(rollout_n=0).to_pylist()[0]
    assert other["reward"] == 1.0  # untouched
