"""Rewriting a run recorded in an older file format into the current one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.errors import FormatError
from rlreplay.format import arrays as token_arrays
from rlreplay.format import manifest, payload
from rlreplay.format.schema import (
    FORMAT_VERSION,
    SPAN_SCHEMA,
    TOKEN_COLUMNS,
)
from rlreplay.read.open import open_run
from rlreplay.recorder import rows
from rlreplay.shards.layout import LEASE_DIR, sealed_path_for
from rlreplay.shards.seal import write_sealed


@dataclass
class RewriteResult:
    files: int
    spans: int
    source_bytes: int
    bytes: int


def rewrite_run(src: Path, dst: Path) -> RewriteResult:
    """Re-encode every span file of run ``src`` (format 1 or 2, sealed or live) into a new run
    ``dst`` in the current format, sealed; the manifest and worker counters are copied.

    Payloads are decoded and encoded again (typed token arrays, shared prefixes); every value
    reads back as before. ``dst`` must not exist yet.
    """
    import json
    import shutil

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    run = open_run(src)
    dst.mkdir(parents=True)
    if (src / manifest.MANIFEST).exists():
        data = json.loads((src / manifest.MANIFEST).read_text())
        data["format_version"] = FORMAT_VERSION
        manifest.write_json_atomic(dst / manifest.MANIFEST, data)
    if (src / LEASE_DIR).is_dir():
        (dst / LEASE_DIR).mkdir()
        for path in (src / LEASE_DIR).glob("*.json"):
            shutil.copy2(path, dst / LEASE_DIR / path.name)
    sealed, partials = run.span_files()
    result = RewriteResult(0, 0, 0, 0)
    plain = [c for c in SPAN_SCHEMA.names if c not in TOKEN_COLUMNS and c not in ("inputs", "output")]
    for path in sealed + partials:
        is_sealed = path in sealed
        table = run.file_rows(path)
        if table is None:
            raise FormatError(f"{path}: unreadable ({'; '.join(run.warnings)})")
        here = set(table["span_id"].to_pylist())
        ids = list(dict.fromkeys(table["trajectory_id"].to_pylist()))
        originals = {r["span_id"]: r for r in table.select(plain).to_pylist()}
        out_rows = []
        for traj in run.load(ids):
            prefixes = token_arrays.SharedIndex()
            for span in sorted(traj.spans, key=lambda s: (s.end_ns, s.start_ns)):
                arrays = token_arrays.Arrays(prefixes)
                inputs = None if span.inputs is None else payload.dumps(arrays.extract(span.inputs))
                output = None if span.output is None else payload.dumps(arrays.extract(span.output))
                prefixes.add(span.span_id, arrays)
                if span.span_id not in here:
                    continue
                row = dict(originals[span.span_id])
                prompt, response = rows.token_counts(span.kind, span.inputs, span.output)
                if row["prompt_tokens"] is None:
                    row["prompt_tokens"] = prompt
                if row["response_tokens"] is None:
                    row["response_tokens"] = response
                row.update(inputs=inputs, output=output)
                row.update(zip(TOKEN_COLUMNS, arrays.columns()))
                out_rows.append(row)
        buf = rows.StepBuffer()
        for row in out_rows:
            buf.append(tuple(row[c] for c in SPAN_SCHEMA.names), 0)
        batch, _ = buf.take_batch()  # rows read back from a shard: nothing for Arrow to refuse
        final = dst / (path.relative_to(src) if is_sealed else sealed_path_for(path).relative_to(src))
        final.parent.mkdir(parents=True, exist_ok=True)
        extra = {}
        if is_sealed:
            metadata = pq.read_schema(path).metadata or {}
            extra = {
                k: v
                for k, v in metadata.items()
                if k.startswith(b"rlreplay.") and k != b"rlreplay.format_version"
            }
        write_sealed(pa.Table.from_batches([batch]), final, extra)
        result.files += 1
        result.spans += batch.num_rows
        result.source_bytes += path.stat().st_size
        result.bytes += final.stat().st_size
    return result
