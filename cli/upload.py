"""``rlreplay upload``: send a chosen part of a run to an installed backend, resumably.

Backends come from the entry-point group ``rlreplay.uploaders``; the options each declares are
taken from the command line here (before typer parses the common ones) and listed in --help.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from typer.core import TyperCommand

from rlreplay.cli.app import (
    MAX_SECONDS,
    RESEND,
    JsonOption,
    ResendWas,
    RunOption,
    TokenizerOption,
    app,
    err_console,
    fail,
    open_run_arg,
    plural,
    report_warnings,
    selection_options,
    terminal_width,
    trajectories,
    wrap_lines,
)

EXIT_FAILED = 1
_META_BACKEND = "rlreplay.backend"
_META_VALUES = "rlreplay.backend_values"
_META_DECLARED = "rlreplay.declared"


def _peek_backend(args: list[str]) -> str | None:
    """The value of --backend/-b in raw arguments (None when absent)."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg in ("--backend", "-b") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--backend="):
            return arg.partition("=")[2]
    return None


def _declared(chosen: str | None) -> tuple[dict[str, tuple[Any, ...]], dict[str, str]]:
    """Options declared per installed backend (only ``chosen``'s when it is installed), and
    the backends that could not be imported (name → why)."""
    from rlreplay.errors import RunError
    from rlreplay.uploaders.pipeline import backend_class, backend_options, installed_backends

    names = sorted(installed_backends())
    if chosen in names:
        names = [chosen]
    options: dict[str, tuple[Any, ...]] = {}
    broken: dict[str, str] = {}
    for name in names:
        try:
            options[name] = backend_options(backend_class(name))
        except RunError as exc:
            broken[name] = str(exc)
    return options, broken


def _take_backend_options(
    args: list[str], declared: dict[str, tuple[Any, ...]], chosen: str
) -> tuple[list[str], dict[str, Any]]:
    """Split the backend's own options out of ``args``: (the rest, values by key)."""
    owner = {opt.flag: (name, opt) for name, opts in declared.items() for opt in opts}
    rest: list[str] = []
    values: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        flag, eq, inline = arg.partition("=")
        if flag not in owner or not flag.startswith("--"):
            rest.append(arg)
            i += 1
            continue
        name, opt = owner[flag]
        if name != chosen:
            fail(f"{flag} is an option of the {name} backend, not of {chosen}")
        if eq:
            value = inline
        elif i + 1 < len(args):
            i += 1
            value = args[i]
        else:
            fail(f"{flag} needs a value ({opt.metavar})")
        if opt.multiple:
            values.setdefault(opt.key, []).append(value)
        else:
            values[opt.key] = value
        i += 1
    return rest, values


class UploadCommand(TyperCommand):
    """``upload`` with the options its backends declare (see the module docstring)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        chosen = _peek_backend(args)
        everything = _declared(None)
        declared, broken = everything
        if chosen in declared or chosen in broken:  # help shows the chosen backend only
            declared = {chosen: declared[chosen]} if chosen in declared else {}
            broken = {chosen: broken[chosen]} if chosen in broken else {}
        ctx.meta[_META_BACKEND] = chosen
        ctx.meta[_META_DECLARED] = (declared, broken)
        helping = "--help" in args or "-h" in args
        if chosen in broken and not helping:  # its options are unknown: say why it cannot run
            fail(broken[chosen])
        if not helping:
            rest, values = _take_backend_options(args, everything[0], chosen or "mlflow")
            ctx.meta[_META_VALUES] = values
        else:
            rest = args
        return super().parse_args(ctx, rest)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        declared, broken = ctx.meta.get(_META_DECLARED) or _declared(None)
        from rlreplay.uploaders.pipeline import backend_class

        for name in sorted(set(declared) | set(broken)):
            if name in broken:
                with formatter.section(f"Backend {name}"):
                    formatter.write_text(f"not usable here: {broken[name]}")
                continue
            cls = backend_class(name)
            upsert = "replaces traces it has" if getattr(cls, "can_upsert", False) else "no upsert"
            summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            with formatter.section(f"Backend {name} ({upsert})"):
                if summary:
                    formatter.write_text(summary)
                rows = [
                    (f"{opt.flag} {opt.metavar}", opt.help + (" (repeatable)" if opt.multiple else ""))
                    for opt in declared[name]
                ]
                if rows:
                    formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)


def _size(text: str | None) -> int | None:
    from rlreplay.read.selection import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        fail(f"--max-bytes: {exc}")
    except OverflowError:
        fail(f"--max-bytes: too large: {text[:40]}{'...' if len(text) > 40 else ''}")


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


@app.command("upload", cls=UploadCommand)
@selection_options
def upload_command(
    ctx: typer.Context,
    run_path: Annotated[Path | None, typer.Argument(metavar="RUN", help="Run directory.")] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            "-b",
            metavar="NAME",
            help="Where to send: an installed backend (listed below with its options).",
        ),
    ] = "mlflow",
    run: RunOption = None,
    max_samples: Annotated[
        int | None,
        typer.Option(
            "--max-samples",
            metavar="N",
            min=1,
            help="Per step and split, at most N samples (seeded choice), each with all of its rollouts.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the --max-samples choice.")] = 0,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            "--max-bytes",
            metavar="SIZE",
            help="Byte budget (500k, 900MB, 1.5GiB): whole groups are kept, in step order, while they fit.",
        ),
    ] = None,
    tokenizer: TokenizerOption = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            "-p",
            metavar="NAME",
            help="MLflow experiment (default: the run's experiment), Weave ENTITY/PROJECT, "
            "OTLP/Phoenix project, Trackio project.",
        ),
    ] = None,
    check_server: Annotated[
        bool,
        typer.Option(
            "--check-server",
            help="With --dry-run: ask the backend how many of the selected trajectories it already has.",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--resend",
            help="Send the selection again, replacing what the backend has (backends that upsert).",
        ),
    ] = False,
    force_was: ResendWas = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            min=0.1,
            max=MAX_SECONDS,
            help="Overall deadline of one request, in seconds; a server silent that long stops the upload.",
        ),
    ] = 60.0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be sent and how many bytes; send nothing.")
    ] = False,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, metavar="N", help="Trajectories per request.")
    ] = 100,
    as_json: JsonOption = False,
    *,
    selection: Any,
) -> int:
    """Upload a chosen few trajectories (or all) as traces.

    Reruns send only what is missing.

    MLflow goes to $MLFLOW_TRACKING_URI, else to a sqlite store in the run directory
    (RUN/_uploads/mlflow.db). Weave needs WANDB_API_KEY and --project ENTITY/PROJECT. OTLP sends
    to any collector (--endpoint). Trackio writes to its local store ($TRACKIO_DIR). A rerun
    sends only what is missing, and replaces traces sent without text once it can decode.
    """
    from rlreplay.read.selection import describe_groups, select
    from rlreplay.uploaders.base import UploadError
    from rlreplay.uploaders.pipeline import backend_class, load_decoder, make_uploader, upload

    backend_class(backend)  # an unknown name lists the installed backends (exit 2)
    values = ctx.meta.get(_META_VALUES, {})
    force = RESEND.take(force, force_was)
    budget = _size(max_bytes)
    opened = open_run_arg(run, run_path)
    # the shared selection (--step, --where, --sort, --limit, ...), then whole groups per step
    groups = select(selection.trajectories(opened), max_samples=max_samples, seed=seed)
    report_warnings(opened)

    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            print(f"rlreplay: warning: {message}", file=sys.stderr)

    decoder = load_decoder(opened, tokenizer, warn)
    try:
        uploader = make_uploader(backend, opened, project, timeout=timeout, values=values)
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
            force=force,
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
    report_warnings(opened)  # what reading the trajectories met (a damaged file: with counts)
    if check_server and dry_run:
        try:
            found = uploader.existing([i for g in groups[: summary.groups] for i in g.ids])
        except UploadError as exc:
            fail(str(exc))
        summary.on_server = None if found is None else len(found)
        if found is None:
            print(f"rlreplay: warning: the {backend} backend cannot tell what it has", file=sys.stderr)
    if summary.error and summary.sent == 0 and summary.failed == 0 and not summary.resumable:
        fail(summary.error)  # nothing went out (unreachable server, bad credentials): one line
    chose = None if max_samples is None else describe_groups(groups)
    if as_json:
        shown = summary.to_dict()
        if chose is not None:
            shown["max_samples"] = chose
        sys.stdout.write(orjson.dumps(shown).decode() + "\n")
    else:
        if chose is not None:
            sys.stdout.write(
                wrap_lines(f"--max-samples {max_samples} chose {chose}", terminal_width()) + "\n"
            )
        _print_summary(summary, describe=getattr(uploader, "describe", lambda: summary.target)())
    if summary.error:
        rerun = "; what was sent is recorded, rerun to resume" if summary.resumable else ""
        print(f"rlreplay: error: {summary.error}{rerun}", file=sys.stderr)
    elif not as_json and (summary.failed or summary.not_attempted):
        _print_failures(summary)
    return 0 if summary.ok else EXIT_FAILED


def _print_summary(summary: Any, describe: str) -> None:
    width = terminal_width()

    def say(line: str) -> None:  # wrapped to the terminal
        sys.stdout.write(wrap_lines(line, width) + "\n")

    budget = ""
    if summary.over_budget_groups:
        budget = (
            f"; {summary.over_budget_trajectories} more trajectories "
            f"({plural(summary.over_budget_groups, 'group')}) left out by --max-bytes"
        )
    say(
        f"selected {trajectories(summary.selected)} in {plural(summary.groups, 'group')}, "
        f"{_human(summary.selected_bytes)}{budget}"
    )
    if summary.dry_run:
        say(
            f"dry run: would send {trajectories(summary.to_send)} ({_human(summary.bytes)}, "
            f"{plural(summary.bytes, 'byte')}) to {describe}; {summary.already_uploaded} already uploaded"
        )
        if summary.on_server is not None:
            say(f"the server has {summary.on_server} of the {summary.selected} selected")
        return
    rate = summary.sent / summary.seconds if summary.seconds else 0.0
    replaced = f" ({summary.replaced} replacing earlier uploads)" if summary.replaced else ""
    say(
        f"sent {summary.sent}{replaced} ({_human(summary.bytes)}) to {describe} in {summary.seconds:.1f}s "
        f"({rate:.1f} traces/s); {summary.already_uploaded} already uploaded"
        f"{f'; text: {summary.text}' if summary.text else '; no text (token ids only)'}"
    )


def _print_failures(summary: Any) -> None:
    """Failures on stderr: one line per distinct reason, then the trajectories (at most 20)."""
    err = sys.stderr
    reasons: dict[str, int] = {}
    for failure in summary.failures:
        reasons[failure.error] = reasons.get(failure.error, 0) + 1
    err.write(
        f"rlreplay: error: {trajectories(summary.failed)} failed, "
        f"{summary.not_attempted} not attempted"
        f"{': ' + '; '.join(f'{r} ({n}x)' for r, n in reasons.items()) if reasons else ''}\n"
    )
    for failure in summary.failures[:20]:
        err.write(f"  {failure.trajectory_id}  {failure.error} (attempts: {failure.attempts})\n")
    if len(summary.failures) > 20:
        err.write(f"  ... {len(summary.failures) - 20} more (use --json for all)\n")
