"""``rlreplay record --out s3://...``: record into local spools, publish to the store, summarize."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlreplay import settings
from rlreplay.cli.app import fail, run_counts


def _say(message: str) -> None:
    print(f"rlreplay: {message}", file=sys.stderr)


def record_to_uri(
    uri: str,
    command: list[str],
    experiment: str | None,
    tokenizer: str | None,
    spool: Path | None,
    grace: float,
) -> int:
    from rlreplay import errors
    from rlreplay.cli.launch import child_env, run_forwarding_signals
    from rlreplay.errors import CommandNotStarted, RunError
    from rlreplay.format import manifest
    from rlreplay.read.open import open_run
    from rlreplay.read.summary import run_summary
    from rlreplay.remote import location, publish

    shown = location.redact(uri)
    try:
        loc = location.location(uri)
    except errors.StorageError as exc:
        fail(str(exc))
    reachable = True
    try:
        if location.exists(loc, manifest.MANIFEST) or location.list_objects(loc, manifest.WORKERS_DIR):
            fail(f"{shown} already holds a run; recorded runs are never overwritten")
    except OSError as exc:
        reachable = False
        _say(f"warning: cannot reach {shown} ({location.error_line(exc)}); recording goes on into the spool")
    spool_root = publish.spool_root(spool).resolve()
    spool_root.mkdir(parents=True, exist_ok=True)
    data = manifest.new_manifest(experiment, command, tokenizer=tokenizer, status="running")
    local_manifest = publish.run_spool(loc, spool_root) / f"run-{os.getpid()}.json"
    if not _publish_manifest(loc, local_manifest, data, tries=3 if reachable else 0) and reachable:
        _say(f"warning: could not write {manifest.MANIFEST} to {shown}; it is written again at the end")

    _say(f"recording into {shown} (spool: {spool_root})")
    env = child_env(Path("."), experiment)
    env[settings.DIR.name] = uri
    env[settings.SPOOL.name] = str(spool_root)
    try:
        code = run_forwarding_signals(command, env)
    except CommandNotStarted:  # after the check `record` made first: the run says it never started
        data.update(ended_at=time.time(), status="not started")
        if _publish_manifest(loc, local_manifest, data):
            local_manifest.unlink(missing_ok=True)
        raise

    live = publish.wait_for_writers(loc, grace)  # processes on every node uploading their last files
    recovered = publish.recover(uri, spool_root, wait_s=grace, timeout_s=max(grace, 1.0))
    data.update(ended_at=time.time(), exit_code=code, status="finished" if code == 0 else "failed")
    summary: dict[str, Any] | None = None
    try:
        summary = run_summary(open_run(uri))
    except RunError as exc:
        _say(f"warning: cannot read the run back: {exc}")
    if summary is not None:
        keys = ("steps", "trajectories", "spans", "token_ids", "bytes_on_disk", "dropped", "spilled", "lost")
        data.update({k: summary[k] for k in (*keys, "encode_errors")})
        data["recovered_shards"] = summary.get("recovered_shards", 0)
    if not _publish_manifest(loc, local_manifest, data):
        _say(f"warning: could not write {manifest.MANIFEST} to {shown}; it is kept in {local_manifest}")
    else:
        local_manifest.unlink(missing_ok=True)
    if summary is not None:
        _say(
            f"{shown}: {run_counts(summary)}; dropped {summary['dropped']}, spilled {summary['spilled']}, "
            f"lost {summary['lost']}, recovered shards {recovered['recovered_shards']}"
        )
    if recovered["live_partials"]:
        _say(f"{recovered['live_partials']} spools of processes still running on this node were left alone")
    if recovered["pending"] or live:
        _say(
            f"{recovered['pending']} files wait in {spool_root} (not uploaded: {recovered['error']}); "
            f"run `rlreplay recover {shown} --spool {spool_root}` once the store is reachable"
            + (f"; {len(live)} processes were still uploading" if live else "")
        )
    return code


def _publish_manifest(loc: Any, local: Path, data: dict[str, Any], tries: int = 2) -> bool:
    """Keep the driver's manifest beside the spools and write it to the store (a few tries)."""
    from rlreplay.remote import location

    local.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    for attempt in range(tries):
        if attempt:
            time.sleep(0.5 * 2**attempt)
        try:
            location.write_json(loc, "run.json", data)
            return True
        except OSError:
            continue
    return False
