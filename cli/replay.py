"""``rlreplay replay SOURCE_RUN -- CMD``: run a command as ``record`` does, with recorded ops served."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from rlreplay.cli.app import TokenizerOption, app, fail, plural, selection_options, trajectories
from rlreplay.cli.launch import (
    AUTO_FRAMEWORK,
    DEFAULT_FRAMEWORK,
    DEFAULT_MATCH_ON,
    DEFAULT_ON_DIVERGE,
    FrameworkOption,
    GraceOption,
    MatchOnOption,
    OnDivergeOption,
    OutOption,
)

#: Ids a summary line shows at most (then how many more).
SHOWN_IDS = 5


def _some(ids: list[str]) -> str:
    more = len(ids) - SHOWN_IDS
    return ", ".join(ids[:SHOWN_IDS]) + (f", ... {more} more" if more > 0 else "")


@dataclass
class ReplayPlan:
    """What ``record`` needs to carry a replay into every process and to report on it."""

    config: Any  # rlreplay.playback.ReplayConfig
    source: Any  # the source Run, opened
    shown: str = ""  # the source as the user gave it (secrets hidden)

    def env(self) -> dict[str, str]:
        return self.config.env()

    def manifest(self) -> dict[str, Any]:
        from rlreplay.playback import MANIFEST_KEY

        return {MANIFEST_KEY: self.config.record()}

    def tokenizer(self) -> tuple[str | None, str | None]:
        """The source run's tokenizer: (its name, as the source's ``run.json`` gives it; where its
        files are: the source's own copy when it keeps one, else that name)."""
        from rlreplay.text.token2text import resolve_tokenizer

        name = (self.source.manifest or {}).get("tokenizer")
        return (name if isinstance(name, str) else None), resolve_tokenizer(self.source, None)

    def report(self, new_run: Any, code: int) -> int:
        """Print the replay's summary; the command's exit code: the job's, else 1 when
        ``--on-diverge fail`` and a trajectory diverged (or could not be served)."""
        from rlreplay.playback import replay_summary

        summary = replay_summary(new_run, self.config, self.source)
        diverged, never, unserved = summary["diverged"], summary["never_asked"], summary["unserved"]
        lines = [
            f"rlreplay: replay of {self.shown or self.source.address}: "
            f"{plural(summary['served'], 'op')} served; "
            f"{trajectories(len(diverged))} diverged"
            + (f" ({_some(diverged)})" if diverged else "")
            + (
                f"; {plural(len(never), 'source trajectory', 'source trajectories')} never asked for"
                + (f" ({_some(never)})" if never else "")
                if never is not None
                else ""
            )
        ]
        for source_id in diverged[:SHOWN_IDS]:  # why, for the first few; ls has every one's
            lines.append(f"rlreplay: replay: {source_id} diverged: {summary['divergences'][source_id]}")
        if len(diverged) > SHOWN_IDS:
            lines.append(
                f"rlreplay: replay: why the other {len(diverged) - SHOWN_IDS} diverged: "
                f"replay_reason in `rlreplay ls {new_run.address} --json`"
            )
        for why, count in unserved.items():
            were = "was" if count == 1 else "were"
            lines.append(f"rlreplay: replay: {trajectories(count)} {were} not served: {why}")
        if summary["source_problem"]:
            lines.append(f"rlreplay: replay: {summary['source_problem']}")
        print("\n".join(lines), file=sys.stderr)
        failed = self.config.on_diverge == "fail" and (diverged or unserved)
        return code or (1 if failed else 0)


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
    the selected trajectories of SOURCE_RUN served from the recording instead of run: each
    served value is what the op returned, bit for bit, or the call is not served and the
    trajectory's replay_reason says why.
    """
    from rlreplay.cli.record import record_run
    from rlreplay.errors import RlreplayError
    from rlreplay.playback import ReplayConfig, open_source, selected, source_framework, unreadable_files
    from rlreplay.remote import location

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("no command given: rlreplay replay SOURCE_RUN [OPTIONS] -- CMD ...")
    shown = location.redact(source)
    try:
        config = ReplayConfig.of(source, serve, selection, on_diverge, match_on)
        run = open_source(source)
        recorded_with = source_framework(run)
        asked = framework.strip().lower()
        if asked != AUTO_FRAMEWORK and recorded_with != asked:
            fail(
                f"source run {shown} was recorded with the {recorded_with} adapter; "
                f"replay it with --framework {recorded_with}"
            )
        seen = len(run.warnings)
        selected(run, config.selection)
        problem = unreadable_files(run, seen)
    except RlreplayError as exc:
        fail(str(exc))
    if problem is not None:
        if config.on_diverge == "fail":
            fail(f"source run {shown}: {problem}")
        print(
            f"rlreplay: warning: source run {shown}: {problem}: what they hold is not served", file=sys.stderr
        )
    plan = ReplayPlan(config, run, shown)
    return record_run(command, out, None, None, tokenizer, framework, False, grace, replay=plan)
