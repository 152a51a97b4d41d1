"""``rlreplay record -- CMD``: run a training command with recording on in all its Python processes."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from rlreplay.cli.app import EXPERIMENT_NAME, ExperimentNameWas, TokenizerOption, app, fail, run_counts
from rlreplay.cli.launch import (
    AUTO_FRAMEWORK,
    DEFAULT_FRAMEWORK,
    FrameworkOption,
    GraceOption,
    OutOption,
    argv_framework,
    check_command,
    child_env,
    run_forwarding_signals,
)
from rlreplay.errors import CommandNotStarted


def guess_from_argv(command: list[str], framework: str = DEFAULT_FRAMEWORK) -> tuple[str | None, str | None]:
    """(experiment, tokenizer) that the framework's adapter finds on the command line, if any."""
    from rlreplay.adapters.registry import get_adapter

    adapter = get_adapter(argv_framework(framework))
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


def keep_tokenizer(tokenizer: str | None, run_dir: Path) -> tuple[list[str], str | None]:
    """Copy the tokenizer's files (tokenizer.json, its config and chat template, special tokens)
    into the run, so that it decodes and renders prompts on any machine: (names copied, why none
    were). Never raises: a tokenizer that is not on this machine leaves the recording as it is."""
    from rlreplay.errors import TokenizerUnavailable
    from rlreplay.text.token2text import snapshot_tokenizer

    if not tokenizer:
        return [], "no tokenizer named (--tokenizer DIR keeps its files with the run)"
    try:
        return snapshot_tokenizer(tokenizer, run_dir), None
    except (TokenizerUnavailable, OSError) as exc:
        return [], str(exc)


def keep_tokenizer_at_end(tokenizer: str | None, run_dir: Path, kept: list[str]) -> list[str]:
    """When a recording ends: the tokenizer files the run keeps, copied now if they were not on this
    machine when it started (the job may have fetched them: a hub model into the local cache); says
    in one line why the run keeps none."""
    if not kept:
        kept, problem = keep_tokenizer(tokenizer, run_dir)
        if problem:
            print(f"rlreplay: the run keeps no copy of the tokenizer: {problem}", file=sys.stderr)
    return kept


def snapshot_fields(kept: list[str]) -> dict[str, list[str]]:
    """The manifest's field that lists the tokenizer files kept in the run (none when there are none)."""
    from rlreplay.text.token2text import SNAPSHOT_KEY

    return {SNAPSHOT_KEY: kept} if kept else {}


@app.command(
    "record",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def record_command(
    command: Annotated[list[str], typer.Argument(metavar="-- CMD...", help="The training command to run.")],
    out: OutOption = None,
    spool: Annotated[
        Path | None,
        typer.Option(
            "--spool",
            metavar="DIR",
            help="Local folder where processes keep files until uploaded, for a URI --out "
            "(default: $RLREPLAY_SPOOL, else ~/.cache/rlreplay/spool).",
        ),
    ] = None,
    experiment: Annotated[
        str | None,
        typer.Option("--experiment-name", metavar="NAME", help="Experiment name recorded with the run."),
    ] = None,
    experiment_was: ExperimentNameWas = None,
    tokenizer: TokenizerOption = None,
    framework: FrameworkOption = DEFAULT_FRAMEWORK,
    token_signals: Annotated[
        bool,
        typer.Option(
            "--token-signals", help="Also keep the trainer's per-token log-probs (verl: old_log_probs)."
        ),
    ] = False,
    grace: GraceOption = 15.0,
) -> int:
    """Run CMD with recording on in every process.

    Every Python process of the job records; at the end the run is sealed and summarized.
    """
    experiment = EXPERIMENT_NAME.take(experiment, experiment_was)
    return record_run(command, out, spool, experiment, tokenizer, framework, token_signals, grace)


def record_run(
    command: list[str],
    out: str | None,
    spool: Path | None,
    experiment: str | None,
    tokenizer: str | None,
    framework: str,
    token_signals: bool,
    grace: float,
    replay: Any = None,
) -> int:
    """``record``'s work; ``replay`` (``rlreplay.cli.replay.ReplayPlan``) also carries a replay into
    every process, and its summary is added at the end."""
    from rlreplay.adapters.registry import DEFAULT as DEFAULT_ADAPTER
    from rlreplay.adapters.registry import MANIFEST_KEY as ADAPTER_KEY
    from rlreplay.format import manifest
    from rlreplay.read.open import open_run
    from rlreplay.read.summary import recover, run_summary
    from rlreplay.remote import location

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("no command given: rlreplay record [OPTIONS] -- CMD ...")
    from rlreplay.errors import RunError

    try:
        guessed_experiment, guessed_tokenizer = guess_from_argv(command, framework)
    except RunError as exc:
        fail(str(exc))
    experiment = experiment or guessed_experiment
    check_command(command)  # before anything is written: a command that cannot start leaves nothing
    if (uri := location.as_uri(out)) is not None:  # never a local folder named "s3:"
        if replay is not None:
            fail("--out: a replay records into a local run directory")
        from rlreplay.cli.remote import record_to_uri

        return record_to_uri(uri, command, experiment, tokenizer or guessed_tokenizer, spool, grace)
    run_dir = location.local_path(out) if out else default_out(command, experiment)
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--out {run_dir}: exists and is not a directory; give a new run directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        fail(f"{run_dir} already exists and is not empty; recorded runs are never overwritten")
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the folders this creates
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        fail(f"--out {run_dir}: cannot create the run there ({exc.strerror or exc})")
    files_from = None  # a replay keeps its source's tokenizer (the files that rendered the recording)
    if replay is not None and not tokenizer:
        tokenizer, files_from = replay.tokenizer()
    tokenizer = tokenizer or guessed_tokenizer
    files_from = files_from or tokenizer
    kept, _ = keep_tokenizer(files_from, run_dir)  # before the job: the files it renders prompts with
    framework = framework.strip().lower()
    auto = framework == AUTO_FRAMEWORK
    manifest.write_json_atomic(
        run_dir / manifest.MANIFEST,
        manifest.new_manifest(
            experiment,
            command,
            tokenizer=tokenizer,
            status="running",
            # under auto, the job's processes name verl when they trace through it
            **({} if auto else {ADAPTER_KEY: framework}),
            **snapshot_fields(kept),
            **(replay.manifest() if replay is not None else {}),
        ),
    )
    print(f"rlreplay: recording into {run_dir}", file=sys.stderr)
    env = child_env(run_dir, experiment, framework, token_signals)
    if replay is not None:
        env.update(replay.env())
    try:
        code = run_forwarding_signals(command, env)
    except CommandNotStarted:
        _never_started(run_dir, made, kept)
        raise

    recovered = recover(run_dir, wait_s=grace, shards=False)  # just sealed: `recover` checks them
    kept = keep_tokenizer_at_end(files_from, run_dir, kept)
    summary = run_summary(open_run(run_dir))
    detected = {}
    if auto and not manifest.read_manifest(run_dir).get(ADAPTER_KEY):
        detected = {ADAPTER_KEY: DEFAULT_ADAPTER}  # nothing traced through a framework's hook
    manifest.update_manifest(
        run_dir,
        **snapshot_fields(kept),
        **detected,
        ended_at=time.time(),
        exit_code=code,
        status="finished" if code == 0 else "failed",
        **{k: summary[k] for k in ("steps", "trajectories", "spans", "token_ids", "bytes_on_disk")},
        **{k: summary[k] for k in ("dropped", "spilled", "lost", "encode_errors")},
    )
    bpt = summary["bytes_per_token"]
    print(
        f"rlreplay: {run_dir}: {run_counts(summary)}, {summary['bytes_on_disk']:,} bytes on disk"
        + (f" ({bpt:.3f} bytes/token id)" if bpt else "")
        + f"; dropped {summary['dropped']}, spilled {summary['spilled']}, lost {summary['lost']}, "
        f"recovered shards {recovered['recovered_shards']}"
        + (
            f", set aside {recovered['quarantined_files']} unreadable files in {run_dir / '_quarantine'}"
            if recovered["quarantined_files"]
            else ""
        ),
        file=sys.stderr,
    )
    if replay is not None:
        code = replay.report(open_run(run_dir), code)
    return code


def _never_started(run_dir: Path, made: list[Path], kept: list[str]) -> None:
    """The command never started: the run is marked so, then what ``record`` created for it (its
    manifest, the tokenizer files it kept, the folders it made) is removed; what cannot be removed
    stays marked."""
    from rlreplay.format import manifest

    with contextlib.suppress(OSError):
        manifest.update_manifest(run_dir, status="not started", ended_at=time.time())
        for file in kept:
            (run_dir / file).unlink(missing_ok=True)
        (run_dir / manifest.MANIFEST).unlink()
        for folder in made:  # deepest first; a folder something else wrote into stays
            folder.rmdir()
