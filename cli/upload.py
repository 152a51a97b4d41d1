"""``rlreplay upload``: send a chosen part of a run to MLflow or Weave, resumably."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    ExperimentOption,
    JsonOption,
    RolloutOption,
    RunOption,
    SampleOption,
    StepOption,
    TokenizerOption,
    ValidateOption,
    app,
    err_console,
    fail,
    open_run_arg,
    report_warnings,
)

EXIT_FAILED = 1


def _size(text: str | None) -> int | None:
    from rlreplay.selection import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        fail(f"--max-bytes: {exc}")


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


class _Bar:
    """A rich progress bar on stderr: trajectories, traces/s and bytes (only on a terminal)."""

    def __init__(self, label: str) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} traces/s"),
            TextColumn("{task.fields[sent]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console(),
            transient=False,
        )
        self._label = label
        self._task: Any = None
        self._bytes = 0
        self._done = 0
        self._started = 0.0

    def start(self, total: int) -> None:
        import time

        self._started = time.perf_counter()
        self._progress.start()
        self._task = self._progress.add_task(self._label, total=total, rate="0.0", sent="0 B")

    def set_total(self, total: int) -> None:
        self._progress.update(self._task, total=total)

    def advance(self, trajectories: int, nbytes: int) -> None:
        import time

        self._bytes += nbytes
        self._done += trajectories
        rate = self._done / max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(self._task, advance=trajectories, rate=f"{rate:.1f}", sent=_human(self._bytes))

    def stop(self) -> None:
        self._progress.stop()


@app.command("upload")
def upload_command(
    run_path: Annotated[Path | None, typer.Argument(metavar="[RUN]", help="Run directory.")] = None,
    backend: Annotated[
        str, typer.Option("--backend", "-b", help="Where to send: mlflow or weave.")
    ] = "mlflow",
    run: RunOption = None,
    step: StepOption = None,
    sample_index: SampleOption = None,
    rollout_n: RolloutOption = None,
    validate: ValidateOption = None,
    experiment: ExperimentOption = None,
    status: Annotated[
        str | None, typer.Option("--status", help="Only trajectories that ended ok, or with an error.")
    ] = None,
    max_samples: Annotated[
        int | None,
        typer.Option(
            "--max-samples",
            min=0,
            help="Per step and split, at most N samples (seeded choice), each with all of its rollouts.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the --max-samples choice.")] = 0,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            "--max-bytes",
            help="Byte budget (500k, 900MB, 1.5GiB): whole groups are kept, in step order, while they fit.",
        ),
    ] = None,
    tokenizer: TokenizerOption = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            "-p",
            help="MLflow experiment (default: the run's experiment) or Weave ENTITY/PROJECT.",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be sent and how many bytes; send nothing.")
    ] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Trajectories per request.")] = 100,
    as_json: JsonOption = False,
) -> int:
    """Upload trajectories (a chosen few, or all) as traces; reruns send only what is missing.

    MLflow goes to $MLFLOW_TRACKING_URI, else to a sqlite store in the run directory
    (RUN/_uploads/mlflow.db). Weave needs WANDB_API_KEY and --project ENTITY/PROJECT.
    """
    from rlreplay import selection
    from rlreplay.store import Filters
    from rlreplay.uploaders.base import UploadError
    from rlreplay.uploaders.pipeline import BACKENDS, load_decoder, make_uploader, upload

    if backend not in BACKENDS:
        fail(f"--backend must be one of: {', '.join(sorted(BACKENDS))} (got {backend!r})")
    if status is not None and status not in selection.STATUSES:
        fail(f"--status must be one of: {', '.join(selection.STATUSES)} (got {status!r})")
    budget = _size(max_bytes)
    opened = open_run_arg(run, run_path)
    filters = Filters(
        step=step, sample_index=sample_index, rollout_n=rollout_n, validate=validate, experiment=experiment
    )
    table = opened.trajectories(filters)
    groups = selection.select(table, status=status, max_samples=max_samples, seed=seed)
    report_warnings(opened)

    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            print(f"rlreplay: warning: {message}", file=sys.stderr)

    decoder = load_decoder(opened, tokenizer, warn)
    try:
        uploader = make_uploader(backend, opened, project)
    except UploadError as exc:
        fail(str(exc))
    bar = _Bar(f"{backend}") if sys.stderr.isatty() and not dry_run else None
    try:
        summary = upload(
            opened,
            uploader,
            groups,
            decoder=decoder,
            max_bytes=budget,
            dry_run=dry_run,
            batch_size=batch_size,
            progress=bar,
            warn=warn,
        )
    except UploadError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        if bar is not None:
            bar.stop()
            bar = None
        print(
            "rlreplay: upload interrupted; what was sent is recorded, rerun to send the rest", file=sys.stderr
        )
        raise
    finally:
        if bar is not None:
            bar.stop()
    if summary.error and summary.sent == 0 and summary.failed == 0:
        fail(summary.error)  # nothing went out (unreachable server, bad credentials): one line
    if as_json:
        sys.stdout.write(orjson.dumps(summary.to_dict()).decode() + "\n")
    else:
        _print_summary(summary, describe=getattr(uploader, "describe", lambda: summary.target)())
    if summary.error:
        print(f"rlreplay: error: {summary.error}", file=sys.stderr)
    return 0 if summary.ok else EXIT_FAILED


def _print_summary(summary: Any, describe: str) -> None:
    out = sys.stdout
    budget = ""
    if summary.over_budget_groups:
        budget = (
            f"; {summary.over_budget_trajectories} more trajectories "
            f"({summary.over_budget_groups} groups) left out by --max-bytes"
        )
    out.write(
        f"selected {summary.selected} trajectories in {summary.groups} groups, "
        f"{_human(summary.selected_bytes)}{budget}\n"
    )
    if summary.dry_run:
        out.write(
            f"dry run: would send {summary.to_send} trajectories ({_human(summary.bytes)}, "
            f"{summary.bytes} bytes) to {describe}; {summary.already_uploaded} already uploaded\n"
        )
        return
    rate = summary.sent / summary.seconds if summary.seconds else 0.0
    out.write(
        f"sent {summary.sent} ({_human(summary.bytes)}) to {describe} in {summary.seconds:.1f}s "
        f"({rate:.1f} traces/s); {summary.already_uploaded} already uploaded"
        f"{f'; text: {summary.text}' if summary.text else '; no text (token ids only)'}\n"
    )
    if summary.failed or summary.not_attempted:
        out.write(f"FAILED {summary.failed} trajectories, {summary.not_attempted} not attempted:\n")
        for failure in summary.failures[:50]:
            out.write(f"  {failure.trajectory_id}  {failure.error} (attempts: {failure.attempts})\n")
        if len(summary.failures) > 50:
            out.write(f"  ... {len(summary.failures) - 50} more (use --json for all)\n")
