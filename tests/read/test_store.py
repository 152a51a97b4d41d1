"""The store and the browsing CLI on runs recorded by the real recorder into real files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import support
from support import run_cli as cli

import rlreplay
from rlreplay.shards.layout import list_files

STEPS = [3, 4, 5]
SAMPLES = 3
ROLLOUTS = 2


class Agent:
    @rlreplay.trace_op(kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(0)
        return {"token_ids": [len(prompt_ids), 7, 8]}

    @rlreplay.trace_op(kind="tool")
    async def execute(self, instance_id: str, parameters: dict) -> tuple:
        if parameters["fail"]:
            raise RuntimeError("tool failed")
        return ("ok", 1.0, {})

    @rlreplay.trace_op(kind="agent")
    async def run(self, prompt_ids: list[int], fail: bool) -> dict:
        out = await self.generate("req", prompt_ids=prompt_ids, sampling_params={"temperature": 1.0})
        with contextlib.suppress(RuntimeError):
            await self.execute("inst", {"fail": fail})
        return {
            "prompt_ids": prompt_ids,
            "response_ids": out["token_ids"],
            "reward_score": 0.0 if fail else 1.0,
        }


def record(run_dir: Path, experiment: str = "exp-a", worker: str = "w0") -> None:
    def agent(sample: int, n: int) -> Any:
        return Agent().run([1, 2, 3, sample], fail=(n == 1))

    support.record(
        run_dir,
        agent,
        steps=STEPS,
        samples=range(SAMPLES),
        rollouts=ROLLOUTS,
        experiment=experiment,
        worker=worker,
        validate=True,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("runs") / "run"
    record(path)
    return path


def test_files_are_partitioned_sealed_and_versioned(run_dir: Path) -> None:
    sealed, partials = list_files(run_dir)
    assert partials == []
    assert {p.parent.parent.name for p in sealed} == {f"step={s}" for s in STEPS}
    for path in sealed:
        meta = pq.read_schema(path).metadata
        assert meta[b"rlreplay.format_version"] == b"2"
        table = pq.read_table(path)
        assert set(table["step"].to_pylist()) == {int(path.parent.parent.name.split("=")[1])}
        assert set(table["worker"].to_pylist()) == {path.parent.name.split("=")[1]}


def test_filters_select_exactly(run_dir: Path) -> None:
    run = rlreplay.open_run(run_dir)
    everything = run.trajectories().to_pylist()
    assert len(everything) == len(STEPS) * (SAMPLES * ROLLOUTS + 1)
    for kw in (
        {"step": 5},
        {"sample_index": 2},
        {"rollout_n": 1},
        {"validate": True},
        {"step": 4, "validate": False},
    ):
        got = run.trajectories(**kw).to_pylist()
        expected = [r for r in everything if all(r[k] == v for k, v in kw.items())]
        assert sorted(r["id"] for r in got) == sorted(r["id"] for r in expected)
        assert got
    assert run.trajectories(experiment="other").num_rows == 0
    assert set(run.spans(name="Agent.execute")["name"].to_pylist()) == {"Agent.execute"}


def test_trajectory_listing_counts_and_status(run_dir: Path) -> None:
    rows = rlreplay.open_run(run_dir).trajectories(step=3, validate=False).to_pylist()
    for row in rows:
        assert row["num_spans"] == 4
        assert row["model_calls"] == 1
        assert row["tool_calls"] == 1
        assert row["name"] == "agent_loop"
        assert row["agent"] == "Agent.run"
        assert row["reward"] == (0.0 if row["rollout_n"] == 1 else 1.0)
        assert row["duration_s"] >= 0


def test_span_tree_nests(run_dir: Path) -> None:
    run = rlreplay.open_run(run_dir)
    row = run.trajectories(step=5, sample_index=1, rollout_n=1).to_pylist()[0]
    traj = run.trajectory(row["id"][:10])
    assert traj.id == row["id"]
    (root,) = traj.roots
    assert root.kind == "trajectory"
    (agent,) = root.children
    assert [c.name for c in agent.children] == ["Agent.generate", "Agent.execute"]
    tool = agent.children[1]
    assert tool.status == "error" and tool.error == "RuntimeError: tool failed"
    assert tool.output["__type__"] == "exception"
    assert agent.children[0].inputs["prompt_ids"] == [1, 2, 3, 1]
    assert traj.attributes["step"] == 5 and traj.attributes["experiment_name"] == "exp-a"


def test_cli_ls_step_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "ls", run_dir, "--step", "5", "--json")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == SAMPLES * ROLLOUTS + 1
    required = {"id", "step", "sample_index", "rollout_n", "validate", "experiment", "worker", "name"}
    required |= {"start_time", "duration_s", "num_spans", "status"}
    for row in rows:
        assert required <= row.keys()
        assert row["step"] == 5


def test_cli_ls_table_and_show(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "ls", "--run", run_dir, "--step", "4", "--train")
    assert rc == 0
    assert f"{SAMPLES * ROLLOUTS} trajectories" in out
    first_id = out.splitlines()[1].split()[0]
    rc, out, _ = cli(capsys, "show", first_id, "--run", run_dir)
    assert rc == 0
    assert "Agent.generate" in out and "Agent.execute" in out and "step=4" in out
    rc, out, _ = cli(capsys, "show", first_id, "--run", run_dir, "--json")
    assert json.loads(out)["spans"][0]["children"][0]["name"] == "Agent.run"


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{missing}"],
        ["ls", "{run}", "--limit", "0"],
        ["show", "ffffffffffffffffffffffffffffffff", "--run", "{run}"],
        ["show", "not-hex", "--run", "{run}"],
        ["show", "{ambiguous}", "--run", "{run}"],
        ["ls", "{run}", "--run", "{missing}"],
        ["ls", "{file}"],
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    ids = sorted(rlreplay.open_run(run_dir).trajectories()["id"].to_pylist())
    first_chars = [i[0] for i in ids]
    ambiguous = (
        next(c for c in first_chars if first_chars.count(c) > 1) if len(set(first_chars)) < len(ids) else ""
    )
    values = {"missing": tmp_path / "nope", "run": run_dir, "ambiguous": ambiguous, "file": a_file}
    argv = [a.format(**values) for a in args]
    if argv[1] == "":
        pytest.fail("fixture has no shared id prefix")
    rc, out, err = cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("rlreplay: error: ")
    assert "Traceback" not in err


def test_corrupt_and_foreign_files_are_skipped(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_copy = tmp_path / "copy"
    shutil.copytree(run_dir, run_copy)
    sealed, _ = list_files(run_copy, step=4)
    victim = sealed[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # truncated
    garbage = sealed[0].parent / "part-garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all" * 10)
    foreign = run_copy / "spans" / "step=5" / "worker=w0" / "part-foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    rc, out, err = cli(capsys, "ls", run_copy, "--json")
    assert rc == 0
    steps = {json.loads(line)["step"] for line in out.splitlines()}
    assert steps == {3, 5}  # step 4's only file is broken; the rest still lists
    assert "part-garbage.parquet" in err and victim.name in err and "part-foreign.parquet" in err
    assert all(line.startswith("rlreplay: warning: ") for line in err.strip().splitlines()), err


def test_newer_format_is_refused_clearly(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_copy = tmp_path / "newer"
    shutil.copytree(run_dir, run_copy)
    manifest = json.loads((run_copy / "run.json").read_text())
    manifest["format_version"] = 99
    (run_copy / "run.json").write_text(json.dumps(manifest))
    rc, _, err = cli(capsys, "ls", run_copy)
    assert rc == 2 and "format 99" in err and "upgrade rlreplay" in err


def test_pandas_export(run_dir: Path) -> None:
    import pandas as pd

    frame = rlreplay.open_run(run_dir).trajectories(step=3).to_pandas()
    assert isinstance(frame, pd.DataFrame) and set(frame["step"]) == {3}


def test_load_keeps_only_the_kinds_asked_for() -> None:
    """``Run.load(kinds=..., skip_kinds=...)``: each trajectory holds only its spans of those kinds,
    their payloads as a whole load gives them."""
    run_dir = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-arith-smollm2"
    files = sorted(run_dir.glob("spans/**/*.parquet"))
    rows = pa.concat_tables([pq.read_table(f, columns=["trajectory_id", "span_id", "kind"]) for f in files])
    kinds_of: dict[str, dict[str, str]] = {}
    for r in rows.to_pylist():
        kinds_of.setdefault(r["trajectory_id"], {})[r["span_id"]] = r["kind"]
    ids = sorted(t for t, spans in kinds_of.items() if "signals" in spans.values())[:3]
    assert ids
    run = rlreplay.open_run(run_dir)
    whole = {t.id: {s.span_id: s for s in t.spans} for t in run.load(ids)}
    only = run.load(ids, kinds=("trajectory", "agent"))
    without = run.load(ids, skip_kinds=("signals",))
    assert [t.id for t in only] == ids == [t.id for t in without]
    for t in only:
        assert sorted(s.span_id for s in t.spans) == sorted(
            s for s, k in kinds_of[t.id].items() if k in ("trajectory", "agent")
        )
        assert all(s.inputs == whole[t.id][s.span_id].inputs for s in t.spans)
    for t in without:
        assert sorted(s.span_id for s in t.spans) == sorted(
            s for s, k in kinds_of[t.id].items() if k != "signals"
        )
        assert all(s.output == whole[t.id][s.span_id].output for s in t.spans if s.kind == "agent")


# ---- stores: where a run's files are kept -------------------------------------------------------

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"


@pytest.fixture
def stored_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """The sample run copied onto fsspec's in-memory filesystem (reached through pyarrow.fs, as an
    object store is), and the folder of the read cache it is read through."""
    from support import memory_store_copy

    monkeypatch.setenv("RLREPLAY_CACHE", str(tmp_path / "cache"))
    uri, remove = memory_store_copy(SAMPLE, tmp_path.name)
    yield uri, tmp_path / "cache"
    remove()


def _cached(cache: Path, suffix: str) -> list[str]:
    """The run files of that kind in the read cache, relative to the run."""
    return sorted(str(p.relative_to(p.parents[3])) for p in cache.glob(f"*/*/spans/*/*/*{suffix}"))


def test_a_run_reads_the_same_through_the_object_store_as_from_its_folder(
    stored_sample: tuple[str, Path],
) -> None:
    from rlreplay.read.remote import ObjectStore
    from rlreplay.read.store import LocalStore, Store

    uri, cache = stored_sample
    files = sorted(SAMPLE.glob("spans/*/*/*.parquet"))
    rows = pa.concat_tables(
        [pq.read_table(f, columns=["trajectory_id", "step", "kind", "inputs"]) for f in files]
    )
    ids_of: dict[int, set[str]] = {}
    for tid, step in zip(rows["trajectory_id"].to_pylist(), rows["step"].to_pylist()):
        ids_of.setdefault(step, set()).add(tid)

    run = rlreplay.open_run(uri)
    local = rlreplay.open_run(SAMPLE)
    assert isinstance(run.store, ObjectStore) and isinstance(local.store, LocalStore)
    assert isinstance(run.store, Store) and isinstance(local.store, Store)  # every member of the protocol
    assert run.address == uri and repr(run) == f"Run({uri!r})" and run.store.cache_dir == run.path
    assert local.address == str(SAMPLE) and local.store.cache_dir is None
    listed = run.trajectories()
    assert set(listed["id"].to_pylist()) == set().union(*ids_of.values())
    assert listed.equals(local.trajectories())
    assert set(run.trajectories(step=5)["id"].to_pylist()) == ids_of[5]
    assert sorted(run.step_partitions()) == sorted(local.step_partitions()) == sorted(map(str, ids_of))
    assert _cached(cache, ".parquet") == [] and len(_cached(cache, ".index")) == len(files)

    spans = run.spans(step=3, columns=["trajectory_id", "kind", "inputs"])
    step3 = rows.filter(pc.equal(rows["step"], 3))
    assert spans.num_rows == step3.num_rows and sorted(spans["inputs"].to_pylist(), key=str) == sorted(
        step3["inputs"].to_pylist(), key=str
    )
    fetched = [str(f.relative_to(SAMPLE)) for f in files if "step=3/" in str(f)]
    assert _cached(cache, ".parquet") == fetched  # payload columns: the step's shards, fetched

    target = sorted(ids_of[6])[0]
    traj = run.trajectory(target)
    assert len(traj.spans) == sum(1 for t in rows["trajectory_id"].to_pylist() if t == target)
    holder = [
        str(f.relative_to(SAMPLE))
        for f in files
        if target in pq.read_table(f, columns=["trajectory_id"])["trajectory_id"].to_pylist()
    ]
    assert len(holder) == 1 and _cached(cache, ".parquet") == sorted(fetched + holder)

    assert (
        run.stored_bytes()
        == local.stored_bytes()
        == sum(p.stat().st_size for p in (SAMPLE / "spans").rglob("*") if p.is_file())
    )
    assert run.counters() == {**local.counters(), "upload_errors": 0, "pending_uploads": 0}
    before, dropped = run.file_signature(), run.counters()["dropped"]
    assert len(before) == sum(1 for p in SAMPLE.glob("[s_]*/**/*") if p.is_file())  # spans/, _workers/
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/{uri.removeprefix('memory://')}/_workers/w.json", b'{"dropped": 2}')
    assert run.file_signature() != before and run.counters()["dropped"] == dropped + 2


def test_a_trajectory_not_in_a_stored_run_is_named_with_the_run_not_its_cache(
    stored_sample: tuple[str, Path],
) -> None:
    from rlreplay.errors import RunError

    uri, cache = stored_sample
    run = rlreplay.open_run(uri)
    for ref in ("ab" * 16, "ffff"):  # a whole id, a prefix
        with pytest.raises(RunError) as caught:
            run.trajectory(ref)
        assert uri in str(caught.value) and str(cache) not in str(caught.value)
    import fsspec

    fsspec.filesystem("memory").pipe_file(
        f"/{uri.removeprefix('memory://')}/run.json", b'{"format_version": 99}'
    )
    with pytest.raises(RunError, match="format 99") as caught:
        rlreplay.open_run(uri)
    assert uri in str(caught.value) and str(cache) not in str(caught.value)


def _files(run: Path) -> set[tuple[str, int, int]]:
    """(path, size, mtime) of every file under spans/ and _workers/, each looked at now."""
    out = set()
    for top in ("spans", "_workers"):
        for folder, _, names in os.walk(run / top):
            for name in names:
                st = os.stat(os.path.join(folder, name))
                out.add((os.path.join(folder, name), st.st_size, st.st_mtime_ns))
    return out


def _age(run: Path, seconds: float) -> None:
    """Every folder of the run as last changed ``seconds`` ago."""
    old = time.time_ns() - int(seconds * 1e9)
    for folder, _, _ in os.walk(run):
        os.utime(folder, ns=(old, old))


def test_a_folder_signature_reuses_settled_folders_and_sees_every_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlreplay.read import store

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    worker = next((run / "spans").glob("step=*/worker=*"))
    live = worker / "_part-live.partial"
    live.write_bytes(b"x" * 10)
    _age(run, 3600)
    first = rlreplay.open_run(run).file_signature()
    assert len(first) == len(_files(run)) and set(first) == _files(run)

    scanned: list[str] = []
    scan = store.scan_folder
    monkeypatch.setattr(
        store, "scan_folder", lambda folder, mtime: scanned.append(folder) or scan(folder, mtime)
    )
    assert store.folder_signature(run) == first and scanned == []  # settled folders are not listed again

    with open(live, "ab") as f:  # a live file grows under its name: its folder's mtime stays
        f.write(b"y" * 5)
    grown = store.folder_signature(run)
    assert grown != first and set(grown) == _files(run) and scanned == []

    (worker / "part-new.parquet").write_bytes(b"p")  # a new file changes its folder's mtime
    added = store.folder_signature(run)
    assert set(added) == _files(run) and scanned == [str(worker)]
    # a second file within the same clock tick leaves the folder's mtime as it was: a folder
    # changed lately is listed again all the same
    tick = os.stat(worker).st_mtime_ns
    (worker / "part-newer.parquet").write_bytes(b"q")
    os.utime(worker, ns=(tick, tick))
    assert set(store.folder_signature(run)) == _files(run)
