"""Run-level summaries and recovery bookkeeping, shared by ``info``, ``recover`` and ``record``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlreplay.errors import RunError
from rlreplay.format import arrow_ops as ops
from rlreplay.format import manifest
from rlreplay.format import redact as redaction
from rlreplay.read.run import Run
from rlreplay.shards.recover import recover_run

#: Keys of ``run_summary`` that come from the recording processes' counters, not from the files.
RECORDER_KEYS = (
    "spans_written",
    "dropped",
    "spilled",
    "lost",
    "encode_errors",
    "refused_calls",
    "recovered_shards",
)


def run_summary(run: Run) -> dict[str, Any]:
    """Counts of what is on disk now (the same rows ``ls`` and ``Run.spans`` read, live files
    included), then what the recording processes reported (their counters, ``RECORDER_KEYS``:
    ``spans_written`` is their count of spans, which can lag behind or exceed what is on disk)."""
    spans = run.spans(columns=["trajectory_id", "step", "step_str", "num_tokens"])
    steps = {v for c in ("step", "step_str") for v in ops.drop_null(ops.unique(spans[c])).to_pylist()}
    tokens = int(ops.sum(spans["num_tokens"]).as_py() or 0) if spans.num_rows else 0
    size = run.stored_bytes()
    cache = run.store.cache_dir  # a run on an object store is read through a local cache
    m = run.manifest
    return {
        "run": run.address,
        **({"cache": str(cache)} if cache is not None else {}),
        "run_id": m.get("run_id"),
        "experiment": m.get("experiment"),
        "tokenizer": m.get("tokenizer"),
        "command": " ".join(
            redaction.redact_argv([str(a) for a in m.get("command") or []])
        ),  # older runs too
        "steps": len(steps),
        "trajectories": len(ops.unique(spans["trajectory_id"])) if spans.num_rows else 0,
        "spans": spans.num_rows,
        "token_ids": tokens,
        "bytes_on_disk": size,
        "bytes_per_token": round(size / tokens, 3) if tokens else None,
        # span files that could not be read (what is counted above leaves them out), and those read
        # without checksums (written before them)
        "unreadable_files": len(run.unreadable),
        "unverified_files": len(run.unverified),
        **{("spans_written" if k == "spans" else k): v for k, v in run.counters().items()},
    }


def recover(run_dir: Path, wait_s: float = 0.0, shards: bool = True) -> dict[str, Any]:
    """Seal partials whose writers are gone (with ``shards``, also check every sealed shard against
    its checksums, salvaging what still matches) and add what was recovered to the manifest.

    ``files`` lists one line per file dealt with: what was kept, and what was set aside in
    ``RUN/_quarantine/`` (never deleted) or left alone, and why.
    """
    recovery = recover_run(run_dir, wait_s, shards)
    sealed = recovery.sealed
    set_aside = [p for r in recovery.files for p in (r.set_aside or [])]
    totals: dict[str, Any] = {
        "recovered_shards": len(sealed),
        "recovered_spans": sum(r.rows for r in sealed),
        "discarded_bytes": sum(r.set_aside_bytes for r in recovery.files),
        "quarantined_files": len(set_aside),
        "live_partials": len(recovery.live),
        "files": [_describe(Path(run_dir), r) for r in recovery.files],
    }
    if recovery.files and (Path(run_dir) / manifest.MANIFEST).exists():
        current = manifest.read_manifest(run_dir)
        manifest.update_manifest(
            run_dir,
            **{
                key: int(current.get(key, 0) or 0) + totals[key]
                for key in ("recovered_shards", "recovered_spans", "discarded_bytes", "quarantined_files")
            },
        )
    _refresh_run_index(Path(run_dir))
    return totals


def _refresh_run_index(run_dir: Path) -> None:
    """Bring the run index up to date with the shards just sealed or set aside."""
    try:
        Run(run_dir).index()
    except (RunError, ValueError, OSError):
        return  # the next listing reads the shards themselves


def _describe(run_dir: Path, r: Any) -> str:
    def rel(path: Path) -> str:
        try:
            return str(path.relative_to(run_dir))
        except ValueError:
            return str(path)

    parts = [rel(r.path) + ":"]
    if r.sealed is not None:
        parts.append(f"kept {r.rows} spans in {r.sealed.name}")
    elif r.removed:
        parts.append(f"removed ({r.removed})")
    if r.set_aside:
        size = f" ({r.set_aside_bytes:,} bytes)" if r.set_aside_bytes else ""
        parts.append(f"set aside{size} in " + ", ".join(rel(p) for p in r.set_aside))
    if r.note:
        parts.append(f"[{r.note}]")
    return " ".join(parts)
