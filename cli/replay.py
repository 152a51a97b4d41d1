"""``rlreplay replay SOURCE_RUN -- CMD``: run a command as ``record`` does, with recorded ops served."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from rlreplay.cli.app import TokenizerOption, app, fail, selection_options
from rlreplay.cli.launch import DEFAULT_FRAMEWORK, FrameworkOption, GraceOption


@dataclass
class ReplayPlan:
    """What ``record`` needs to carry a replay into every process and to report on it."""

    source: Any  # the source Run
    serve: str
    on_diverge: str
    selection: Any

    def env(self) -> dict[str, str]:
        from rlreplay.playback import env_vars

        return env_vars(str(Path(self.source.path).resolve()), self.serve, self.on_diverge, self.selection)

    def manifest(self) -> dict[str, Any]:
        return {
            "replay": {
                "source": str(Path(self.source.path).resolve()),
                "serve": self.serve.split(","),
                "on_diverge": self.on_diverge,
            }
        }

    def report(self, new_run: Any) -> None:
        from rlreplay.playback import replay_summary

        summary = replay_summary(new_run, self.source, self.selection)
        diverged, never = summary["diverged"], summary["never_asked"]
        print(
            f"rlreplay: replay of {self.source.path}: {summary['served']} ops served; "
            f"{len(diverged)} trajectories diverged"
            + (f" ({', '.join(diverged)})" if diverged else "")
            + f"; {len(never)} source trajectories never asked for"
            + (f" ({', '.join(never)})" if never else ""),
            file=sys.stderr,
        )


# options may follow SOURCE_RUN; everything after ``--`` is the command
@app.command("replay", context_settings={"ignore_unknown_options": True})
@selection_options
def replay_command(
    source: Annotated[Path, typer.Argument(metavar="SOURCE_RUN", help="The recorded run to serve from.")],
    command: Annotated[list[str], typer.Argument(metavar="-- CMD...", help="The command to run.")],
    serve: Annotated[
        str,
        typer.Option(
            "--serve", metavar="KINDS", help="What is served from the recording: llm, llm,tool or agent."
        ),
    ] = "llm",
    on_diverge: Annotated[
        str,
        typer.Option(
            "--on-diverge",
            metavar="WHAT",
            help="When a served call's inputs differ from the recording: live (run it and the rest "
            "of its trajectory live) or fail (the call raises).",
        ),
    ] = "live",
    out: Annotated[
        str | None,
        typer.Option(
            "--out", "-o", metavar="RUN", help="New run directory (default: ./rlreplay-runs/<time>-<name>)."
        ),
    ] = None,
    tokenizer: TokenizerOption = None,
    framework: FrameworkOption = DEFAULT_FRAMEWORK,
    grace: GraceOption = 15.0,
    *,
    selection: Any,
) -> int:
    """Run CMD against a recording.

    CMD runs exactly as record runs it, with the model calls (or tools, or whole agent loops) of
    the selected trajectories of SOURCE_RUN served from the recording instead of run.
    """
    from rlreplay.cli.record import record_run
    from rlreplay.errors import RlreplayError
    from rlreplay.playback import open_source, parse_serve, selected, source_framework

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("no command given: rlreplay replay SOURCE_RUN [OPTIONS] -- CMD ...")
    try:
        parse_serve(serve)
        if on_diverge not in ("live", "fail"):
            fail(f"--on-diverge must be live or fail, not {on_diverge!r}")
        run = open_source(os.fspath(source))
        recorded_with = source_framework(run)
        if recorded_with != framework.strip().lower():
            fail(
                f"source run {source} was recorded with the {recorded_with} adapter; "
                f"replay it with --framework {recorded_with}"
            )
        selected(run, selection)
    except RlreplayError as exc:
        fail(str(exc))
    plan = ReplayPlan(run, ",".join(s.strip() for s in serve.split(",")), on_diverge, selection)
    return record_run(command, out, None, None, tokenizer, framework, False, grace, replay=plan)
