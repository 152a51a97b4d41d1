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
    proc = rlreplay("--show-completion", "bash")
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
