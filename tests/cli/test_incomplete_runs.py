"""Bad input and damaged runs: a run that cannot be read in full makes every reading command say so
with counts (``audit`` exits 2); a command that never started, or an upload that never reached its
server, leaves nothing behind; a broken audit check plug-in is one line and skipped, and audit's
exit codes stay 0 clean / 1 findings / 2 could not run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support import qwen_tokenizer_dir, rlreplay_proc

from rlreplay.format import index as tindex
from rlreplay.shards.layout import list_files

JOB = textwrap.dedent(
    """
    import asyncio, sys, rlreplay

    rlreplay.init(sys.argv[1], experiment="damaged", worker="w0")

    @rlreplay.trace_op(name="generate", kind="llm")
    async def generate(prompt_ids):
        return {"token_ids": [p + 1 for p in prompt_ids], "log_probs": [-0.5] * len(prompt_ids)}

    @rlreplay.trace_op(name="agent", kind="agent")
    async def agent(s):
        out = await generate(list(range(s, s + 20)))
        return {"prompt_ids": list(range(s, s + 20)), "response_ids": out["token_ids"], "reward_score": 0.5}

    async def one(s, n):
        async with rlreplay.trajectory(step=0, sample_index=s, rollout_n=n, name="agent_loop"):
            await agent(s)

    async def go():
        await asyncio.gather(*(one(s, n) for s in range(3) for n in range(2)))

    asyncio.run(go())
    rlreplay.close()
    """
)


cli = partial(rlreplay_proc, columns=200)


@pytest.fixture(scope="module")
def one_shard_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one sealed shard (6 trajectories, 18 spans), recorded by the real recorder."""
    run_dir = tmp_path_factory.mktemp("incomplete") / "run"
    subprocess.run([sys.executable, "-c", JOB, str(run_dir)], check=True, timeout=120)
    return run_dir


@pytest.fixture
def damaged(one_shard_run: Path, tmp_path: Path) -> tuple[Path, str, int, int]:
    """A copy of the run whose only shard has a changed byte in its trajectory ids: (run, the shard's
    path in the run, its spans, its trajectories)."""
    run_dir = tmp_path / "run"
    shutil.copytree(one_shard_run, run_dir)
    (shard,) = list_files(run_dir)[0]
    table = pq.read_table(shard)
    pf = pq.ParquetFile(shard)
    column = pf.metadata.row_group(0).column(pf.schema_arrow.get_field_index("trajectory_id"))
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(shard.read_bytes())
    data[start + column.total_compressed_size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    ids = set(table["trajectory_id"].to_pylist())
    return run_dir, shard.relative_to(run_dir).as_posix(), table.num_rows, len(ids)


def _says_incomplete(stderr: str, rel: str, spans: int, trajectories: int) -> None:
    assert "Traceback" not in stderr, stderr
    assert rel in stderr, stderr
    assert "could not be read in full: 1 of the 1 span files read was unreadable" in stderr, stderr
    assert f"{spans} spans of {trajectories} trajectories left out" in stderr, stderr


def test_audit_of_a_run_it_cannot_read_in_full_exits_2(damaged: tuple[Path, str, int, int]) -> None:
    run_dir, rel, spans, trajectories = damaged
    proc = cli("audit", str(run_dir))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    _says_incomplete(proc.stderr, rel, spans, trajectories)
    assert "not in full" in proc.stdout
    proc = cli("audit", str(run_dir), "--json")
    assert proc.returncode == 2 and rel in proc.stderr


def test_info_says_what_it_could_not_read_beside_the_recorders_counts(
    damaged: tuple[Path, str, int, int],
) -> None:
    run_dir, rel, spans, trajectories = damaged
    proc = cli("info", str(run_dir), "--json")
    assert proc.returncode == 0
    info = json.loads(proc.stdout)
    assert info["spans"] == 0 and info["spans_written"] == spans  # now said, with the file named
    assert info["unreadable_files"] == 1 and info["unverified_files"] == 0
    _says_incomplete(proc.stderr, rel, spans, trajectories)
    text = cli("info", str(run_dir))
    assert "unreadable_files: 1" in text.stdout
    _says_incomplete(text.stderr, rel, spans, trajectories)


@pytest.mark.parametrize(
    "args",
    [
        ("sql", "{run}", "SELECT count(*) AS n FROM spans"),
        ("export", "{run}", "--out", "{tmp}/out.jsonl", "--tokenizer", "{tokenizer}"),
        ("ls", "{run}", "--finding", "empty_response"),
        ("diff", "{run}", "step=0,sample_index=0,rollout_n=0", "rollout_n=1", "--no-text"),
        ("upload", "{run}", "-b", "otlp", "--endpoint", "http://127.0.0.1:9/v1/traces", "--dry-run"),
        ("compare", "{run}", "{intact}"),
        ("compare", "{intact}", "{run}"),
        ("mismatch", "{run}"),
        ("ls", "{run}", "--grep", "0", "--tokenizer", "{tokenizer}"),
    ],
    ids=lambda a: "-".join(a[:1] + tuple(x for x in a[1:] if x.startswith("--"))),
)
def test_every_reading_command_says_the_run_cannot_be_read_in_full(
    damaged: tuple[Path, str, int, int], one_shard_run: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    run_dir, rel, spans, trajectories = damaged
    names = {"run": run_dir, "tmp": tmp_path, "tokenizer": qwen_tokenizer_dir(), "intact": one_shard_run}
    proc = cli(*(a.format(**names) for a in args), cwd=tmp_path)
    # diff with nothing to compare: one line, exit 2; upload: what it could not send, exit 1
    assert proc.returncode in (0, 1, 2), proc.stderr
    _says_incomplete(proc.stderr, rel, spans, trajectories)


def test_show_of_a_trajectory_in_a_damaged_file_is_one_line_naming_it(
    damaged: tuple[Path, str, int, int],
) -> None:
    run_dir, rel, _, _ = damaged
    listed = cli("ls", str(run_dir), "--json")
    assert listed.returncode == 0 and listed.stderr == ""  # the listing comes from its index: intact
    first = json.loads(listed.stdout.splitlines()[0])["id"]
    proc = cli("show", str(run_dir), first)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("rlreplay: error: trajectory") and rel in lines[-1]


def test_listing_says_so_when_the_shard_and_its_index_are_both_unreadable(
    damaged: tuple[Path, str, int, int],
) -> None:
    run_dir, rel, _, _ = damaged
    sidecar = tindex.index_path(run_dir / rel)
    sidecar.write_bytes(sidecar.read_bytes()[:-40])
    for command in ("ls", "stats"):
        proc = cli(command, str(run_dir))
        assert proc.returncode == 0 and rel in proc.stderr, proc.stderr
        assert "could not be read in full: 1 of the 1 span files read was unreadable" in proc.stderr
        assert "left out" not in proc.stderr  # no index tells how much


def test_record_of_a_command_that_cannot_start_leaves_no_run(tmp_path: Path) -> None:
    runs = tmp_path / "rlreplay-runs"
    for command in (["/nonexistent/binary"], [str(tmp_path)], ["no-such-program-xyz", "--flag"]):
        proc = cli("record", "--", *command, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not runs.exists(), list(runs.rglob("*"))
    out = tmp_path / "given" / "run"
    proc = cli("record", "--out", str(out), "--", "/nonexistent/binary", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "given").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("record", "--out", str(empty), "--", "/nonexistent/binary", cwd=tmp_path)
    assert proc.returncode == 2 and empty.is_dir() and list(empty.iterdir()) == []


def test_record_of_a_program_the_system_cannot_run_leaves_no_run(tmp_path: Path) -> None:
    """Found and executable, yet exec refuses it (no interpreter line): the run made for it goes."""
    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x00\x01binary junk, no #! line\n")
    program.chmod(0o755)
    proc = cli("record", "--out", str(tmp_path / "run"), "--", str(program), cwd=tmp_path)
    assert proc.returncode == 2 and "cannot be started" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_record_of_a_program_that_cannot_run_leaves_no_tokenizer_copy(tmp_path: Path) -> None:
    """The tokenizer files kept before the job started go with the run made for it."""
    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x00\x01binary junk, no #! line\n")
    program.chmod(0o755)
    out = tmp_path / "run"
    proc = cli(
        "record",
        "--out",
        str(out),
        "--tokenizer",
        str(qwen_tokenizer_dir()),
        "--",
        str(program),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "cannot be started" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())


#: ``rlreplay`` in a child whose file system refuses to remove a run's manifest (an audit hook
#: raising where ``os.remove`` would run: a directory the user may write but not delete from).
UNREMOVABLE_MANIFEST = textwrap.dedent(
    """
    import sys

    def refuse(event, args):
        if event == "os.remove" and str(args[0]).endswith("run.json"):
            raise PermissionError(13, "Permission denied", str(args[0]))

    sys.addaudithook(refuse)
    from rlreplay.cli.main import main

    sys.exit(main(sys.argv[1:]))
    """
)


def test_a_run_whose_command_never_started_and_cannot_be_removed_is_marked_not_started(
    tmp_path: Path,
) -> None:
    from rlreplay.format import manifest

    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x00\x01binary junk, no #! line\n")
    program.chmod(0o755)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", UNREMOVABLE_MANIFEST, "record", "--out", str(run_dir), "--", str(program)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "cannot be started" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [manifest.MANIFEST]  # all else went
    assert manifest.read_manifest(run_dir)["status"] == "not started"
    assert manifest.read_manifest(run_dir)["ended_at"] is not None


def test_an_upload_that_never_reached_its_server_leaves_no_ledger(
    one_shard_run: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(one_shard_run, run_dir)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    proc = cli(
        "upload",
        str(run_dir),
        "-b",
        "otlp",
        "--endpoint",
        f"http://127.0.0.1:{port}/v1/traces",
        "--timeout",
        "2",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert not (run_dir / "_uploads").exists()


BROKEN_CHECKS = {
    "broken_import.py": "raise ImportError('this plug-in needs a package that is not installed')\n",
    "not_a_check.py": "CHECK = 42\n",
    "raises_in_run.py": textwrap.dedent(
        """
        from rlreplay.audit.finding import LEVEL_TRAJECTORY, OVER_TRAJECTORIES, Check

        def run(traj, ctx):
            raise RuntimeError("a bug in the check")
            yield

        CHECK = Check("raises_in_run", OVER_TRAJECTORIES, LEVEL_TRAJECTORY, "always raises", run)
        """
    ),
}


@pytest.fixture
def broken_plugins(tmp_path: Path) -> dict[str, str]:
    """A distribution on PYTHONPATH registering three broken audit checks as entry points."""
    site = tmp_path / "site"
    dist = site / "brokenchecks-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenchecks\nVersion: 0.1\n")
    points = "".join(f"{name[:-3]} = {name[:-3]}:CHECK\n" for name in BROKEN_CHECKS)
    (dist / "entry_points.txt").write_text("[rlreplay.checks]\n" + points)
    for name, text in BROKEN_CHECKS.items():
        (site / name).write_text(text)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_a_broken_check_plug_in_is_one_line_and_skipped(one_shard_run: Path, broken_plugins: dict) -> None:
    proc = cli("audit", str(one_shard_run), "--fail-on", "none", env=broken_plugins)
    assert proc.returncode == 0, proc.stderr  # clean: the broken plug-ins are skipped, not findings
    assert "Traceback" not in proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("rlreplay: warning: check ")]
    assert len(warned) == 3 and all(len(line) < 400 for line in warned), proc.stderr
    assert "broken_import skipped" in proc.stderr and "not_a_check skipped" in proc.stderr
    assert "check raises_in_run failed" in proc.stderr and "a bug in the check" in proc.stderr
    assert re.search(r"raises_in_run +failed \(RuntimeError: a bug in the check\)", proc.stdout)
    assert re.search(r"tool_error +0 findings", proc.stdout), proc.stdout


def test_audit_exit_codes_are_0_clean_1_findings_2_could_not_run(
    one_shard_run: Path, damaged: tuple[Path, str, int, int], broken_plugins: dict
) -> None:
    clean = cli("audit", str(one_shard_run), "--checks", "empty_response,tool_error")
    assert clean.returncode == 0, (clean.stdout, clean.stderr)
    findings = cli("audit", str(one_shard_run), "--checks", "group_collapse", "--fail-on", "group_collapse")
    assert findings.returncode == 1, (findings.stdout, findings.stderr)  # every group has one reward
    for args in (
        ("--checks", "no_such_check"),
        ("--checks", "broken_import"),  # named, and broken: it could not run
        ("--fail-on", "not_a_check"),
        ("--checks", "raises_in_run,tool_error"),
    ):
        proc = cli("audit", str(one_shard_run), *args, env=broken_plugins)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert cli("audit", str(damaged[0]), "--fail-on", "none").returncode == 2


def test_stats_from_an_intact_index_are_the_recorded_ones(
    damaged: tuple[Path, str, int, int], one_shard_run: Path
) -> None:
    """``stats`` and ``ls`` read only the index files: an intact index gives the numbers as recorded
    (the intact run's), and no span file was left unread, so nothing is said."""
    run_dir, _, _, _ = damaged
    for args in (("stats", "--json"), ("stats",), ("ls", "--json")):
        got, want = cli(args[0], str(run_dir), *args[1:]), cli(args[0], str(one_shard_run), *args[1:])
        assert got.returncode == want.returncode == 0 and got.stderr == want.stderr == "", got.stderr
        assert got.stdout == want.stdout.replace(str(one_shard_run), str(run_dir)) and got.stdout, args


def test_the_ui_says_the_run_cannot_be_read_in_full(damaged: tuple[Path, str, int, int]) -> None:
    """The web UI's pages that read spans: the trajectory page names the damaged file, and the
    overview then carries the line of counts."""
    from starlette.testclient import TestClient

    from rlreplay.read.run import Run
    from rlreplay.ui.app import create_app

    run_dir, rel, spans, trajectories = damaged
    first = Run(run_dir).trajectories()["id"][0].as_py()
    with TestClient(create_app(run_dir), raise_server_exceptions=False) as client:
        page = client.get(f"/r/{run_dir.name}/t/{first}")
        assert page.status_code in (404, 400, 500) and rel in page.text, page.text
        overview = client.get(f"/r/{run_dir.name}/")
        assert overview.status_code == 200
        text = " ".join(overview.text.split())
        assert rel in text and "could not be read in full" in text, text
        assert f"{spans} spans of {trajectories} trajectories left out" in text, text
