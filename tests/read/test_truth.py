"""Every command tells the same truth: counts, rewards and statuses agree across info, ls, show,
diff and the Python API; show prints text as text; the user's files are never overwritten."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from support import run_cli as cli

import rlreplay
from rlreplay.format import manifest
from rlreplay.format.index import summarize
from rlreplay.model import trajectory_from_table

STATUS_INCOMPLETE = "incomplete"


# ---- a run whose trajectories carry rewards in several places ------------------------------------


class Loop:
    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    async def run(self, reward: float, pause: float) -> dict:
        await asyncio.sleep(pause)
        await self.execute({"x": 1})
        return {"prompt_ids": [1, 2], "response_ids": [3, 4], "reward_score": reward}

    @rlreplay.trace_op(name="Tool.execute", kind="tool")
    async def execute(self, parameters: dict) -> tuple:
        return ({"text": "ok"}, 5.0, {})  # a tool reward never counts


def _record_rewards(run_dir: Path) -> None:
    rlreplay.init(run_dir, experiment="rewards", worker="w0")

    async def go() -> None:
        # two agent spans: the first ends last, with the lower reward
        async with rlreplay.trajectory(step=1, sample_index=0, rollout_n=0, validate=False):
            await asyncio.gather(Loop().run(0.25, 0.03), Loop().run(1.0, 0.0))
        async with rlreplay.trajectory(step=1, sample_index=0, rollout_n=1, validate=False):
            await Loop().run(0.5, 0.0)

    asyncio.run(go())
    rlreplay.close()


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("truth") / "rewards"
    _record_rewards(path)
    return path


def _signals_row(table: pa.Table, reward: float) -> pa.Table:
    """A ``signals`` row as another process writes it: same trajectory, later, its own span id."""
    row = table.slice(0, 1).to_pylist()[0]
    end = max(table["end_ns"].to_pylist())
    row.update(
        span_id="f" * 16,
        parent_id=None,
        name="signals",
        kind="signals",
        start_ns=end + 1,
        end_ns=end + 2,
        reward=reward,
        inputs=None,
        output=None,
        attributes=None,
    )
    return pa.concat_tables([table, pa.Table.from_pylist([row], schema=table.schema)])


def test_reward_is_the_latest_ending_agent_reward_in_listing_and_api(reward_run: Path) -> None:
    run = rlreplay.open_run(reward_run)
    rows = {r["rollout_n"]: r for r in run.trajectories().to_pylist()}
    assert rows[0]["reward"] == 0.25  # the later-ending agent span, not the larger reward
    assert rows[1]["reward"] == 0.5
    for r in rows.values():
        assert run.trajectory(r["id"]).reward == r["reward"]


def test_listing_and_trajectory_agree_on_signals_and_missing_roots(reward_run: Path) -> None:
    run = rlreplay.open_run(reward_run)
    for tid in run.trajectories()["id"].to_pylist():
        spans = run.spans(trajectory_id=tid)
        signalled = _signals_row(spans, 0.75)
        rootless = spans.filter(pa.compute.not_equal(spans["kind"], "trajectory"))
        for table, reward, status in [
            (signalled, 0.75, "ok"),  # a signals span wins over agent spans
            (rootless, None, STATUS_INCOMPLETE),
        ]:
            listed = summarize(table).to_pylist()[0]
            traj = trajectory_from_table(table)
            assert (traj.status, listed["status"]) == (status, status)
            if reward is not None:
                assert traj.reward == listed["reward"] == reward
            else:
                assert traj.reward == listed["reward"]


def test_roots_are_found_in_linear_time_on_a_wide_trajectory(reward_run: Path) -> None:
    run = rlreplay.open_run(reward_run)
    traj = run.trajectory(run.trajectories()["id"][1].as_py())
    template = traj.spans[-1]
    calls = 0

    class CountingSpans(list):
        def __iter__(self):
            nonlocal calls
            calls += 1
            return super().__iter__()

    from dataclasses import replace

    wide = [replace(template, span_id=f"{i:016x}", children=[]) for i in range(2000)]
    traj.spans = CountingSpans([*traj.spans, *wide])
    roots = traj.roots
    assert len(roots) == 1 and roots[0].kind == "trajectory"
    assert calls <= 3  # a constant number of passes over the spans, not one per span


# ---- info: counts equal the spans on disk ----------------------------------------------------------


def _info(capsys: pytest.CaptureFixture[str], run_dir: Path) -> dict:
    rc, out, err = cli(capsys, "info", run_dir, "--json")
    assert rc == 0, err
    return json.loads(out)


def _truth(run_dir: Path) -> tuple[int, int, int]:
    run = rlreplay.open_run(run_dir)
    spans = run.spans()
    return run.trajectories().num_rows, spans.num_rows, len(set(spans["step"].to_pylist()))


def test_info_counts_the_spans_on_disk_not_the_workers_counters(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(recorded_run, run_dir)
    trajectories, spans, steps = _truth(run_dir)
    for path in (run_dir / manifest.WORKERS_DIR).glob("*.json"):
        counters = json.loads(path.read_text())
        counters["spans"] = 4  # a counter file written before the last batches reached disk
        path.write_text(json.dumps(counters))
    info = _info(capsys, run_dir)
    assert (info["trajectories"], info["spans"], info["steps"]) == (trajectories, spans, steps)
    assert info["spans_written"] == 4
    rc, out, _ = cli(capsys, "ls", run_dir, "--json")
    assert len(out.splitlines()) == info["trajectories"]

    shutil.rmtree(run_dir / manifest.WORKERS_DIR)  # a run copied without its counters
    info = _info(capsys, run_dir)
    assert (info["trajectories"], info["spans"]) == (trajectories, spans)
    rc, out, _ = cli(capsys, "info", run_dir)
    assert rc == 0
    assert f"spans: {spans}" in " ".join(out.split())


def test_info_mid_run_counts_what_the_live_files_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "live"
    rlreplay.init(run_dir, experiment="live", worker="w0")
    try:

        async def go() -> None:
            for n in range(3):
                async with rlreplay.trajectory(step=0, sample_index=0, rollout_n=n, validate=False):
                    await Loop().run(0.1, 0.0)

        asyncio.run(go())
        assert rlreplay.flush()
        trajectories, spans, _ = _truth(run_dir)
        assert spans == 3 * 3
        info = _info(capsys, run_dir)
        assert (info["trajectories"], info["spans"]) == (trajectories, spans)
    finally:
        rlreplay.close()


# ---- show: the run first, text as text, counts named as everywhere ---------------------------------

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
TOOL_ROLLOUT = "step=5,sample_index=730,rollout_n=1"


def test_show_takes_the_run_first_like_ls_and_info(capsys: pytest.CaptureFixture[str]) -> None:
    run = rlreplay.open_run(SAMPLE)
    tid = run.trajectories(step=5, sample_index=730, rollout_n=1)["id"][0].as_py()
    shown = [
        cli(capsys, *args)
        for args in [
            ("show", SAMPLE, tid[:10], "--no-text"),
            ("show", tid[:10], "--run", SAMPLE, "--no-text"),
            ("show", "-r", SAMPLE, tid, "--no-text"),
            ("show", SAMPLE, TOOL_ROLLOUT, "--no-text"),  # a selector, as diff takes
        ]
    ]
    for rc, out, err in shown:
        assert rc == 0, err
        assert out == shown[0][1]
    rc, out, err = cli(capsys, "show", SAMPLE, tid, "--run", SAMPLE.parent)
    assert rc == 2 and len(err.splitlines()) == 1 and "two runs given" in err


def test_show_prints_text_as_text_and_the_listing_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "show", SAMPLE, TOOL_ROLLOUT)
    assert rc == 0, err
    assert "\\n" not in out  # line breaks are line breaks, in the tree and in the conversation
    tree, conversation = out.split("conversation (")
    tree_lines = [line.strip("│├└─ ") for line in tree.splitlines()]
    assert "I will compute it step by step." in tree_lines  # one line of a decoded text, on its own
    spans = rlreplay.open_run(SAMPLE).spans(step=5, sample_index=730, rollout_n=1).to_pylist()
    llm = sum(s["kind"] == "llm" for s in spans)
    tools = sum(s["kind"] == "tool" for s in spans)
    errors = sum(s["kind"] == "tool" and s["status"] == "error" for s in spans)
    assert f"model_calls={llm} tool_calls={tools} tool_errors={errors}" in tree
    said = f"{llm} model call{'s' * (llm != 1)}, {tools} tool call{'s' * (tools != 1)})"  # 1 call, 2 calls
    assert conversation.startswith(said)
    assert " turns" not in out
    rc, out, _ = cli(capsys, "show", SAMPLE, TOOL_ROLLOUT, "--json", "--no-text")
    data = json.loads(out)
    assert (data["model_calls"], data["tool_calls"], data["tool_errors"]) == (llm, tools, errors)


# ---- diff: the same counts; the report never overwrites the user's files ---------------------------

PAIR = ("step=5,sample_index=730,rollout_n=0", "rollout_n=1")


def _span_counts(run_dir: Path, tid: str) -> tuple[int, int, int]:
    spans = rlreplay.open_run(run_dir).spans(trajectory_id=tid).to_pylist()
    tools = [s for s in spans if s["kind"] == "tool"]
    return (
        sum(s["kind"] == "llm" for s in spans),
        len(tools),
        sum(s["status"] == "error" for s in tools),
    )


def test_diff_counts_are_the_listing_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "diff", "--run", SAMPLE, *PAIR, "--json", "--no-text")
    assert rc == 0, err
    got = json.loads(out)
    for side in (got["a"], got["b"]):
        counts = (side["model_calls"], side["tool_calls"], side["tool_errors"])
        assert counts == _span_counts(SAMPLE, side["id"])
        assert not {"turns", "model_turns", "tool_turns"} & side.keys()
    rc, out, _ = cli(capsys, "diff", "--run", SAMPLE, *PAIR, "--no-text")
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.strip()}
    assert rows["model_calls"] == [str(got["a"]["model_calls"]), str(got["b"]["model_calls"])]
    assert rows["tool_calls"] == [str(got["a"]["tool_calls"]), str(got["b"]["tool_calls"])]
    assert "turns (" not in out and "model turns" not in out
    rc, out, _ = cli(capsys, "diff", "--run", SAMPLE, "--group", PAIR[0], "--no-text", "--json")
    for member in json.loads(out)["rollouts"]:
        assert (member["model_calls"], member["tool_calls"], member["tool_errors"]) == _span_counts(
            SAMPLE, member["id"]
        )


@pytest.fixture
def sample_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(SAMPLE, dest)
    return dest


def _bad(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    rc, out, err = cli(capsys, *args)
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("rlreplay: error: "), err
    return err


def test_html_report_never_writes_into_a_run_or_over_a_file(
    sample_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p: p.read_bytes() for p in sample_copy.rglob("*") if p.is_file()}
    shard = next(sample_copy.rglob("*.parquet"))
    outside = tmp_path / "reports"
    outside.mkdir()
    (outside / "link-to-manifest.html").symlink_to(sample_copy / "run.json")
    (outside / "link-to-run").symlink_to(sample_copy)
    for target, words in [
        (sample_copy / "run.json", "inside the run directory"),
        (shard, "inside the run directory"),
        (sample_copy / "new-report.html", "inside the run directory"),
        (outside / "link-to-manifest.html", "inside the run directory"),
        (outside / "link-to-run" / "report.html", "inside the run directory"),
        (outside, "is a directory"),
        (tmp_path / "missing" / "report.html", "no directory"),
    ]:
        for force in ([], ["--force"]):
            err = _bad(capsys, "diff", "--run", sample_copy, *PAIR, "--no-text", "--html", target, *force)
            assert words in err, err
    assert {p: p.read_bytes() for p in sample_copy.rglob("*") if p.is_file()} == before

    report = outside / "report.html"
    report.write_text("mine")
    assert "--force" in _bad(capsys, "diff", "--run", sample_copy, *PAIR, "--no-text", "--html", report)
    assert report.read_text() == "mine"
    rc, _, err = cli(capsys, "diff", "--run", sample_copy, *PAIR, "--no-text", "--html", report, "--force")
    assert rc == 0, err
    assert report.read_text().startswith("<!DOCTYPE html>")
    fresh = outside / "fresh.html"
    rc, _, err = cli(capsys, "diff", "--run", sample_copy, *PAIR, "--no-text", "--html", fresh)
    assert rc == 0 and fresh.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in outside.iterdir()) == [
        "fresh.html",
        "link-to-manifest.html",
        "link-to-run",
        "report.html",
    ]


@pytest.mark.parametrize(
    "selector", ["step=５,sample_index=730", "step=5,sample_index=７３０", "rollout_n=٣"]
)
def test_selectors_take_ascii_digits_only(selector: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(capsys, "diff", "--run", SAMPLE, "--group", selector, "--no-text")
    assert "ASCII digits" in err


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------


def test_record_out_that_cannot_be_a_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    err = _bad(capsys, "record", "--out", a_file, "--", "true")
    assert "not a directory" in err and a_file.read_text() == "mine"
    err = _bad(capsys, "record", "--out", "/proc/rlreplay-run", "--", "true")
    assert "/proc/rlreplay-run" in err


def test_max_bytes_too_large_is_bad_input(sample_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(capsys, "upload", sample_copy, "--backend", "mlflow", "--max-bytes", "9" * 400, "--dry-run")
    assert "--max-bytes" in err and "too large" in err


# ---- the Python API as the README documents it -------------------------------------------------------


def test_documented_modules_are_reachable_after_import_rlreplay() -> None:
    import subprocess
    import sys

    code = (
        "import sys, rlreplay\n"
        "assert 'rlreplay.text.conversation' not in sys.modules\n"
        "from rlreplay.text.conversation import turns\n"
        "from rlreplay.text.adapters import turns as documented_before\n"
        "assert documented_before is turns\n"
        "from rlreplay.text.token2text import Decoder\n"
        "print(turns.__name__, Decoder.__name__)\n"
        "assert not hasattr(rlreplay, 'no_such_module')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["turns", "Decoder"]


def test_trajectory_text_true_decodes(tmp_path: Path) -> None:
    run = rlreplay.open_run(SAMPLE)
    tid = run.trajectories(step=5, sample_index=730, rollout_n=1)["id"][0].as_py()
    plain = run.trajectory(tid)
    agent = next(s for s in plain.spans if s.kind == "agent")
    assert "response_text" not in agent.output
    decoded = run.trajectory(tid, text=True)
    agent = next(s for s in decoded.spans if s.kind == "agent")
    assert agent.output["response_text"].startswith("<think>\nThe question asks:")
    assert [t["role"] for t in agent.output["conversation"]][:2] == ["prompt", "assistant"]
    other = tmp_path / "run"
    shutil.copytree(SAMPLE, other)
    manifest.update_manifest(other, tokenizer=None, tokenizer_files=None)
    with pytest.raises(rlreplay.RunError, match="no tokenizer"):
        rlreplay.open_run(other).trajectory(tid, text=True)


def test_info_text_and_json_agree(capsys: pytest.CaptureFixture[str]) -> None:
    info = _info(capsys, SAMPLE)
    rc, out, _ = cli(capsys, "info", SAMPLE)
    assert rc == 0
    shown = {k.strip(): v.strip() for k, _, v in (line.partition(": ") for line in out.splitlines())}
    assert "recorder" in shown  # the counters are introduced as such
    for key, value in info.items():
        assert shown[key] == str(value), key


def test_record_writes_the_on_disk_counts_into_the_manifest(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            """
            import rlreplay

            @rlreplay.trace_op(kind="llm")
            def generate(prompt_ids):
                return {"token_ids": [x + 1 for x in prompt_ids]}

            for n in range(3):
                with rlreplay.trajectory(step=1, sample_index=0, rollout_n=n):
                    generate([1, 2, 3])
            """
        )
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "record", "--out", str(out), "--", sys.executable, str(job)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / manifest.MANIFEST).read_text())
    run = rlreplay.open_run(out)
    assert (
        (data["trajectories"], data["spans"]) == (run.trajectories().num_rows, run.spans().num_rows) == (3, 6)
    )
    assert data["dropped"] == data["lost"] == 0


def test_show_with_only_a_run_asks_for_the_trajectory(capsys: pytest.CaptureFixture[str]) -> None:
    assert "give a trajectory after the run" in _bad(capsys, "show", SAMPLE)
    assert "give trajectory A after the run" in _bad(capsys, "diff", SAMPLE)
    err = _bad(capsys, "diff", "--run", SAMPLE, "step=5", "rollout_n=1", "rollout_n=2")
    assert "unexpected argument 'rollout_n=2'" in err


def test_info_counts_steps_recorded_as_strings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "keys"
    rlreplay.init(run_dir, experiment="keys", worker="w0")

    async def go() -> None:
        for step in (1, "warmup", "warmup"):
            async with rlreplay.trajectory(step=step, sample_index=0, rollout_n=0, validate=False):
                await Loop().run(0.1, 0.0)

    asyncio.run(go())
    rlreplay.close()
    info = _info(capsys, run_dir)
    assert (info["steps"], info["trajectories"]) == (2, 3)


def test_selectors_pick_keys_recorded_as_strings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "keys"
    rlreplay.init(run_dir, experiment="keys", worker="w0")

    async def go() -> None:
        for n, reward in ((0, 0.0), (1, 1.0)):
            async with rlreplay.trajectory(step=2, sample_index="s1-3", rollout_n=n, validate=False):
                await Loop().run(reward, 0.0)

    asyncio.run(go())
    rlreplay.close()
    rc, out, err = cli(capsys, "diff", run_dir, "sample_index=s1-3,rollout_n=0", "rollout_n=1", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert (got["a"]["sample_index"], got["b"]["sample_index"]) == ("s1-3", "s1-3")
    assert got["deltas"]["reward"] == 1.0
    rc, out, err = cli(capsys, "show", run_dir, "sample_index=s1-3,rollout_n=1", "--json")
    assert rc == 0, err
    assert json.loads(out)["sample_index"] == "s1-3"
