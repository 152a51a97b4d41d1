"""Starting the recorded command: its environment (recording on in every process) and signal forwarding."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from rlreplay import settings
from rlreplay.cli.app import MAX_SECONDS
from rlreplay.errors import CommandNotStarted
from rlreplay.recorder.matchers import DEFAULT_MATCH_ON as MATCHERS_BY_DEFAULT

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: ``--framework auto``: the run names ``verl`` when the job traced through verl's rollout tracing
#: (``rlreplay.recorders.verl`` writes it), else ``generic``.
AUTO_FRAMEWORK = "auto"
DEFAULT_FRAMEWORK = AUTO_FRAMEWORK

FrameworkOption = Annotated[
    str,
    typer.Option(
        "--framework",
        metavar="NAME",
        help="Framework adapter (entry-point group rlreplay.adapters): verl, generic, ...; "
        "auto (default): verl when the job traces through verl, else generic.",
    ),
]


def argv_framework(framework: str) -> str:
    """The adapter that reads the command line: verl's Hydra overrides under ``auto``."""
    name = framework.strip().lower()
    return "verl" if name == AUTO_FRAMEWORK else name


GraceOption = Annotated[
    float,
    typer.Option(
        "--grace",
        min=0,
        max=MAX_SECONDS,
        metavar="SECONDS",
        help="Seconds to wait for worker processes to seal their files.",
    ),
]
OutOption = Annotated[
    str | None,
    typer.Option(
        "--out",
        "-o",
        metavar="RUN",
        help="New run directory, or a URI such as s3://bucket/prefix/run or gs://... "
        "(default: ./rlreplay-runs/<time>-<name>).",
    ),
]
# replaying: ``rlreplay replay`` and ``rlreplay proxy --replay``
OnDivergeOption = Annotated[
    str,
    typer.Option(
        "--on-diverge",
        metavar="WHAT",
        help="When a call cannot be served from the recording (other inputs, an output not kept as "
        "the op returned it, a source that cannot be read): live (it and the rest of its trajectory "
        "run live; through the proxy, the upstream answers) or fail (the call raises, and replay "
        "exits 1; through the proxy, HTTP 409 with the reason).",
    ),
]
MatchOnOption = Annotated[
    str,
    typer.Option(
        "--match-on",
        metavar="MATCHERS",
        help="What a call must share with its recorded one to be served: position (the k-th call "
        "of its kind), name, inputs (per-call ids aside).",
    ),
]
DEFAULT_ON_DIVERGE = "live"
DEFAULT_MATCH_ON = ",".join(MATCHERS_BY_DEFAULT)


def bootstrap_dir() -> Path:
    import rlreplay.recorders

    return Path(rlreplay.recorders.__file__).resolve().parent / "bootstrap"


def child_env(
    run_dir: Path, experiment: str | None, framework: str = DEFAULT_FRAMEWORK, token_signals: bool = False
) -> dict[str, str]:
    env = dict(os.environ)
    env[settings.DIR.name] = str(run_dir.resolve())
    env[settings.FRAMEWORK.name] = framework
    if token_signals:
        env[settings.TOKEN_SIGNALS.name] = "1"
    if experiment:
        env[settings.EXPERIMENT.name] = experiment
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bootstrap_dir()), env.get("PYTHONPATH")) if p)
    return env


def check_command(command: list[str]) -> None:
    """Refuse (``CommandNotStarted``, before anything is written) a command that cannot start: its
    program is not found on PATH, or is not an executable file."""
    program = command[0]
    if shutil.which(program) is not None:
        return
    if os.sep in program and os.path.exists(program):
        raise CommandNotStarted(f"command not executable: {program}")
    raise CommandNotStarted(f"command not found: {program}")


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run the command in its own process group; forward INT/TERM/HUP to that group. A command that
    cannot be started raises ``CommandNotStarted``."""
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=os.setpgrp)
    except FileNotFoundError:
        raise CommandNotStarted(f"command not found: {command[0]}") from None
    except PermissionError:
        raise CommandNotStarted(f"command not executable: {command[0]}") from None
    except OSError as exc:  # not a program this system can run (no interpreter line, ...)
        raise CommandNotStarted(f"command cannot be started: {command[0]} ({exc.strerror or exc})") from None

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
