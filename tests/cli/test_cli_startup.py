"""What the command-line process imports: each command loads its own module only, ``--help``
loads no pyarrow, and listing to a pipe loads no rich or pandas. Whole processes run as
``python -m rlreplay`` runs, reporting ``sys.modules`` at exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlreplay.cli.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
SAMPLE_TRAJECTORIES = 272


# ``python -m rlreplay ARGS``, writing the names of the modules loaded at exit to $MODULES_OUT
RUN_REPORTING_MODULES = """
import atexit, json, os, runpy, sys
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["rlreplay", *sys.argv[1:]]
runpy.run_module("rlreplay", run_name="__main__")
"""


def run_cli(*args: str, tmp: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``rlreplay ARGS`` as its own process (stdout a pipe), and the modules it had loaded."""
    out = tmp / "modules.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RLREPLAY_DIR", "NO_COLOR")}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_REPORTING_MODULES, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "MODULES_OUT": str(out)},
        timeout=120,
    )
    return proc, set(json.loads(out.read_text()))


def loaded(modules: set[str], *packages: str) -> set[str]:
    return {m for m in modules if m.split(".")[0] in packages}


def test_help_imports_no_pyarrow_and_lists_every_command(tmp_path: Path) -> None:
    proc, modules = run_cli("--help", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert loaded(modules, "pyarrow", "numpy", "pandas", "pydantic", "rich", "duckdb") == set()
    section = proc.stdout.split("Commands:", 1)[1]
    listed = [line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.strip()]
    assert sorted(listed) == sorted(COMMANDS)
    # in the order the command modules register them, as before they loaded lazily
    assert listed == [
        "audit",
        "ls",
        "show",
        "info",
        "recover",
        "compare",
        "diff",
        "export",
        "mismatch",
        "proxy",
        "record",
        "replay",
        "sql",
        "stats",
        "ui",
        "upload",
        "watch",
    ]


def test_each_module_registers_the_commands_it_is_named_for() -> None:
    """The map from command to module is what the modules register (a fresh process imports
    them one at a time and records what each added)."""
    code = """
import importlib, json, sys
from rlreplay.cli.app import app
from rlreplay.cli.main import COMMANDS
out = {}
for module in sorted(set(COMMANDS.values())):
    before = len(app.registered_commands)
    importlib.import_module(f"rlreplay.cli.{module}")
    out[module] = [c.name for c in app.registered_commands[before:]]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    registered = json.loads(proc.stdout)
    expected: dict[str, list[str]] = {}
    for command, module in COMMANDS.items():
        expected.setdefault(module, []).append(command)
    assert {m: sorted(c) for m, c in registered.items()} == {m: sorted(c) for m, c in expected.items()}


@pytest.mark.parametrize("args", [[], ["--json"], ["--step", "5"]], ids=["plain", "json", "step"])
def test_ls_to_a_pipe_imports_no_rich_or_pandas(args: list[str], tmp_path: Path) -> None:
    proc, modules = run_cli("ls", str(SAMPLE_RUN), *args, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert loaded(modules, "rich", "pandas", "duckdb") == set()
    # only the ls command's own module among the command modules
    assert {m for m in modules if m.startswith("rlreplay.cli.")} <= {
        "rlreplay.cli.main",
        "rlreplay.cli.app",
        "rlreplay.cli.browse",
    }
    lines = proc.stdout.splitlines()
    if args == ["--json"]:
        rows = [json.loads(line) for line in lines]
        assert len(rows) == SAMPLE_TRAJECTORIES
    elif args == ["--step", "5"]:
        steps = {line.split()[1] for line in lines[1:-1]}
        assert steps == {"5"} and lines[-1].endswith(f"in {SAMPLE_RUN}")
    else:
        assert len(lines) == SAMPLE_TRAJECTORIES + 2 and lines[0].split()[:2] == ["id", "step"]


# ---- the listing path loads no numpy.ma (``pa.array`` of a numpy array would import it) ----------

V1_RUN = ROOT / "tests" / "fixtures" / "v1-run"  # format 1: indexes built from the spans, a live file
#: Modules a listing command never loads: ``numpy.ma`` (~9 ms).
NOT_ON_THE_LISTING_PATH = {"numpy.ma"}


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "SAMPLE", "--step", "5"],
        ["ls", "SAMPLE", "--where", "reward > 0 and model_calls >= 2", "--sort", "reward desc, duration_s"],
        ["ls", "SAMPLE", "--json", "--rollout-n", "0..1", "--status", "ok"],
        ["stats", "SAMPLE"],
        ["stats", "SAMPLE", "--step", "2..4", "--json"],
        ["ls", "V1"],
        ["ls", "V1", "--step", "1", "--sort", "reward desc", "--limit", "5"],
        ["stats", "V1"],
    ],
    ids=lambda args: " ".join(args),
)
def test_listing_commands_load_no_numpy_ma(args: list[str], tmp_path: Path) -> None:
    run = {"SAMPLE": str(SAMPLE_RUN), "V1": str(V1_RUN)}
    proc, modules = run_cli(*(run.get(a, a) for a in args), tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert modules & NOT_ON_THE_LISTING_PATH == set()
    assert "rlreplay.format.arrow_ops" in modules
    lines = proc.stdout.splitlines()
    if args[0] == "ls" and "--json" in args:
        rows = [json.loads(line) for line in lines]
        assert rows and all(r["rollout_n"] in (0, 1) and r["status"] == "ok" for r in rows)
    elif args[0] == "ls":
        header, body = lines[0].split(), [line.split() for line in lines[1:-1]]
        assert body and header[:2] == ["id", "step"] and lines[-1].endswith(f"in {run[args[1]]}")
        if "--step" in args:
            assert {row[1] for row in body} == {args[args.index("--step") + 1]}
        if "--where" in args:
            rewards = [float(row[header.index("reward")]) for row in body]
            assert rewards == sorted(rewards, reverse=True) and min(rewards) > 0
    elif "--json" in args:
        assert sorted({json.loads(line)["step"] for line in lines}) == [2, 3, 4]
    else:
        assert lines[0].split()[:2] == ["step", "split"] and "trends" in proc.stdout


def test_the_run_index_is_written_and_read_loading_no_numpy_ma(tmp_path: Path) -> None:
    """A run of enough shards for a run index: the first listing writes it, a step's listing reads
    its row groups; neither loads numpy.ma."""
    from rlreplay.format.run_index import RUN_INDEX_DIR, RUN_INDEX_MIN_SHARDS

    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    shards = sorted((run / "spans").glob("step=*/worker=*/part-*.parquet"))
    for copy in range(-(-RUN_INDEX_MIN_SHARDS // len(shards)) - 1):  # each shard again, in another folder
        for shard in shards:
            folder = shard.parent.with_name(f"{shard.parent.name}-copy{copy}")
            folder.mkdir(exist_ok=True)
            for sibling in (shard, shard.with_suffix(".index")):
                shutil.copy2(sibling, folder / sibling.name)
    assert not (run / RUN_INDEX_DIR).exists()
    proc, modules = run_cli("ls", str(run), tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any((run / RUN_INDEX_DIR).iterdir()) and modules & NOT_ON_THE_LISTING_PATH == set()
    assert len(proc.stdout.splitlines()) == SAMPLE_TRAJECTORIES + 2
    proc, modules = run_cli("ls", str(run), "--step", "3", "--sort", "reward desc", tmp=tmp_path)
    assert proc.returncode == 0 and modules & NOT_ON_THE_LISTING_PATH == set(), proc.stderr[-2000:]
    assert {line.split()[1] for line in proc.stdout.splitlines()[1:-1]} == {"3"}
    proc, modules = run_cli("stats", str(run), "--step", "3", "--json", tmp=tmp_path)
    assert proc.returncode == 0 and modules & NOT_ON_THE_LISTING_PATH == set(), proc.stderr[-2000:]
    assert {json.loads(line)["step"] for line in proc.stdout.splitlines()} == {3}


# ``python -m rlreplay ARGS``, writing the OpenBLAS thread setting the process ran with to $SETTING_OUT
RUN_REPORTING_BLAS_THREADS = """
import atexit, os, runpy, sys
setting = lambda: os.environ.get("OPENBLAS_NUM_THREADS", "-")
atexit.register(lambda: open(os.environ["SETTING_OUT"], "w").write(setting()))
sys.argv = ["rlreplay", *sys.argv[1:]]
runpy.run_module("rlreplay", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("args", "given", "expected"),
    [
        (["ls", str(SAMPLE_RUN), "--step", "5"], None, "1"),
        (["stats", str(SAMPLE_RUN)], None, "1"),
        (["ls", str(SAMPLE_RUN), "--step", "5"], "3", "3"),  # the user's own setting stays
        (["--help"], None, "-"),
        (["ls", "--help"], None, "-"),
    ],
)
def test_reading_commands_run_one_openblas_thread(
    args: list[str], given: str | None, expected: str, tmp_path: Path
) -> None:
    out = tmp_path / "setting"
    env = {k: v for k, v in os.environ.items() if k not in ("RLREPLAY_DIR", "OPENBLAS_NUM_THREADS")}
    env["SETTING_OUT"] = str(out)
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    proc = subprocess.run(
        [sys.executable, "-c", RUN_REPORTING_BLAS_THREADS, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text() == expected


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"upload"}))  # upload: its backends' options
def test_a_command_help_imports_no_pyarrow(command: str, tmp_path: Path) -> None:
    proc, modules = run_cli(command, "--help", tmp=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: rlreplay {command} ")
    assert loaded(modules, "pyarrow", "numpy", "pandas", "rich", "duckdb") == set()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_loads_its_module(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"Usage: rlreplay {command} ")


def test_bad_input_of_a_lazily_loaded_command_is_one_line_exit_2(tmp_path: Path) -> None:
    proc, _ = run_cli("ls", str(SAMPLE_RUN), "--limit", "x", tmp=tmp_path)
    assert proc.returncode == 2
    errors = proc.stderr.splitlines()
    assert errors == ["rlreplay: error: --limit: 'x' is not a whole number (digits 0-9)"]
    proc, _ = run_cli("nosuchcommand", tmp=tmp_path)
    errors = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(errors) == 1 and "No such command 'nosuchcommand'" in errors[0]
