"""Bad input gets one line and exit code 2, never a traceback, and nothing ends without a word:
huge numbers in every numeric option and selector, ``compare`` with nothing to compare, ``show``
given two trajectories, ``sql`` over damaged span files, ``ui`` with a tokenizer that does not load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rlreplay.cli.main import command_group, main

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
HUGE = "9" * 30  # beyond 64 bits
#: Values a person may type for a number, by the option's placeholder.
VALUES = {
    "N": [HUGE, f"-{HUGE}"],
    "SPEC": [HUGE, f"-{HUGE}", f"0..{HUGE}", f"-{HUGE}..{HUGE}", f"1,{HUGE}"],
    "SECONDS": [HUGE, "1e400", "inf", "nan"],
    "VALUE": [HUGE, "1e400", "nan"],
    "SIZE": [HUGE, "1e400"],
    "PORT": [HUGE, f"-{HUGE}"],
    "<int>": [HUGE, f"-{HUGE}"],
    "<float>": [HUGE, "1e400", "nan"],
}
#: Commands that start a job or a server: run as a process (with a deadline), not in this one.
AS_PROCESS = {"record", "replay", "ui", "proxy"}
#: Commands that serve until stopped: still running after a while means the value was taken.
SERVERS = {"ui", "proxy"}


def numeric_options() -> list[tuple[str, str, str]]:
    """(command, option, placeholder) of every option that takes a number, found in the CLI itself."""
    group = command_group([])
    out = []
    for name, command in sorted(group.commands.items()):
        for param in command.params:
            metavar = getattr(param, "metavar", None)
            opts = [o for o in param.opts if o.startswith("--")]
            if metavar in VALUES and opts and opts[0] != "--sort":  # --sort's SPEC names columns
                out.append((name, opts[0], metavar))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-line")
    shutil.copytree(SAMPLE, root / "a")
    shutil.copytree(SAMPLE, root / "b")
    return {"a": root / "a", "b": root / "b", "scratch": root}


def base(command: str, runs: dict[str, Path], tmp: Path) -> list[str]:
    """A command line of ``command`` that runs as it is (each test adds one option)."""
    a, b = str(runs["a"]), str(runs["b"])
    py = [sys.executable, "-c", "pass"]
    return {
        "ls": ["ls", a],
        "stats": ["stats", a],
        "audit": ["audit", a, "--checks", "tool_error"],
        "export": ["export", a, "--out", str(tmp / "out.jsonl"), "--force"],
        "compare": ["compare", a, b],
        "diff": ["diff", "-r", a, "step=1,sample_index=26,rollout_n=0", "step=1,sample_index=26,rollout_n=1"],
        "upload": [
            "upload",
            a,
            "--backend",
            "otlp",
            "--endpoint",
            "http://127.0.0.1:9/v1/traces",
            "--dry-run",
        ],
        "replay": ["replay", a, "--out", str(tmp / "replayed"), "--", *py],
        "record": ["record", "--out", str(tmp / "recorded"), "--", *py],
        "ui": ["ui", a, "--port", "0"],
        "sql": ["sql", a, "SELECT count(*) FROM trajectories"],
        "mismatch": ["mismatch", a],
        "watch": ["watch", a],
        "proxy": ["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--out", str(tmp / "proxied")],
    }[command]


def one_line_or_none(rc: Any, err: str) -> None:
    assert isinstance(rc, int) and rc in (0, 1, 2), (rc, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("rlreplay: error")]
    assert len(errors) <= 1, err
    if rc == 2:
        assert errors, err  # bad input says what is bad


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str], tmp: Path) -> tuple[Any, str]:
    if argv[0] not in AS_PROCESS:
        rc = main(argv)
        return rc, capsys.readouterr().err
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
    )
    try:
        _, err = proc.communicate(timeout=10 if argv[0] in SERVERS else 120)
        return proc.returncode, err
    except subprocess.TimeoutExpired:  # the value was taken: the server runs
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        assert argv[0] in SERVERS and "http://" in out + err, out + err
        return 0, err


@pytest.mark.parametrize(("command", "option", "metavar"), numeric_options())
def test_huge_numbers_in_every_numeric_option(
    command: str,
    option: str,
    metavar: str,
    runs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for value in VALUES[metavar]:
        argv = base(command, runs, tmp_path)
        at = argv.index("--") if "--" in argv else len(argv)
        argv[at:at] = [option, value]
        rc, err = run_cli(argv, capsys, tmp_path)
        one_line_or_none(rc, err)


def test_huge_numbers_in_every_threshold(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from rlreplay.audit import engine

    for key in engine.default_thresholds(engine.available().values()):
        for value in (HUGE, "1e400", "nan"):
            rc = main(["audit", str(runs["a"]), "--threshold", f"{key}={value}"])
            one_line_or_none(rc, capsys.readouterr().err)


@pytest.mark.parametrize("key", ["step", "sample_index", "rollout_n"])
def test_huge_numbers_in_selectors(
    key: str, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a = str(runs["a"])
    for value in (HUGE, f"-{HUGE}"):
        for argv in (["show", a, f"{key}={value}"], ["diff", "-r", a, f"{key}={value}", "step=1"]):
            rc = main(argv)
            err = capsys.readouterr().err
            assert rc == 2 and "matches no trajectory" in err and len(err.splitlines()) == 1, err


def test_huge_keys_a_job_gave_are_selected_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key beyond 64 bits is recorded as its text: every selection names it by its digits."""
    import json

    import rlreplay

    run = tmp_path / "run"
    rlreplay.init(run, experiment="huge", worker="w0")
    for key in (10**30, -(10**30), 5):
        with rlreplay.trajectory(step=key, sample_index=key, rollout_n=key):
            pass
    rlreplay.close()
    capsys.readouterr()
    for value, expected in ((str(10**30), str(10**30)), (str(-(10**30)), str(-(10**30))), ("5", 5)):
        for option in ("--step", "--sample-index", "--rollout-n"):
            assert main(["ls", str(run), option, value, "--json"]) == 0
            rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert [r["step"] for r in rows] == [expected], (option, value)
        assert main(["show", str(run), f"step={value}", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["sample_index"] == expected
    assert main(["ls", str(run), "--step", f"0..{HUGE}", "--json"]) == 0
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [5]
    assert main(["ls", str(run), "--limit", HUGE, "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_huge_numbers_in_the_uis_addresses(runs: dict[str, Path]) -> None:
    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    name = runs["a"].name
    pages = [
        *(
            f"/r/{name}/trajectories?{k}={v}"
            for k in ("step", "sample_index", "rollout_n")
            for v in (HUGE, f"0..{HUGE}")
        ),
        *(f"/r/{name}/trajectories?{k}={HUGE}" for k in ("limit", "page", "per")),
        f"/r/{name}/trajectories?step=1&validate=false&page={HUGE}",
        f"/r/{name}/prompt?sample_index={HUGE}",
        f"/r/{name}/t/{'f' * 200}",
    ]
    with TestClient(create_app(runs["scratch"], poll_ms=60_000)) as client:
        for page in pages:
            status = client.get(page).status_code
            assert status in (200, 400, 404), (page, status)


# ---- compare: nothing to compare is said, and is bad input ---------------------------------------


def test_compare_of_a_run_with_itself_is_refused(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a = runs["a"]
    link = runs["scratch"] / "link-to-a"
    if not link.exists():
        link.symlink_to(a)
    for other in (a, Path(os.path.relpath(a)), link):
        assert main(["compare", str(a), str(other)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "same run" in err, err


def test_compare_without_a_key_in_common_is_refused(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    arith = SAMPLE.parent / "verl-arith-smollm2"
    assert main(["compare", str(arith), str(runs["a"])]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "nothing to compare" in err
    assert main(["compare", str(runs["a"]), str(runs["b"]), "--step", "99"]) == 2
    out, err = capsys.readouterr()
    assert "matches no trajectory" in err and err.count("\n") == 1
    assert main(["compare", str(runs["a"]), str(runs["b"])]) == 0  # a copy pairs everything
    out, _ = capsys.readouterr()
    assert out.splitlines()[0].startswith("136 pairs: 136 same")


def test_show_given_two_trajectories_says_so(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a = str(runs["a"])
    ids = {  # from the span files: (step, sample_index, rollout_n) -> the short id `show` takes
        (r["step"], r["sample_index"], r["rollout_n"]): r["trajectory_id"][:12]
        for f in runs["a"].glob("spans/*/*/*.parquet")
        for r in pq.read_table(f, columns=["trajectory_id", "step", "sample_index", "rollout_n"]).to_pylist()
    }
    one, other = ids[(1, 26, 0)], ids[(1, 26, 1)]
    for first, second in ((one, other), ("step=1,sample_index=26,rollout_n=0", one)):
        assert main(["show", "-r", a, first, second]) == 2
        err = capsys.readouterr().err
        assert "two trajectories" in err and "two runs" not in err and err.count("\n") == 1, err
    # the run given twice is fine; two different runs are two runs
    assert main(["show", "-r", a, a, one, "--no-text"]) == 0
    capsys.readouterr()
    assert main(["show", "-r", a, str(runs["b"]), one]) == 2
    assert "two runs" in capsys.readouterr().err


# ---- sql over damaged span files --------------------------------------------------------------


def test_sql_over_damaged_shards_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Byte changes all over a sealed shard: each query answers, or says in one line why not."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    shard = min(run.glob("spans/*/*/*.parquet"), key=lambda p: p.stat().st_size)
    original = shard.read_bytes()
    queries = [
        "SELECT count(*), sum(length(output)), sum(len(token_ids)) FROM spans",
        "SELECT * FROM spans",
    ]
    step = max(1, len(original) // 80)
    for at in range(0, len(original), step):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        shard.write_bytes(bytes(damaged))
        shutil.rmtree(run / "_run_index", ignore_errors=True)
        for query in queries:
            rc = main(["sql", str(run), query])
            one_line_or_none(rc, capsys.readouterr().err)
    shard.write_bytes(original)


# ---- ui with a tokenizer that does not load ------------------------------------------------------


def test_ui_refuses_a_tokenizer_that_does_not_load(runs: dict[str, Path], tmp_path: Path) -> None:
    for name in (str(tmp_path / "nonexistent"), str(tmp_path)):
        proc = subprocess.run(
            [sys.executable, "-m", "rlreplay", "ui", str(runs["a"]), "--port", "0", "--tokenizer", name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("rlreplay: error:") and proc.stderr.count("\n") == 1, proc.stderr
        assert "rlreplay ui:" not in proc.stdout  # never started serving


# ---- arguments that are not UTF-8, writes the system refuses --------------------------------------


def test_an_argument_that_is_not_utf8_is_one_line(runs: dict[str, Path]) -> None:
    """The bytes reach rlreplay as a terminal passes them (``ls --grep $'\\xff'``)."""
    proc = subprocess.run(
        [sys.executable.encode(), b"-m", b"rlreplay", b"ls", str(runs["a"]).encode(), b"--grep", b"\xff"],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr
        == b"rlreplay: error: argument '\\xff' is not UTF-8 text; rlreplay takes UTF-8 arguments\n"
    )


def value_options() -> list[tuple[str, str]]:
    """(command, option) of every option that takes a value, found in the CLI itself."""
    group = command_group([])
    return [
        (name, next(o for o in param.opts if o.startswith("--")))
        for name, command in sorted(group.commands.items())
        for param in command.params
        if getattr(param, "param_type_name", "") == "option"
        and not getattr(param, "is_flag", False)
        and any(o.startswith("--") for o in param.opts)
        and param.name != "help"
    ]


@pytest.mark.parametrize(("command", "option"), value_options())
def test_bytes_that_are_not_utf8_in_every_option(
    command: str,
    option: str,
    runs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every option of every command given bytes that are not UTF-8 (as Python holds them: surrogates)."""
    try:
        argv = base(command, runs, tmp_path)
    except KeyError:  # a command that takes just the run
        argv = [command, str(runs["a"])]
    at = argv.index("--") if "--" in argv else len(argv)
    argv[at:at] = [option, "abc\udcff"]
    monkeypatch.chdir(tmp_path)  # a relative path, were it taken, lands here
    if command in AS_PROCESS:  # a job or a server, were the value taken: a process with a deadline
        child = [sys.executable, "-m", "rlreplay", *argv]
        proc = subprocess.run([os.fsencode(a) for a in child], capture_output=True, timeout=60)
        rc, err = proc.returncode, os.fsdecode(proc.stderr)
    else:
        rc, err = main(argv), capsys.readouterr().err
    assert rc == 2, err
    assert err == "rlreplay: error: argument 'abc\\xff' is not UTF-8 text; rlreplay takes UTF-8 arguments\n"


def _small_files_only() -> None:
    """A file size limit of 64 KiB, a write past it an error (EFBIG), not a signal."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))


def test_a_write_the_system_refuses_is_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    """The folder takes the file but the system stops the write halfway (a full disk, a quota):
    one line naming the file, and nothing left behind."""
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "export", str(runs["a"]), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_small_files_only,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("rlreplay: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "File too large" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
