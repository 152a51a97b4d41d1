"""Run-level summaries and recovery bookkeeping, shared by ``info``, ``recover`` and ``record``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from rlreplay import manifest
from rlreplay.shards import SPANS_DIR, recover_run
from rlreplay.store import Run


def disk_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(run_dir, SPANS_DIR).rglob("*") if p.is_file())


#: Keys of ``run_summary`` that come from the recording processes' counters, not from the files.
RECORDER_KEYS = ("spans_written", "dropped", "spilled", "lost", "encode_errors", "recovered_shards")


def run_summary(run: Run) -> dict[str, Any]:
    """Counts of what is on disk now (the same rows ``ls`` and ``Run.spans`` read, live files
    included), then what the recording processes reported (their counters, ``RECORDER_KEYS``:
    ``spans_written`` is their count of spans, which can lag behind or exceed what is on disk)."""
    spans = run.spans(columns=["trajectory_id", "step", "step_str", "num_tokens"])
    steps = {v for c in ("step", "step_str") for v in pc.unique(spans[c]).drop_null().to_pylist()}
    tokens = int(pc.sum(spans["num_tokens"]).as_py() or 0) if spans.num_rows else 0
    size = disk_bytes(run.path)
    m = run.manifest
    return {
        "run": str(run.path),
        "run_id": m.get("run_id"),
        "experiment": m.get("experiment"),
        "tokenizer": m.get("tokenizer"),
        "command": " ".join(manifest.redact_argv([str(a) for a in m.get("command") or []])),  # older runs too
        "steps": len(steps),
        "trajectories": len(pc.unique(spans["trajectory_id"])) if spans.num_rows else 0,
        "spans": spans.num_rows,
        "token_ids": tokens,
        "bytes_on_disk": size,
        "bytes_per_token": round(size / tokens, 3) if tokens else None,
        **{("spans_written" if k == "spans" else k): v for k, v in run.counters().items()},
    }


def recover(run_dir: Path, wait_s: float = 0.0) -> dict[str, int]:
    """Seal partials whose writers are gone and add what was recovered to the manifest."""
    results, live = recover_run(run_dir, wait_s)
    recovered = [r for r in results if r.sealed is not None]
    totals = {
        "recovered_shards": len(recovered),
        "recovered_spans": sum(r.rows for r in recovered),
        "discarded_bytes": sum(r.discarded_bytes for r in results),
        "live_partials": len(live),
    }
    if results and (Path(run_dir) / manifest.MANIFEST).exists():
        current = manifest.read_manifest(run_dir)
        manifest.update_manifest(
            run_dir,
            recovered_shards=int(current.get("recovered_shards", 0) or 0) + totals["recovered_shards"],
            recovered_spans=int(current.get("recovered_spans", 0) or 0) + totals["recovered_spans"],
            discarded_bytes=int(current.get("discarded_bytes", 0) or 0) + totals["discarded_bytes"],
        )
    return totals
