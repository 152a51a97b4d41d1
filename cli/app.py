"""The typer app every command module registers on, and the helpers they share."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="rlreplay",
    help="Record RL rollout trajectories locally; browse, decode, diff and upload them later.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_BAD_INPUT = 2


def console() -> Console:
    tty = sys.stdout.isatty()
    no_color = bool(os.environ.get("NO_COLOR")) or not tty
    return Console(no_color=no_color, highlight=False, soft_wrap=False, width=None if tty else 200)


def err_console() -> Console:
    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or not sys.stderr.isatty())


class CliError(Exception):
    """Bad input: printed as one line on stderr, exit code 2."""


def fail(message: str) -> NoReturn:
    raise CliError(message)


RunOption = Annotated[
    Path | None,
    typer.Option(
        "--run", "-r", help="Run directory (default: $RLREPLAY_DIR, else the newest under ./rlreplay-runs/)."
    ),
]
StepOption = Annotated[str | None, typer.Option("--step", help="Only this training step.")]
SampleOption = Annotated[str | None, typer.Option("--sample-index", help="Only this dataset sample.")]
RolloutOption = Annotated[str | None, typer.Option("--rollout-n", help="Only this rollout of a sample.")]
ValidateOption = Annotated[
    bool | None, typer.Option("--validate/--train", help="Only validation (or only training) trajectories.")
]
ExperimentOption = Annotated[str | None, typer.Option("--experiment", help="Only this experiment name.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output (JSON).")]
TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer", help="Tokenizer for token2text: a local directory or a hub name (default: the run's)."
    ),
]


def open_run_arg(run: Path | None, positional: Path | None = None):
    """The run named by a positional argument or --run (not both), else the default run."""
    from rlreplay.store import open_run

    if run is not None and positional is not None and Path(run) != Path(positional):
        fail(f"two runs given: {positional} and --run {run}")
    chosen = positional if positional is not None else run
    return open_run(chosen)


def report_warnings(run) -> None:
    for message in run.warnings:
        print(f"rlreplay: warning: {message}", file=sys.stderr)
