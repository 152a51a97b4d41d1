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
