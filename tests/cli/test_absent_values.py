"""Absent values print as "-", never Python's "None"; counts agree with their nouns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import rlreplay_proc

from rlreplay.cli.app import plural, shown

RECORD = """
import asyncio, sys
import rlreplay

rlreplay.init(sys.argv[1])  # no experiment


@rlreplay.trace_op(kind="llm")
async def generate(prompt_ids):
    return {"token_ids": [791, 4320, 374]}


async def rollout(sample):
    async with rlreplay.trajectory(step=1, sample_index=sample):  # no rollout_n
        await generate([3838, 374, 220])


async def main():
    await rollout(0)
    await rollout(1)


asyncio.run(main())
rlreplay.close()
"""


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("bare") / "run"
    subprocess.run([sys.executable, "-c", RECORD, str(run)], check=True, timeout=120)
    return run


def _out(*args: str, cwd: Path) -> str:
    done = rlreplay_proc(*args, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_no_none_where_a_key_or_the_experiment_is_absent(bare_run: Path) -> None:
    rows = [
        json.loads(line) for line in _out("ls", "--run", str(bare_run), "--json", cwd=bare_run).splitlines()
    ]
    assert len(rows) == 2 and all(r["rollout_n"] is None and r["experiment"] is None for r in rows)
    a, b = (r["id"] for r in rows)
    show = _out("show", a, "--run", str(bare_run), cwd=bare_run)
    assert "rollout_n=- " in show and "experiment=- " in show
    diff = _out("diff", a, b, "--run", str(bare_run), cwd=bare_run)
    assert diff.count("rollout_n=- ") == 2 and diff.count("experiment=-") == 2
    info = _out("info", "--run", str(bare_run), cwd=bare_run)
    assert any(line.split(":", 1)[0].strip() == "experiment" for line in info.splitlines())
    for text in (show, diff, info):
        assert "None" not in text, text


def test_the_html_report_says_dash_for_an_absent_key(bare_run: Path, tmp_path: Path) -> None:
    ids = [
        json.loads(line)["id"]
        for line in _out("ls", "--run", str(bare_run), "--json", cwd=bare_run).splitlines()
    ]
    report = tmp_path / "report.html"
    _out("diff", *ids, "--run", str(bare_run), "--no-text", "--html", str(report), cwd=bare_run)
    page = report.read_text()
    assert page.count("rollout_n=- ") == 2 and page.count("experiment=-") == 2
    assert "None" not in page


def test_one_row_and_one_trajectory_read_right_in_sql_and_export(bare_run: Path, tmp_path: Path) -> None:
    one = _out("sql", "--run", str(bare_run), "SELECT count(*) AS n FROM trajectories", cwd=bare_run)
    assert one.splitlines()[-1] == "(1 row)"
    two = _out("sql", "--run", str(bare_run), "SELECT id FROM trajectories", cwd=bare_run)
    assert two.splitlines()[-1] == "(2 rows)"
    root, run = Path(__file__).resolve().parents[2], "sample_runs/verl-arith-smollm2"
    for limit, said in (("1", "wrote 1 trajectory to "), ("2", "wrote 2 trajectories to ")):
        out = tmp_path / f"{limit}.jsonl"
        done = rlreplay_proc(
            "export", "--run", run, "--step", "1", "--limit", limit, "--out", str(out), cwd=root
        )
        assert done.returncode == 0 and said in done.stderr, done.stderr


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["tool call", "finding", "model call"]))
def test_plural_agrees_with_the_count(count: int, noun: str) -> None:
    said = plural(count, noun)
    assert said == (f"1 {noun}" if count == 1 else f"{count} {noun}s")
    assert plural(count, "trajectory", "trajectories").endswith(
        "trajectory" if count == 1 else "trajectories"
    )


@given(st.one_of(st.none(), st.integers(), st.text()))
def test_shown_says_dash_only_for_absent(value: object) -> None:
    assert shown(value) == ("-" if value is None else str(value))


def test_counts_of_one_read_right_in_stats_and_ls() -> None:
    root = Path(__file__).resolve().parents[2]
    run = "sample_runs/verl-arith-smollm2"
    rows = [json.loads(line) for line in _out("stats", "--run", run, "--json", cwd=root).splitlines()]
    val = [r for r in rows if r["validate"]]
    assert len(val) == 1  # the sample run validates once
    assert f"trends (val, 1 row, step {val[0]['step']}):" in _out("stats", "--run", run, cwd=root)
    listing = _out("ls", "--run", run, "--limit", "1", cwd=root)
    assert listing.splitlines()[-1] == f"1 trajectory (--limit) in {run}"


def test_one_of_each_reads_right_in_selection_recover_and_diff() -> None:
    from rlreplay.cli.diff import render_group
    from rlreplay.read.selection import Group, describe_groups
    from rlreplay.remote.publish import recover_message

    one = describe_groups([Group(step=3, validate=False, sample_index=0, ids=["a"])])
    assert one == "1 prompt a step × 1 step × 1 rollout (1) = 1 trajectory"
    ones = {"recovered_shards": 1, "recovered_spans": 1, "uploaded": 1, "live_partials": 1, "pending": 1}
    said = recover_message("s3://bucket/run", {**ones, "error": "refused"})
    for phrase in ("1 shard (1 span)", "uploaded 1 file to", "left alone 1 file still", "; 1 file still"):
        assert phrase in said, (phrase, said)

    class Lone:  # a trajectory recorded with no step and no sample index
        step = sample_index = None
        validate = False
        members = ()
        best_id = "0123456789abcdef"

    title = render_group(Lone(), text=False)[0].plain
    assert title.startswith("group step=- sample_index=- train: 0 rollouts;") and "None" not in title
