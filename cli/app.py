"""The typer app every command module registers on, and the helpers they share."""

from __future__ import annotations

import functools
import inspect
import math
import os
import stat
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from rlreplay.errors import CliError
from rlreplay.format.keys import (  # noqa: F401 (key_fields: the CLI's, from one place)
    BOOL,
    INT64_MAX,
    KEY,
    SELECT_BY_NAME,
    SELECT_KEYS,
    SelectKey,
    key_fields,
    parse_int,
)
from rlreplay.words import plural, trajectories

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    name="rlreplay",
    help="Record RL rollout trajectories locally; browse, decode, diff and upload them later.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_BAD_INPUT = 2
#: The longest wait a SECONDS option may ask for (a day): more is a typo, and overflows clocks.
MAX_SECONDS = 86_400


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlreplay {version('rlreplay')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Record RL rollout trajectories locally; browse, decode, diff and upload them later."""


def console() -> Console:
    from rich.console import Console

    tty = sys.stdout.isatty()
    no_color = bool(os.environ.get("NO_COLOR")) or not tty
    return Console(no_color=no_color, highlight=False, soft_wrap=False, width=None if tty else 200)


def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or not sys.stderr.isatty())


def fail(message: str) -> NoReturn:
    raise CliError(message)


RunOption = Annotated[
    Path | None,
    typer.Option(
        "--run",
        "-r",
        metavar="RUN",
        help="Run directory or URI (default: $RLREPLAY_DIR, else the newest under ./rlreplay-runs/).",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output (JSON).")]
FindingOption = Annotated[
    str | None,
    typer.Option(
        "--finding",
        metavar="CHECKS",
        help="Only trajectories these audit checks flag (rlreplay audit --help), e.g. truncated.",
    ),
]
TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        metavar="PATH",
        help="Tokenizer for token2text: a local directory or a hub name (default: the run's).",
    ),
]
EngineOption = Annotated[
    str,
    typer.Option(
        "--engine",
        metavar="local|ray",
        help="Where to read the run: this process, or tasks on a Ray cluster (--ray-address); "
        "the answer is the same.",
    ),
]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        metavar="ADDR",
        help="--engine ray: the cluster, HOST:PORT (default: $RAY_ADDRESS; auto inside a Ray job).",
    ),
]


def cluster_for(engine: str, ray_address: str | None) -> Any:
    """The Ray cluster ``--engine ray`` runs on (connected), or None for ``--engine local``."""
    if engine == "local":
        if ray_address is not None:
            fail("--ray-address goes with --engine ray")
        return None
    if engine != "ray":
        fail(f"--engine {engine!r}: one of local, ray")
    from rlreplay.engine import connect

    return connect(ray_address)


RunArgument = Annotated[
    Path | None, typer.Argument(metavar="RUN", help="Run directory or URI.", show_default=False)
]

_KEYS_HELP = "(5, 3..7 inclusive, or a list such as 0..10,20,-1; given twice: both)"


def _key_option(key: SelectKey) -> Any:
    """The CLI option of a selection key (``rlreplay.format.keys.SELECT_KEYS``): ``--step SPEC``
    (given twice: both), ``--validate/--train``, ``--experiment NAME``."""
    if key.kind == BOOL:
        assert key.flags is not None
        return Annotated[list[bool] | None, typer.Option("/".join(key.flags), help=key.help)]
    if key.kind == KEY:
        more = "; non-int values too" if key.strings else ""
        return Annotated[
            list[str] | None, typer.Option(key.option, metavar="SPEC", help=f"{key.help} {_KEYS_HELP}{more}.")
        ]
    return Annotated[list[str] | None, typer.Option(key.option, metavar="NAME", help=key.help)]


_SELECTION_PARAMS: list[tuple[str, Any]] = [
    *((key.name, _key_option(key)) for key in SELECT_KEYS),
    (
        "status",
        Annotated[
            list[str] | None,
            typer.Option(
                "--status",
                metavar="STATUS",
                help="Only trajectories whose status is ok, error or incomplete.",
            ),
        ],
    ),
    (
        "where",
        Annotated[
            list[str] | None,
            typer.Option(
                "--where",
                metavar="EXPR",
                help="SQL boolean over the listing columns (the ls --json keys), "
                'e.g. "reward > 0 and model_calls >= 3".',
            ),
        ],
    ),
    (
        "grep",
        Annotated[
            list[str] | None,
            typer.Option(
                "--grep",
                metavar="PATTERN",
                help="Only trajectories whose decoded response or tool output matches this regular "
                'expression (RE2; a plain word matches itself; "(?i)" ignores case), e.g. "Traceback".',
            ),
        ],
    ),
    (
        "sort",
        Annotated[
            list[str] | None,
            typer.Option("--sort", metavar="SPEC", help='Order: "COL [asc|desc], ...", e.g. "reward desc".'),
        ],
    ),
    (
        "limit",
        Annotated[list[str] | None, typer.Option("--limit", metavar="N", help="At most N trajectories.")],
    ),
]


def _one_value(name: str, values: Any) -> Any:
    """A selection option's value: key options add up; any other given twice is bad input."""
    if not isinstance(values, list):
        return values  # a caller passing the value itself
    if not values:
        return None
    key = SELECT_BY_NAME.get(name)
    if key is not None and key.kind == KEY:
        return ",".join(values)
    if len(values) > 1:
        if key is not None and key.kind == BOOL:
            assert key.flags is not None
            given = [key.flags[0] if v else key.flags[1] for v in values]
            if len(set(given)) > 1:
                fail(f"{' and '.join(key.flags)} both given; give one")
            fail(f"{given[0]} given twice; give it once")
        fail(f"--{name.replace('_', '-')} given twice ({' and '.join(map(repr, values))}); give it once")
    return values[0]


F = TypeVar("F", bound=Callable[..., Any])


def selection_options(func: F) -> F:
    """Give a command the shared selection options; it receives them as ``selection: Selection``.

    The options go after the command's own parameters, so the run stays first.
    """
    signature = inspect.signature(func, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "selection"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hint)
        for name, hint in _SELECTION_PARAMS
    ]
    names = [name for name, _ in _SELECTION_PARAMS]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from rlreplay.read.selection import Selection

        chosen = {name: _one_value(name, kwargs.pop(name, None)) for name in names}
        limit = whole_number("--limit", chosen["limit"], minimum=1)
        chosen["limit"] = None if limit is None else min(limit, INT64_MAX)  # "at most N": any N
        selection = Selection(**chosen)
        selection.check()
        return func(*args, selection=selection, **kwargs)

    params = own + added
    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    if signature.return_annotation is not inspect.Signature.empty:
        wrapper.__annotations__["return"] = signature.return_annotation
    return wrapper  # type: ignore[return-value]


def whole_number(option: str, text: str | None, minimum: int | None = None) -> int | None:
    """An option's integer, written with ASCII digits only (``５`` is not 5)."""
    if text is None:
        return None
    number = parse_int(text)
    if number is None:
        fail(f"{option}: {text!r} is not a whole number (digits 0-9)")
    if minimum is not None and number < minimum:
        fail(f"{option} must be at least {minimum} (got {number})")
    return number


BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 48


def sparkline(values: list[float | None], width: int = SPARK_WIDTH) -> str:
    """One character per value (averaged into ``width`` buckets), blank where there is none
    (NaN and ±inf included)."""
    values = [v if v is not None and math.isfinite(v) else None for v in values]
    if len(values) > width:
        buckets = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
        values = [_mean(b) for b in buckets]
    present = [v for v in values if v is not None]
    if not present:
        return " " * len(values)
    lo, hi = min(present), max(present)
    span = hi - lo
    return "".join(
        " " if v is None else BARS[0 if span == 0 else min(len(BARS) - 1, int((v - lo) / span * len(BARS)))]
        for v in values
    )


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def fit_columns(widths: list[int], width: int) -> int:
    """How many of the first columns (``widths`` in order of priority, two spaces apart) fit a line
    of ``width`` characters; the first always does."""
    used = kept = 0
    for need in widths:
        need += 2 if kept else 0
        if kept and used + need > width:
            break
        used += need
        kept += 1
    return kept


def terminal_width() -> int | None:
    """The terminal's width when stdout is one, else None (a pipe or file gets whole lines)."""
    import shutil

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def shown(value: Any) -> str:
    """A value as the CLI prints it: "-" when absent (None), never Python's "None"."""
    return "-" if value is None else str(value)


def run_counts(summary: dict[str, Any]) -> str:
    """A recorded run's size: "4 steps, 136 trajectories, 952 spans"."""
    spans = plural(summary["spans"], "span")
    return f"{plural(summary['steps'], 'step')}, {trajectories(summary['trajectories'])}, {spans}"


#: The fewest characters a column of text keeps when it is cut short to fit the terminal.
MIN_ELIDED = 12


def elide(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, its end replaced by "…" when cut."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def text_table(
    header: list[str],
    rows: list[list[str]],
    *,
    width: int | None = None,
    right: list[bool] | None = None,
    text_column: int | None = None,
    indent: str = "",
) -> tuple[list[str], list[str]]:
    """Lines of a table whose columns are in order of priority, two spaces apart (``right``: which
    are right-aligned; default: all but the first), and the header names left out. With ``width``
    (a terminal's), only the first columns that fit are kept, and the text column (``text_column``,
    e.g. a detail) is cut short with "…" to the room left; without it every column is kept whole."""
    if right is None:
        right = [False] + [True] * (len(header) - 1)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    kept = len(header)
    if width is not None:
        room = width - len(indent)
        needs = list(widths)
        if text_column is not None:
            needs[text_column] = min(widths[text_column], max(len(header[text_column]), MIN_ELIDED))
        kept = fit_columns(needs, room)
        if text_column is not None and text_column < kept:
            others = sum(w + 2 for i, w in enumerate(widths[:kept]) if i != text_column)
            widths[text_column] = max(needs[text_column], min(widths[text_column], room - others))

    def line(cells: list[str]) -> str:
        shown = [elide(c, widths[i]) for i, c in enumerate(cells[:kept])]
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(shown, widths, right)]
        return (indent + "  ".join(padded)).rstrip()

    return [line(header), *(line(r) for r in rows)], header[kept:]


def left_out_note(names: list[str], how: str) -> list[str]:
    """The line saying which columns were left out to fit the terminal, and how to see them."""
    if not names:
        return []
    return [f"({len(names)} more columns to fit the terminal: {how})"]


def wrap_lines(text: str, width: int | None, indent: str = "  ") -> str:
    """``text`` (one line) wrapped to ``width`` characters, later lines indented; whole when
    ``width`` is None (a pipe or file)."""
    if width is None or len(text) <= width:
        return text
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False))


#: The training signals shown beside the reward when a run has them (listing columns).
SIGNAL_COLUMNS = ("advantage", "logprob_diff_max", "importance_ratio")


def signal_cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


ForceOption = Annotated[bool, typer.Option("--force", help="Replace the output file if it exists.")]


@dataclass(frozen=True)
class Renamed:
    """An option's earlier spelling, kept working but left out of --help."""

    old: str
    new: str
    flag: bool

    @property
    def option(self) -> Any:
        """The hidden option under the old spelling (a command's parameter type)."""
        hidden = typer.Option(self.old, hidden=True, help=f"Renamed {self.new}.")
        return Annotated[bool, hidden] if self.flag else Annotated[str | None, hidden]

    def take(self, new: Any, old: Any) -> Any:
        """The option's value: the new spelling's when given, else the old one's (saying so)."""
        if old is None or old is False:
            return new
        print(f"rlreplay: {self.old} is now {self.new}", file=sys.stderr)
        return old if new is None or new is False else new


def renamed(old: str, new: str, flag: bool = False) -> Renamed:
    """Option ``new``, formerly ``old``: declare ``Renamed.option`` beside it, and ``take`` both."""
    return Renamed(old, new, flag)


# Options renamed so that one name means one thing across commands.
EXPERIMENT_NAME = renamed("--experiment", "--experiment-name")
RESEND = renamed("--force", "--resend", flag=True)
NO_TEXT = renamed("--ids", "--no-text", flag=True)
ExperimentNameWas = EXPERIMENT_NAME.option
ResendWas = RESEND.option
NoTextWas = NO_TEXT.option
MemoryLimitOption = Annotated[
    str | None,
    typer.Option(
        "--memory-limit",
        metavar="SIZE",
        help="Most memory a query may use, its result included (500MB, 4GiB; default 2GiB).",
    ),
]


def set_memory_limit(text: str | None) -> None:
    """Apply ``--memory-limit`` to the queries this command runs (a bad size exits 2)."""
    if text is None:
        return
    from rlreplay.read.selection import parse_size
    from rlreplay.read.where import set_memory_limit as apply

    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        fail(f"--memory-limit: {exc}")
    if nbytes < 1:
        fail(f"--memory-limit {text!r}: give a size of at least 1 byte")
    apply(nbytes)


def _inside_run(path: Path) -> Path | None:
    """The run directory ``path`` lies in, if any."""
    for parent in path.parents:
        if (parent / "run.json").is_file():
            return parent
        spans = parent / "spans"
        if spans.is_dir() and any(p.name.startswith("step=") for p in spans.iterdir()):
            return parent
    return None


def output_path(path: Path, force: bool, option: str = "--out") -> Path:
    """A file to write: never inside a run directory, never over a file unless ``force``."""
    target = Path(os.path.abspath(path))
    resolved = target.resolve()
    for candidate in {target, resolved}:
        run_dir = _inside_run(candidate)
        if run_dir is not None:
            fail(f"{option} {path}: inside the run directory {run_dir}; write somewhere else")
    if target.is_dir():
        fail(f"{option} {path}: is a directory; give a file name")
    if not target.parent.is_dir():
        fail(f"{option} {path}: no directory {target.parent}")
    if target.exists() or target.is_symlink():
        kind = _not_a_regular_file(target)
        if kind:
            fail(f"{option} {path}: is {kind}, not a regular file; rlreplay replaces only regular files")
        if not force:
            fail(f"{option} {path}: exists; pass --force to replace it")
    probe = _tmp_name(target)  # a folder that takes no new file (/proc, read-only): said before any work
    try:
        probe.open("xb").close()
        probe.unlink()
    except OSError as exc:
        fail(f"{option} {path}: cannot write there ({exc.strerror or exc})")
    return target


def _tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _not_a_regular_file(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (nor a link to one): a named pipe, a device..."""
    try:
        mode = path.stat().st_mode  # through links: a link to a device is a device here
    except OSError:
        return "a link that leads nowhere"
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISFIFO: "a named pipe",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    kind = next((name for test, name in kinds.items() if test(mode)), "a socket or other special file")
    return f"a link to {kind}" if path.is_symlink() else kind


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` next to ``target``, then rename over it: a failed write leaves nothing behind.
    A folder that takes no new file there is one line."""
    tmp = _tmp_name(target)
    try:
        try:
            tmp.open("xb").close()
        except OSError as exc:
            fail(f"cannot write {target}: {exc.strerror or exc}")
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def open_run_arg(run: Path | None, positional: Path | None = None):
    """The run named by a positional argument or --run (not both), else the default run."""
    from rlreplay.read.open import open_run

    if run is not None and positional is not None and Path(run) != Path(positional):
        fail(f"two runs given: {positional} and --run {run}")
    chosen = positional if positional is not None else run
    return open_run(chosen)


def flagged(opened: Any, table: Any, names: str) -> Any:
    """The rows of ``table`` that the audit checks ``names`` flag (``--finding``); a check that cannot
    run says why on stderr."""
    import pyarrow as pa

    from rlreplay.audit import engine
    from rlreplay.format import arrow_ops as ops

    broken: dict[str, str] = {}
    report = engine.audit(opened, table, engine.choose(names, engine.available(broken), broken))
    for name, why in report.skipped.items():
        print(f"rlreplay: note: {name} skipped: {why}", file=sys.stderr)
    for name, why in report.failed.items():
        fail(f"--finding: check {name} failed: {why}")
    ids = pa.array(sorted(engine.finding_ids(report, table)), type=pa.string())
    return ops.filter(table, ops.is_in(table["id"], ids))


#: the warnings printed of each run (a command that reports again prints only what is new)
_reported: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def report_warnings(run) -> None:
    """A reading command's warnings not printed yet (secrets redacted), and the line saying the run
    could not be read in full."""
    from rlreplay.format.redact import redact_value

    printed = _reported.setdefault(run, set())
    for message in run.notes():
        if message not in printed:
            printed.add(message)
            print(f"rlreplay: warning: {redact_value(message)}", file=sys.stderr)
