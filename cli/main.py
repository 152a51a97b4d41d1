"""Entry point of the ``rlreplay`` command."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import typer

from rlreplay.cli.app import EXIT_BAD_INPUT, CliError, app

#: The exit code of a command stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130

#: Each command and the module that registers it: a command imports only its own module.
COMMANDS = {
    "ls": "browse",
    "audit": "audit",
    "show": "browse",
    "info": "browse",
    "recover": "browse",
    "compare": "compare",
    "diff": "diff",
    "export": "export",
    "mismatch": "mismatch",
    "proxy": "proxy",
    "record": "record",
    "replay": "replay",
    "sql": "sql",
    "stats": "stats",
    "ui": "ui",
    "upload": "upload",
    "watch": "watch",
}


def command_group(args: list[str]) -> Any:
    """The command group for ``args``: when they name a command, that command alone (its module
    imported, no other); otherwise every command (help, a mistyped name: the listing and the
    suggestions need them all)."""
    name = args[0] if args and args[0] in COMMANDS else None
    modules = [COMMANDS[name]] if name else sorted(set(COMMANDS.values()))
    for module in modules:
        importlib.import_module(f"rlreplay.cli.{module}")
    registered = app.registered_commands
    listed = sorted(registered, key=lambda c: COMMANDS.get(c.name or "", ""))  # not import order
    app.registered_commands = [c for c in listed if c.name == name] or listed
    try:
        return typer.main.get_command(app)
    finally:
        app.registered_commands = registered


def _bad_input() -> tuple[type[BaseException], ...]:
    """Bad-input errors of the modules loaded so far (``--help`` loads no pyarrow, so no store)."""
    names = (("rlreplay.errors", "RlreplayError"),)
    return (CliError, *(getattr(sys.modules[m], n) for m, n in names if m in sys.modules))


def _error(message: str) -> None:
    """The one line of a bad input, its secrets hidden (an option's value may hold one)."""
    from rlreplay.format.redact import redact_value

    print(f"rlreplay: error: {redact_value(message)}", file=sys.stderr)


def _not_utf8(args: list[str]) -> str | None:
    """The first argument (before ``--``: a job's own command line is the job's) holding bytes
    that are not UTF-8, shown with them escaped; None when every one is text."""
    for arg in args:
        if arg == "--":
            return None
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # the bytes the system could not decode stand as surrogates
            return ascii(os.fsencode(arg))[2:-1]
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:]
    reading = (
        "ls",
        "audit",
        "show",
        "diff",
        "compare",
        "info",
        "stats",
        "sql",
        "export",
        "mismatch",
        "watch",
    )
    if argv is None and args and args[0] in ("mismatch", "watch"):
        # a whole run read a step at a time: the system allocator hands each step's memory back,
        # Arrow's default one keeps much of it (~15% less at the peak); before pyarrow loads
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    if argv is None and args and args[0] in reading and not {"--help", "-h"} & set(args):
        # no linear algebra here: one OpenBLAS thread (as numpy loads, OpenBLAS starts one per core,
        # and they spin for a while, taking the CPU this command runs on)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        from rlreplay.read.run import skip_pandas

        skip_pandas()  # the command-line process of a reading command: no pandas import
    given = list(args if argv is None else argv)
    undecodable = _not_utf8(given)
    if undecodable is not None:
        _error(f"argument '{undecodable}' is not UTF-8 text; rlreplay takes UTF-8 arguments")
        return EXIT_BAD_INPUT
    command = command_group(given)
    try:
        from rlreplay import settings

        settings.check()  # a bad RLREPLAY_* value is bad input: one line naming it, exit 2
        result = command.main(args=argv, prog_name="rlreplay", standalone_mode=False)
    except CliError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("rlreplay: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if isinstance(exc, _bad_input()):
            _error(str(exc))
            return EXIT_BAD_INPUT
        if isinstance(exc, OSError):  # a file or folder the system refused: which, and why
            _error(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
            return EXIT_BAD_INPUT
        # typer vendors click in recent releases: match click's exceptions by their interface
        kind = type(exc).__name__
        if kind == "Exit":
            return int(getattr(exc, "exit_code", 0) or 0)
        if kind == "Abort":
            print("rlreplay: aborted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if kind == "NoArgsIsHelpError":
            print(exc.format_message(), file=sys.stderr)  # type: ignore[attr-defined]
            return EXIT_BAD_INPUT
        if hasattr(exc, "format_message"):
            message = " ".join(exc.format_message().split())
            _error(message)
            return EXIT_BAD_INPUT
        raise
    if result == EXIT_INTERRUPTED and given and given[0] not in ("record", "replay"):
        print("rlreplay: interrupted", file=sys.stderr)  # typer turns Ctrl-C into this code, silently
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
