"""Command-line conventions a newcomer expects: ``--version``, ``-h``, shell completion."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def rlreplay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlreplay", *args], capture_output=True, text=True, timeout=120
    )


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
    "--experiment": "the experiment's name (record names it, the others select by it)",
    "--force": "replace what is already there (a file, or the backend's copy for upload)",
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
    assert helps["--ids"] == {"Compare token ids only; do not decode."}
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
