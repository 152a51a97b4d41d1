"""Command-line conventions a newcomer expects: ``--version``, ``-h``, shell completion."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from support import rlreplay_proc as rlreplay


def test_version() -> None:
    proc = rlreplay("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rlreplay {version('rlreplay')}"


def test_dash_h_is_help_everywhere() -> None:
    for args in ([], ["ls"], ["stats"], ["upload"]):
        short, long = rlreplay(*args, "-h"), rlreplay(*args, "--help")
        assert short.returncode == 0 == long.returncode, short.stderr
        assert short.stdout == long.stdout and "Usage: rlreplay" in short.stdout


def test_shell_completion_script() -> None:
    """Typer names the shell it runs under: run it under bash (not exec'd, so bash is its parent)."""
    import shlex

    cmd = f"{shlex.quote(sys.executable)} -m rlreplay --show-completion; exit $?"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "complete" in proc.stdout and "rlreplay" in proc.stdout


def test_top_level_help_has_whole_one_line_descriptions() -> None:
    proc = rlreplay("--help")
    commands = proc.stdout.split("Commands:")[1].strip().splitlines()
    assert len(commands) >= 11
    for line in commands:
        assert not line.rstrip().endswith("...") and line.rstrip().endswith("."), line


def test_placeholders_say_what_they_take() -> None:
    for command in (
        "ls",
        "show",
        "info",
        "recover",
        "diff",
        "export",
        "record",
        "sql",
        "stats",
        "ui",
        "upload",
    ):
        text = rlreplay(command, "--help").stdout
        usage = text.splitlines()[0]
        assert "[[" not in usage, usage
        options = [line for line in text.split("Options:")[1].splitlines() if line.strip().startswith("-")]
        assert not [line for line in options if "<str>" in line or "<path>" in line], (command, options)


def test_every_reading_command_takes_dash_r() -> None:
    for command in ("audit", "ls", "show", "info", "diff", "export", "sql", "stats", "ui", "upload"):
        assert "-r, --run RUN" in rlreplay(command, "--help").stdout, command


#: Options whose help differs between commands, and the one meaning they share.
SHARED_MEANING = {
    "--columns": "which columns to show (each command lists its own)",
    "--force": "replace the file the command writes",
    "--framework": "the framework adapter",
    "--limit": "at most N of what the command gives (trajectories; sql: the rows its table shows)",
    "--out": "where the command writes (record and replay: a run; export: a file)",
    "-o": "short for --out",
    "--spool": "the spool folder of a URI run",
}


def test_one_meaning_per_option_name() -> None:
    from rlreplay.cli.main import command_group

    helps: dict[str, set[str]] = {}
    for command in command_group([]).commands.values():
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in [o for o in getattr(param, "opts", []) if o.startswith("-")]:
                helps.setdefault(opt, set()).add(getattr(param, "help", None) or "")
    differing = {opt for opt, texts in helps.items() if len(texts) > 1}
    assert differing <= set(SHARED_MEANING), {o: helps[o] for o in differing - set(SHARED_MEANING)}
    assert helps["--no-text"] == {"Compare token ids only; do not decode."}
    assert helps["--experiment"] == {"Only this experiment name."}
    assert helps["--experiment-name"] == {"Experiment name recorded with the run."}
    assert "--ids" not in helps and "--resend" in helps
    assert "--token-ids" in helps


def test_export_ids_is_token_ids_with_a_deprecation_line(tmp_path) -> None:
    from pathlib import Path

    run = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
    assert "--ids" not in rlreplay("export", "--help").stdout.replace("--token-ids", "")
    outputs = {}
    for flag in ("--ids", "--token-ids"):
        out = tmp_path / f"{flag.strip('-')}.jsonl"
        proc = rlreplay("export", str(run), "--step", "2", "--limit", "2", "--out", str(out), flag)
        assert proc.returncode == 0, proc.stderr
        deprecated = [line for line in proc.stderr.splitlines() if "--ids is now --token-ids" in line]
        assert len(deprecated) == (flag == "--ids")
        outputs[flag] = out.read_text()
    assert outputs["--ids"] == outputs["--token-ids"] and '"prompt_ids"' in outputs["--ids"]


#: Options renamed so that one name means one thing: (command, new, old).
RENAMED = (
    ("record", "--experiment-name", "--experiment"),
    ("proxy", "--experiment-name", "--experiment"),
    ("upload", "--resend", "--force"),
    ("diff", "--no-text", "--ids"),
)


def test_help_shows_only_the_new_name_of_a_renamed_option() -> None:
    import re

    for command, new, old in RENAMED:
        text = rlreplay(command, "--help").stdout
        assert re.search(rf"{new}\b", text), (command, new)
        assert not re.search(rf"{old}(?![-\w])", text), (command, old)


def _old_and_new(command: list[str], new: str, old: str) -> dict[str, subprocess.CompletedProcess[str]]:
    return {flag: rlreplay(*[flag if a == new else a for a in command]) for flag in (new, old)}


def test_diff_takes_ids_as_no_text_saying_so() -> None:
    from pathlib import Path

    run = str(Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3")
    got = _old_and_new(
        ["diff", run, "step=5,sample_index=730,rollout_n=0", "rollout_n=1", "--no-text", "--json"],
        "--no-text",
        "--ids",
    )
    assert got["--ids"].returncode == 0 == got["--no-text"].returncode, got["--ids"].stderr
    assert got["--ids"].stdout == got["--no-text"].stdout and '"first_divergence"' in got["--ids"].stdout
    assert "rlreplay: --ids is now --no-text" in got["--ids"].stderr
    assert "is now" not in got["--no-text"].stderr


def test_record_takes_experiment_as_experiment_name(tmp_path) -> None:
    import json

    for flag in ("--experiment-name", "--experiment"):
        out = tmp_path / flag.strip("-")
        proc = rlreplay("record", "--out", str(out), flag, f"exp{flag}", "--", sys.executable, "-c", "pass")
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "run.json").read_text())["experiment"] == f"exp{flag}"
        assert ("rlreplay: --experiment is now --experiment-name" in proc.stderr) == (flag == "--experiment")


def test_the_command_listing_is_the_same_whatever_was_imported_before() -> None:
    """``--help`` (and docs/cli.md made from it) lists commands in one order: a process that used a
    command's module first (a test, a plug-in) lists them as a fresh one does."""
    from rlreplay.cli.main import COMMANDS

    listing = "from rlreplay.cli.main import command_group; print(*command_group([]).commands)"
    orders = []
    for first in ("", *sorted(set(COMMANDS.values()), reverse=True)[:4]):
        code = f"import rlreplay.cli.{first}; {listing}" if first else listing
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        orders.append(proc.stdout.split())
    assert sorted(orders[0]) == sorted(COMMANDS)
    assert all(order == orders[0] for order in orders), orders
