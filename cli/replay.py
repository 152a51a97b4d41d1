"""``rlreplay replay SOURCE_RUN -- CMD``: run a command as ``record`` does, with recorded ops served."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from rlreplay.cli.app import TokenizerOption, app, fail, selection_options
from rlreplay.cli.launch import (
    DEFAULT_FRAMEWORK,
    DEFAULT_MATCH_ON,
    DEFAULT_ON_DIVERGE,
    FrameworkOption,
    GraceOption,
    MatchOnOption,
    OnDivergeOption,
    OutOption,
)


@dataclass
class ReplayPlan:
    """What ``record`` needs to carry a replay into every process and to report on it."""

    config: Any  # rlreplay.playback.ReplayConfig
    source: Any  # the source Run, opened

    def env(self) -> dict[str, str]:
        return self.config.env()

    def manifest(self) -> dict[str, Any]:
        from rlreplay.playback import MANIFEST_KEY

        return {MANIFEST_KEY: self.config.record()}

    def report(self, new_run: Any) -> None:
        from rlreplay.playback import replay_summary

        summary = replay_summary(new_run, self.config, self.source)
        diverged, never = summary["diverged"], summary["never_asked"]
        print(
            f"rlreplay: replay of {self.source.address}: {summary['served']} ops served; "
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
    source: Annotated[
        str, typer.Argument(metavar="SOURCE_RUN", help="The recorded run to serve from (a directory or URI).")
    ],
    command: Annotated[list[str], typer.Argument(metavar="-- CMD...", help="The command to run.")],
    serve: Annotated[
        str,
        typer.Option(
            "--serve", metavar="KINDS", help="What is served from the recording: llm, llm,tool or agent."
        ),
    ] = "llm",
    on_diverge: OnDivergeOption = DEFAULT_ON_DIVERGE,
    match_on: MatchOnOption = DEFAULT_MATCH_ON,
    out: OutOption = None,
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
    from rlreplay.playback import ReplayConfig, open_source, selected, source_framework

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("no command given: rlreplay replay SOURCE_RUN [OPTIONS] -- CMD ...")
    try:
        config = ReplayConfig.of(source, serve, selection, on_diverge, match_on)
        run = open_source(source)
        recorded_with = source_framework(run)
        if recorded_with != framework.strip().lower():
            fail(
                f"source run {run.address} was recorded with the {recorded_with} adapter; "
                f"replay it with --framework {recorded_with}"
            )
        selected(run, config.selection)
    except RlreplayError as exc:
        fail(str(exc))
    plan = ReplayPlan(config, run)
    return record_run(command, out, None, None, tokenizer, framework, False, grace, replay=plan)
