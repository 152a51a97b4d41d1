"""Faults while recording: a full disk, a vanished run directory, a full queue. Training never notices;
every span that does not reach disk is counted (counters file, one stderr warning, `rlreplay info`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import orjson
import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.model import decoded_rows
from rlreplay.read.summary import recover
from rlreplay.shards.layout import list_files

FULL_DISK = textwrap.dedent(
    """
    import asyncio, json, random, resource, signal, sys
    import rlreplay

    run_dir, limit = sys.argv[1], int(sys.argv[2])
    rlreplay.init(run_dir, experiment="faults", worker="full")
    # Every write past `limit` bytes of a file now fails with EFBIG, as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    def ids(seed, n):
        rng = random.Random(seed)
        return [rng.randrange(151_000) for _ in range(n)]

    @rlreplay.trace_op(kind="llm")
    async def generate(request_id, *, prompt_ids):
        await asyncio.sleep(random.random() * 0.05)
        return {"token_ids": ids(request_id, 50)}

    @rlreplay.trace_op(kind="agent")
    async def run(key, prompt_ids):
        out = []
        for turn in range(2):
            res = await generate(f"{key}/{turn}", prompt_ids=prompt_ids + out)
            out += res["token_ids"]
        return {"response_ids": out}

    returned = 0
    acknowledged = []  # the trajectories of each group whose flush returned True

    async def one(step, i):
        global returned
        key = f"{step}-{i}"
        async with rlreplay.trajectory(step=step, sample_index=i):
            res = await run(key, ids(key, 50))
        assert res["response_ids"] == ids(f"{key}/0", 50) + ids(f"{key}/1", 50)
        returned += 1

    async def main():
        for step in range(4):
            for group in range(10):  # a batch or two per group; files outgrow the limit mid-step
                keys = [(step, group * 4 + i) for i in range(4)]
                await asyncio.gather(*(one(*key) for key in keys))
                if rlreplay.flush():
                    acknowledged.extend(keys)

    asyncio.run(main())
    rlreplay.flush()
    stats = rlreplay.stats()
    rlreplay.close()
    report = {"returned": returned, "spans_made": returned * 4, "stats": stats, "acknowledged": acknowledged}
    print(json.dumps(report))
    """
)


def test_full_disk_training_continues_and_losses_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(run_dir), str(40_000)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    stats = report["stats"]
    assert report["returned"] == 160  # every traced call returned its real result
    assert stats["lost"] > 0 and stats["spans"] > 0
    assert stats["dropped"] == stats["spilled"] == stats["encode_errors"] == 0
    assert stats["spans"] + stats["lost"] == report["spans_made"]
    # one warning per kind of failure, not one per span; and the close report
    assert proc.stderr.count("could not write spans") == 1, proc.stderr
    assert f"rlreplay: worker full: lost={stats['lost']}" in proc.stderr
    (counters,) = [json.loads(p.read_text()) for p in (run_dir / "_workers").glob("*.json")]
    assert counters["lost"] == stats["lost"] and counters["spans"] == stats["spans"]

    # What reached disk is intact and readable once the leftovers are sealed (no size limit here).
    recover(run_dir)
    assert list_files(run_dir)[1] == []
    table = rlreplay.open_run(run_dir).spans()
    assert table.num_rows == stats["spans"]
    for row in decoded_rows(table):
        if row["kind"] == "llm":
            inputs, output = row["inputs"], row["output"]
            assert len(output["token_ids"]) == 50 and inputs["request_id"].startswith(f"{row['step']}-")
    # a flush acknowledges a batch only when all of it reached disk: each such trajectory is whole
    spans_of = Counter((row["step"], row["sample_index"]) for row in decoded_rows(table))
    acknowledged = [tuple(key) for key in report["acknowledged"]]
    assert 0 < len(acknowledged) < 160
    assert [key for key in acknowledged if spans_of[key] != 4] == []

    capsys.readouterr()
    assert main(["info", str(run_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["lost"] == stats["lost"] and info["spans"] == stats["spans"]
    assert main(["ls", str(run_dir)]) == 0
    assert f"recording losses: lost={stats['lost']}" in capsys.readouterr().out


@rlreplay.trace_op(kind="llm")
async def generate(request_id: str, *, prompt_ids: list[int]) -> dict:
    await asyncio.sleep(0)
    return {"token_ids": [*prompt_ids[-3:], len(prompt_ids)]}


@rlreplay.trace_op(kind="tool")
def tool(x: int) -> int:
    return x * 3


async def _trajectories(step: int, n: int, prompt_len: int = 8) -> list[int]:
    async def one(i: int) -> int:
        async with rlreplay.trajectory(step=step, sample_index=i, rollout_n=0):
            out = await generate(f"{step}-{i}", prompt_ids=list(range(i, i + prompt_len)))
            assert out["token_ids"][-1] == prompt_len
            return tool(i)

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_run_directory_replaced_by_a_file_mid_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0")
    assert asyncio.run(_trajectories(0, 10)) == [i * 3 for i in range(10)]
    rlreplay.flush()
    assert rlreplay.stats()["spans"] == 30

    shutil.rmtree(run_dir)
    run_dir.write_text("not a directory any more")
    with caplog.at_level(logging.WARNING, logger="rlreplay"):
        assert asyncio.run(_trajectories(0, 10)) == [i * 3 for i in range(10)]
        assert asyncio.run(_trajectories(1, 10)) == [i * 3 for i in range(10)]
        rlreplay.flush()
        stats = rlreplay.stats()
        rlreplay.close()
    # 30 spans were in files that were deleted, 60 more could not be written: all counted lost
    assert stats["lost"] == 90 and stats["spans"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("was removed while recording" in m for m in messages) == 1
    assert sum("could not write spans" in m for m in messages) == 1
    assert "rlreplay: worker w0: lost=90" in capsys.readouterr().err
    assert run_dir.read_text() == "not a directory any more"  # never clobbered


def test_unwritable_run_directory_from_the_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="rlreplay"):
        rlreplay.init(blocker / "run", worker="w0")
        assert asyncio.run(_trajectories(0, 5)) == [0, 3, 6, 9, 12]
        rlreplay.flush()
        stats = rlreplay.stats()
        rlreplay.close()
    assert stats["lost"] == 15 and stats["spans"] == 0
    assert any("cannot write to" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("policy", ["drop", "spill"])
def test_full_queue_drop_or_spill_is_counted(
    tmp_path: Path, policy: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    n = 200
    with caplog.at_level(logging.WARNING, logger="rlreplay"):
        rlreplay.init(run_dir, worker="w0", policy=policy, max_queue_mb=16 / 1024)  # 16 KB
        for step in (0, 1):
            for _ in range(n // 20):  # bursts of 20 trajectories: each fills the queue, then it drains
                assert asyncio.run(_trajectories(step, 20, prompt_len=300)) == [i * 3 for i in range(20)]
                rlreplay.flush()
        # step 0 is sealed as soon as step 1 runs, even with roots spilled or dropped
        sealed0, partials0 = list_files(run_dir, step=0)
        stats = rlreplay.stats()
        rlreplay.close()
    made = 2 * n * 3
    assert partials0 == [] and sealed0
    on_disk = rlreplay.open_run(run_dir).spans().to_pylist()
    warned = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert len(warned) == 1
    if policy == "drop":
        assert stats["dropped"] > 0 and stats["spilled"] == 0
        assert len(on_disk) + stats["dropped"] == made
    else:
        assert stats["spilled"] > 0 and stats["dropped"] == 0
        assert len(on_disk) == made == stats["spans"] + stats["spilled"]
    assert stats["lost"] == stats["encode_errors"] == 0
    # whatever is on disk is right: each child sits under the root of its own trajectory
    roots = {r["trajectory_id"]: r for r in on_disk if r["parent_id"] is None}
    for r in on_disk:
        if r["parent_id"] is not None and r["trajectory_id"] in roots:
            root = roots[r["trajectory_id"]]
            assert r["parent_id"] == root["span_id"] and r["sample_index"] == root["sample_index"]
        if r["kind"] == "llm":
            assert orjson.loads(r["inputs"])["request_id"] == f"{r['step']}-{r['sample_index']}"
    if policy == "spill":
        assert len(roots) == 2 * n
    assert list_files(run_dir)[1] == []

    capsys.readouterr()
    key = "dropped" if policy == "drop" else "spilled"
    assert main(["info", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[key] == stats[key]
    assert main(["ls", str(run_dir)]) == 0
    assert f"recording losses: {key}={stats[key]}" in capsys.readouterr().out


# A recording process whose file size limit the script sets (EFBIG, as on a full disk).
LIMITED_JOB = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    import rlreplay

    run_dir = sys.argv[1]
    rlreplay.init(run_dir, worker="w0")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    """
)

LOST_PREFIX = LIMITED_JOB + textwrap.dedent(
    """
    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": [(7 * i + len(prompt_ids)) % 151_000 for i in range(200)]}

    prompts = []
    acks = []
    with rlreplay.trajectory(step=0, sample_index=0) as t:
        prompt = list(range(1000, 1300))
        first = generate(prompt)["token_ids"]
        prompts.append(prompt)
        # the disk fills: the batch holding the first model call is lost
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, unlimited))
        acks.append(rlreplay.flush())
        resource.setrlimit(resource.RLIMIT_FSIZE, (unlimited, unlimited))
        # the next call's prompt repeats the first call's prompt and response
        prompt = prompt + first + [5, 6, 7]
        generate(prompt)
        prompts.append(prompt)
    acks.append(rlreplay.flush())
    stats = rlreplay.stats()
    rlreplay.close()
    print(json.dumps({"id": t.id, "prompts": prompts, "acks": acks, "stats": stats}))
    """
)


def test_a_span_sharing_ids_with_a_lost_batch_keeps_its_own(tmp_path: Path) -> None:
    """A model call whose prompt repeats the ids of spans in a batch the disk refused stores them
    itself: it reads back whole, never as a reference to values that are not on disk."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", LOST_PREFIX, str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["acks"] == [False, True]  # the second batch reached disk whole: acknowledged
    assert report["stats"]["lost"] == 1 and report["stats"]["spans"] == 2  # the agent's root, the 2nd call
    recover(run_dir)
    run = rlreplay.open_run(run_dir)
    traj = run.trajectory(report["id"])
    (llm,) = traj.by_kind("llm")
    assert llm.inputs["prompt_ids"] == report["prompts"][1]
    assert run.warnings == []


def test_a_span_sharing_ids_with_a_removed_file_keeps_its_own(tmp_path: Path) -> None:
    """The live file holding a trajectory's first model call is removed under the recorder: the next
    call's prompt, which repeats those ids, is stored whole in the new file."""
    run_dir = tmp_path / "run"

    @rlreplay.trace_op(kind="llm")
    def complete(prompt_ids: list[int]) -> dict:
        return {"token_ids": [(5 * i + len(prompt_ids)) % 151_000 for i in range(200)]}

    rlreplay.init(run_dir, worker="w0")
    with rlreplay.trajectory(step=0, sample_index=0) as t:
        prompt = list(range(2000, 2300))
        first = complete(prompt)["token_ids"]
        assert rlreplay.flush()
        (live,) = list_files(run_dir, step=0)[1]
        live.unlink()
        assert not rlreplay.flush()  # it finds the file gone: its span is lost
        prompt = prompt + first + [1, 2]
        complete(prompt)
    assert rlreplay.flush()
    stats = rlreplay.stats()
    rlreplay.close()
    assert stats["lost"] == 1 and stats["spans"] == 2
    run = rlreplay.open_run(run_dir)
    (llm,) = run.trajectory(t.id).by_kind("llm")
    assert llm.inputs["prompt_ids"] == prompt
    assert run.warnings == []


FULL_AT_CLOSE = textwrap.dedent(
    """
    import json, os, shutil, sys
    import rlreplay

    disk, out = sys.argv[1], sys.argv[2]
    run_dir = os.path.join(disk, "run")
    rlreplay.init(run_dir, worker="w0")

    @rlreplay.trace_op(kind="tool")
    def tool(x):
        return x + 1

    def record(step):
        for i in range(4):
            with rlreplay.trajectory(step=step, sample_index=i):
                tool(i)

    record(0)
    acks = [rlreplay.flush()]
    filler = os.path.join(disk, "filler")
    with open(filler, "wb", buffering=0) as f:  # the disk fills up, and stays full until after close
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass
    record(1)
    acks.append(rlreplay.flush())
    stats = rlreplay.stats()
    rlreplay.close()
    os.unlink(filler)
    shutil.copytree(run_dir, out)
    print(json.dumps({"acks": acks, "stats": stats}))
    """
)


def test_losses_are_counted_on_disk_when_the_disk_is_full_at_close(tmp_path: Path) -> None:
    """The run's loss counters are the exact truth even when the disk is still full as the process
    ends: the spans it could not write are counted in the run, not only on its stderr."""
    disk, out = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    # a small tmpfs of its own, in a private mount namespace (as root, or as a user namespace's root)
    user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
    script = f'mount -t tmpfs -o size=1m rlreplay-test "$1" && exec "{sys.executable}" -c "$2" "$1" "$3"'
    namespace = ["unshare", *user, "--mount", "--propagation", "private"]
    proc = subprocess.run(
        [*namespace, "sh", "-c", script, "sh", str(disk), FULL_AT_CLOSE, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["acks"] == [True, False]
    stats = report["stats"]
    assert stats["lost"] == 8 and stats["spans"] == 8  # step 1's spans could not be written
    assert rlreplay.open_run(out).counters()["lost"] == stats["lost"]


NOTHING_WRITTEN = LIMITED_JOB + textwrap.dedent(
    """
    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": [i + 1 for i in prompt_ids]}

    with rlreplay.trajectory(step=0, sample_index=0):
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, unlimited))  # full before the first byte
        generate([1, 2, 3])
        ack = rlreplay.flush()  # the writer is idle once it returns
        left = sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("_part-*.partial"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (unlimited, unlimited))
    print(json.dumps({"ack": ack, "live_files": left, "stats": rlreplay.stats()}))
    rlreplay.close()
    """
)


def test_a_live_file_the_full_disk_left_empty_is_removed_at_once(tmp_path: Path) -> None:
    """The disk refuses a live file's first bytes: the empty file is removed while the process
    goes on (before, it stayed until the process closed, and every listing warned about it)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", NOTHING_WRITTEN, str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["ack"] is False and report["stats"]["lost"] >= 1
    assert report["live_files"] == []
