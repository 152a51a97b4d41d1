"""``rlreplay record -- CMD``: run a training command with recording on in all its Python processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from rlreplay.cli.app import TokenizerOption, app, fail

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_FRAMEWORK = "verl"


def bootstrap_dir() -> Path:
    import rlreplay.recorders

    return Path(rlreplay.recorders.__file__).resolve().parent / "bootstrap"


def guess_from_argv(command: list[str], framework: str = DEFAULT_FRAMEWORK) -> tuple[str | None, str | None]:
    """(experiment, tokenizer) that the framework's adapter finds on the command line, if any."""
    from rlreplay.adapters import get_adapter

    adapter = get_adapter(framework)
    return adapter.experiment_from_argv(command), adapter.tokenizer_from_argv(command)


def default_out(command: list[str], experiment: str | None) -> Path:
    label = experiment or Path(command[0]).name
    for i, arg in enumerate(command[:-1]):
        if arg == "-m":
            label = experiment or command[i + 1].rsplit(".", 1)[-1]
            break
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "run"
    base = Path("rlreplay-runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{slug}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def child_env(
    run_dir: Path, experiment: str | None, framework: str = DEFAULT_FRAMEWORK, token_signals: bool = False
) -> dict[str, str]:
    env = dict(os.environ)
    env["RLREPLAY_DIR"] = str(run_dir.resolve())
    env["RLREPLAY_FRAMEWORK"] = framework
    if token_signals:
        env["RLREPLAY_TOKEN_SIGNALS"] = "1"
    if experiment:
        env["RLREPLAY_EXPERIMENT"] = experiment
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bootstrap_dir()), env.get("PYTHONPATH")) if p)
    return env


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run the command in its own process group; forward INT/TERM/HUP to that group."""
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=os.setpgrp)
    except FileNotFoundError:
        fail(f"command not found: {command[0]}")
    except PermissionError:
        fail(f"command not executable: {command[0]}")

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


@app.command(
    "record",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def record_command(
    command: Annotated[list[str], typer.Argument(metavar="-- CMD...", help="The training command to run.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="New run directory (default: ./rlreplay-runs/<time>-<name>)."),
    ] = None,
    experiment: Annotated[
        str | None, typer.Option("--experiment", help="Experiment name for the run.")
    ] = None,
    tokenizer: TokenizerOption = None,
    framework: Annotated[
        str,
        typer.Option(
            "--framework", help="Framework adapter (entry-point group rlreplay.recorders): verl, generic, ..."
        ),
    ] = DEFAULT_FRAMEWORK,
    token_signals: Annotated[
        bool,
        typer.Option(
            "--token-signals", help="Also keep the trainer's per-token log-probs (verl: old_log_probs)."
        ),
    ] = False,
    grace: Annotated[
        float,
        typer.Option("--grace", min=0, help="Seconds to wait for worker processes to seal their files."),
    ] = 15.0,
) -> int:
    """Run CMD with recording on in every Python process of the job, then seal and summarize the run."""
    from rlreplay import manifest
    from rlreplay.store import open_run
    from rlreplay.summary import recover, run_summary

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("no command given: rlreplay record [OPTIONS] -- CMD ...")
    from rlreplay.store import RunError

    try:
        guessed_experiment, guessed_tokenizer = guess_from_argv(command, framework)
    except RunError as exc:
        fail(str(exc))
    experiment = experiment or guessed_experiment
    run_dir = out or default_out(command, experiment)
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--out {run_dir}: exists and is not a directory; give a new run directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        fail(f"{run_dir} already exists and is not empty; recorded runs are never overwritten")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        fail(f"--out {run_dir}: cannot create the run there ({exc.strerror or exc})")
    manifest.write_json_atomic(
        run_dir / manifest.MANIFEST,
        manifest.new_manifest(
            experiment,
            command,
            tokenizer=tokenizer or guessed_tokenizer,
            cwd=os.getcwd(),
            status="running",
            framework=framework.strip().lower(),
        ),
    )
    print(f"rlreplay: recording into {run_dir}", file=sys.stderr)
    code = run_forwarding_signals(
        command, child_env(run_dir, experiment, framework.strip().lower(), token_signals)
    )

    recovered = recover(run_dir, wait_s=grace)
    summary = run_summary(open_run(run_dir))
    manifest.update_manifest(
        run_dir,
        ended_at=time.time(),
        exit_code=code,
        status="finished" if code == 0 else "failed",
        **{k: summary[k] for k in ("steps", "trajectories", "spans", "token_ids", "bytes_on_disk")},
        **{k: summary[k] for k in ("dropped", "spilled", "lost", "encode_errors")},
    )
    bpt = summary["bytes_per_token"]
    print(
        f"rlreplay: {run_dir}: {summary['steps']} steps, {summary['trajectories']} trajectories, "
        f"{summary['spans']} spans, {summary['bytes_on_disk']:,} bytes on disk"
        + (f" ({bpt:.3f} bytes/token id)" if bpt else "")
        + f"; dropped {summary['dropped']}, spilled {summary['spilled']}, lost {summary['lost']}, "
        f"recovered shards {recovered['recovered_shards']}",
        file=sys.stderr,
    )
    return code
