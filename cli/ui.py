"""``rlreplay ui``: a read-only local web app over a run or a folder of runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from rlreplay.cli.app import MemoryLimitOption, RunOption, TokenizerOption, app, fail, set_memory_limit
from rlreplay.errors import install_hint

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command("ui")
def ui_command(
    run_path: Annotated[
        str | None,
        typer.Argument(
            metavar="RUN",
            help="A run directory, a folder of runs or a run's URI (s3://...) (default: $RLREPLAY_DIR, "
            "else ./rlreplay-runs/).",
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", metavar="HOST", help="Address to listen on (default: this machine only).")
    ] = ("127.0.0.1"),
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, metavar="PORT", help="Port (0: any free port).")
    ] = 8765,
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="Open the page in a web browser.")
    ] = False,
    tokenizer: TokenizerOption = None,
    run: RunOption = None,
    memory_limit: MemoryLimitOption = None,
) -> None:
    """Browse a run in a web browser.

    Overview, trajectories, conversations, groups, diffs, live."""
    import socket

    try:
        import uvicorn

        from rlreplay.ui.app import create_app
    except ImportError as exc:
        fail(f"rlreplay ui needs the 'ui' extra ({exc.name} is missing): {install_hint('ui')}")
    if run is not None and run_path is not None:
        fail("give the run once: as RUN or as --run")
    set_memory_limit(memory_limit)
    chosen = run if run is not None else run_path
    root = chosen if chosen is not None else _default_root()
    if tokenizer is not None:
        from rlreplay.text.token2text import Decoder

        Decoder.load(tokenizer)  # refused before serving (one line, exit 2), as export refuses it
    loopback = host in LOOPBACK
    allowed = ["127.0.0.1", "localhost", "[::1]", "::1"] if loopback else None
    application = create_app(root, allowed_hosts=allowed, tokenizer=tokenizer)
    if not loopback:
        print(
            f"rlreplay: warning: listening on {host}: anyone who can reach this address can read the run",
            file=sys.stderr,
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # connections wait in the backlog until the server starts
    except OSError as exc:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    application.state.ui.warm()  # read a single run now, so that the first page is fast
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    print(f"rlreplay ui: {url}  (serving {application.state.ui.runs.address}; Ctrl-C to stop)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    config = uvicorn.Config(application, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def _default_root() -> Path:

    from rlreplay import settings
    from rlreplay.read.open import default_run_path
    from rlreplay.read.run import RUNS_DIR

    if not settings.DIR.get() and Path(RUNS_DIR).is_dir():
        return Path(RUNS_DIR)
    return default_run_path()
