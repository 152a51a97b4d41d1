"""Recovery after a crash: salvage torn live files, seal them, quarantine what cannot be read."""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.errors import FormatError, UnsafePathError
from rlreplay.format.manifest import QUARANTINE_DIR, quarantine, safe_run_path
from rlreplay.format.schema import (
    file_version,
    upgrade,
)
from rlreplay.shards.layout import PARTIAL_SUFFIX, SEALED_SUFFIX, SPANS_DIR, fsync_dir, sealed_path_for
from rlreplay.shards.lease import is_live, live_leases
from rlreplay.shards.live import BODY_CRC
from rlreplay.shards.seal import write_sealed


@dataclass
class Salvage:
    """What a damaged stream file still holds: its whole batches, and the byte ranges that are not."""

    table: pa.Table
    batches: int
    bad_ranges: list[tuple[int, int]]
    clean: bool  # ended with the end-of-stream marker


_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def salvage_partial(path: Path) -> Salvage:
    """Every readable batch of a stream file, also after garbage in its middle (the reader resyncs
    at the next message marker); raises FormatError when even its header is unusable."""
    import mmap

    size = path.stat().st_size
    if size == 0:
        raise FormatError(f"{path}: empty file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = pa.memory_map(str(path)).read_buffer(size)  # batches may point into it: arrow owns it
        try:
            src = pa.BufferReader(buf)
            schema = pa.ipc.read_schema(pa.ipc.read_message(src))
            header = buf.slice(0, src.tell())
        except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
            raise FormatError(f"{path}: unreadable stream header ({exc})") from exc
        version = file_version(schema, str(path))
        batches: list[pa.RecordBatch] = []
        bad: list[tuple[int, int]] = []
        pos = src.tell()
        clean = False
        while pos < size:
            if mm[pos : pos + 8] == _END_OF_STREAM and pos + 8 == size:
                clean = True
                break
            try:
                src.seek(pos)
                message = pa.ipc.read_message(src)
                if message.type != "record batch":
                    raise ValueError(f"unexpected {message.type} message")
                batch = _checked_batch(header, message)
                batch.validate(full=True)
                batches.append(batch)
                pos = src.tell()
            except (pa.ArrowException, OSError, EOFError, ValueError):
                following = mm.find(_CONTINUATION, pos + 1)
                end = size if following < 0 else following
                if bad and bad[-1][1] == pos:
                    bad[-1] = (bad[-1][0], end)
                else:
                    bad.append((pos, end))
                pos = end
        table = pa.Table.from_batches(batches, schema=schema)
    if version == 1:
        table = upgrade(table)
    return Salvage(table, len(batches), bad, clean)


def _checked_batch(header: pa.Buffer, message: pa.ipc.Message) -> pa.RecordBatch:
    """A record batch message read as a batch; ValueError if its body's CRC-32 (when written with
    one) does not match."""
    stream = pa.ipc.open_stream(pa.BufferReader(header.to_pybytes() + message.serialize().to_pybytes()))
    batch, metadata = stream.read_next_batch_with_custom_metadata()
    expected = metadata.get(BODY_CRC.encode()) if metadata is not None else None
    if expected is not None and int(expected) != zlib.crc32(message.body):
        raise ValueError("batch body does not match its checksum")
    return batch


@dataclass
class Recovered:
    """One file ``recover`` dealt with: what it kept (a sealed shard) and what it set aside, and why."""

    path: Path
    sealed: Path | None = None
    rows: int = 0
    set_aside: list[Path] | None = None
    set_aside_bytes: int = 0
    removed: str = ""  # why the partial was removed: every row of it sealed, or it was empty
    note: str = ""


@dataclass
class Recovery:
    files: list[Recovered]
    live: list[Path]  # still held by a running writer: left untouched

    @property
    def sealed(self) -> list[Recovered]:
        return [r for r in self.files if r.sealed is not None]


def _rel(run_dir: Path, path: Path) -> Path:
    return path.relative_to(run_dir)


def _quarantine_file(run_dir: Path, path: Path) -> Path:
    return quarantine(run_dir, path)


def _quarantine_ranges(run_dir: Path, partial: Path, ranges: list[tuple[int, int]]) -> list[Path]:
    """Copy the unreadable byte ranges of ``partial`` to the quarantine (durably), one file each."""
    out = []
    rel = _rel(run_dir, partial)
    with open(partial, "rb") as src:
        for start, end in ranges:
            target = safe_run_path(run_dir, QUARANTINE_DIR, rel.parent, f"{rel.name}.bytes-{start}-{end}")
            target.parent.mkdir(parents=True, exist_ok=True)
            src.seek(start)
            with open(target, "wb") as f:
                f.write(src.read(end - start))
                f.flush()
                os.fsync(f.fileno())
            out.append(target)
    if out:
        fsync_dir(out[0].parent)
    return out


def _sealed_rows(path: Path) -> int | None:
    """Rows of a readable rlreplay sealed file, None if it is not one."""
    try:
        pf = pq.ParquetFile(path)
        file_version(pf.schema_arrow, str(path))
        return pf.metadata.num_rows
    except (pa.ArrowException, OSError, FormatError, ValueError):
        return None


def recover_partial(run_dir: Path, partial: Path) -> Recovered:
    """Seal what a dead writer's partial holds; whatever cannot be read goes to ``RUN/_quarantine/``.

    Nothing is deleted unless every byte of it is kept elsewhere; nothing outside the run is touched.
    """
    result = Recovered(partial)
    safe_run_path(run_dir, _rel(run_dir, partial))
    final = sealed_path_for(partial)
    if partial.stat().st_size == 0:  # created, never written: nothing to keep or set aside
        partial.unlink()
        result.removed = "empty"
        return result
    try:
        salvage = salvage_partial(partial)
    except (FormatError, OSError, ValueError) as exc:
        size = partial.stat().st_size
        result.set_aside = [_quarantine_file(run_dir, partial)]
        result.set_aside_bytes = size
        result.note = " ".join(str(exc).replace(str(partial), "").split()).strip(": ")[:160]
        return result
    rows = salvage.table.num_rows
    bad_bytes = sum(end - start for start, end in salvage.bad_ranges)
    if final.exists() or final.is_symlink():
        safe_run_path(run_dir, _rel(run_dir, final))
        existing = _sealed_rows(final)
        if existing is None:
            moved = _quarantine_file(run_dir, final)
            result.set_aside = [moved]
            result.note = f"a foreign or corrupt {final.name} stood in the way"
        elif existing == rows:  # sealed before a crash that left the partial behind
            result.set_aside = _quarantine_ranges(run_dir, partial, salvage.bad_ranges)
            result.set_aside_bytes = bad_bytes
            partial.unlink()
            result.removed = "every row already sealed"
            result.note = f"already sealed in {final.name}"
            return result
        else:
            result.set_aside_bytes = partial.stat().st_size
            result.set_aside = [_quarantine_file(run_dir, partial)]
            result.note = f"{final.name} exists with {existing} rows, this file holds {rows}"
            return result
    if rows == 0 and salvage.bad_ranges:
        result.set_aside = [*(result.set_aside or []), _quarantine_file(run_dir, partial)]
        result.set_aside_bytes = bad_bytes
        result.note = "no readable batch"
        return result
    if rows:
        write_sealed(
            salvage.table,
            final,
            {
                b"rlreplay.recovered": b"true",
                b"rlreplay.discarded_bytes": str(bad_bytes).encode(),
            },
        )
        result.sealed, result.rows = final, rows
    if salvage.bad_ranges:
        result.set_aside = [
            *(result.set_aside or []),
            *_quarantine_ranges(run_dir, partial, salvage.bad_ranges),
        ]
        result.set_aside_bytes = bad_bytes
        ranges = len(salvage.bad_ranges)
        result.note = f"{ranges} unreadable byte range{'s' if ranges > 1 else ''}" + (
            " (a torn tail)" if ranges == 1 and salvage.bad_ranges[0][1] == partial.stat().st_size else ""
        )
    partial.unlink()
    result.removed = "every row sealed"
    return result


def recover_run(run_dir: Path, wait_s: float = 0.0) -> Recovery:
    """Seal every partial whose writer is gone; first wait up to ``wait_s`` for recording processes
    (their leases) to end, so that nothing is sealed while a process may still write.

    Partials still held open by a live writer are left untouched; so is anything that resolves
    outside the run directory (a symlinked folder).
    """
    run_dir = Path(run_dir)
    spans = Path(run_dir, SPANS_DIR)
    deadline = time.monotonic() + wait_s
    while live_leases(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    while True:
        partials = sorted(spans.glob(f"step=*/worker=*/_part-*{PARTIAL_SUFFIX}"))
        live = [p for p in partials if is_live(p)]
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    files: list[Recovered] = []
    for tmp in spans.glob("step=*/worker=*/_part-*.index.tmp"):
        with contextlib.suppress(OSError):
            safe_run_path(run_dir, _rel(run_dir, tmp))
            tmp.unlink()  # an index written before its shard's rename: rebuilt when sealed again
    for tmp in sorted(spans.glob("step=*/worker=*/_part-*.parquet.tmp")):
        # a compaction that died before its rename: its rows are still in the partial
        partial = tmp.with_name(tmp.name[1:].removesuffix(SEALED_SUFFIX + ".tmp") + PARTIAL_SUFFIX)
        try:
            if partial.exists():
                safe_run_path(run_dir, _rel(run_dir, tmp))
                tmp.unlink()
            else:
                moved = _quarantine_file(run_dir, tmp)
                files.append(Recovered(tmp, set_aside=[moved], note="an unfinished compaction"))
        except (UnsafePathError, OSError) as exc:
            files.append(Recovered(tmp, note=f"left alone: {exc}"))
    for partial in partials:
        if partial in live or not partial.exists():
            continue
        try:
            files.append(recover_partial(run_dir, partial))
        except UnsafePathError:
            files.append(Recovered(partial, note="left alone: it resolves outside the run directory"))
        except (FormatError, OSError, pa.ArrowException, ValueError) as exc:
            files.append(Recovered(partial, note=f"left alone: {' '.join(str(exc).split())[:160]}"))
    return Recovery(files, live)
