"""Recovery after a crash: salvage torn live files, seal them, quarantine what cannot be read."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from rlreplay.errors import DamagedFileError, FormatError, UnsafePathError
from rlreplay.format import index as tindex
from rlreplay.format.checksums import CheckedParquet
from rlreplay.format.manifest import QUARANTINE_DIR, quarantine, safe_run_path
from rlreplay.format.schema import (
    file_version,
)
from rlreplay.shards.layout import (
    PARTIAL_SUFFIX,
    SEALED_SUFFIX,
    SPANS_DIR,
    fsync_dir,
    new_uid,
    sealed_path_for,
)
from rlreplay.shards.lease import is_live, live_leases
from rlreplay.shards.live import salvage_partial
from rlreplay.shards.seal import write_sealed


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
    """Rows of a readable rlreplay sealed file matching its checksums, None if it is not one."""
    try:
        with CheckedParquet(path) as pf:
            file_version(pf.schema_arrow, str(path))
            pf.verify()
            return pf.metadata.num_rows
    except (pa.ArrowException, OSError, FormatError, ValueError):
        return None


def recover_shard(run_dir: Path, shard: Path) -> Recovered | None:
    """Check a sealed shard in full against its checksums: None when it matches them (or was
    written without them, or is no rlreplay file). One that does not is set aside in
    ``RUN/_quarantine/`` with its index file, and its row groups that still match are sealed
    again as a new shard (each row group holds whole trajectories of the file)."""
    safe_run_path(run_dir, _rel(run_dir, shard))
    result = Recovered(shard)
    table = None
    try:
        with CheckedParquet(shard) as pf:
            file_version(pf.schema_arrow, str(shard))
            try:
                pf.verify()
                return None
            except DamagedFileError:
                pass
            metadata = pf.metadata
            good, bad = [], []
            for i in range(pf.num_row_groups):
                try:
                    pf.verify([i])
                    good.append(i)
                except DamagedFileError:
                    bad.append(i)
            if good:
                table = pf.read_row_groups(good)
            result.set_aside_bytes = sum(
                metadata.row_group(i).column(j).total_compressed_size
                for i in bad
                for j in range(metadata.num_columns)
            )
            groups = ", ".join(map(str, bad))
            result.note = (
                f"row group{'s' if len(bad) > 1 else ''} {groups} of {pf.num_row_groups} "
                "did not match their checksums"
            )
    except DamagedFileError as exc:  # its footer: nothing in it can be trusted
        result.set_aside_bytes = shard.stat().st_size
        result.note = _one_line(str(exc).replace(str(shard), "").strip(": "))
    except (pa.ArrowException, OSError, FormatError, ValueError):
        return None  # unreadable without checksums to tell why: readers name it, it is left as it is
    index = tindex.index_path(shard)
    result.set_aside = [_quarantine_file(run_dir, shard)]  # first: its rows are never listed twice
    if index.exists():
        result.set_aside.append(_quarantine_file(run_dir, index))
    if table is not None and table.num_rows:
        final = shard.with_name(f"part-{new_uid()}{SEALED_SUFFIX}")
        write_sealed(
            table, final, {b"rlreplay.recovered": b"true", b"rlreplay.salvaged_from": shard.name.encode()}
        )
        result.sealed, result.rows = final, table.num_rows
    return result


def _one_line(text: str) -> str:
    return " ".join(text.split())[:160]


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


def recover_run(run_dir: Path, wait_s: float = 0.0, shards: bool = True) -> Recovery:
    """Seal every partial whose writer is gone; first wait up to ``wait_s`` for recording processes
    (their leases) to end, so that nothing is sealed while a process may still write. With
    ``shards``, then check every sealed shard in full against its checksums (``recover_shard``:
    reads every byte of the run).

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
            files.append(Recovered(partial, note=f"left alone: {_one_line(str(exc))}"))
    if shards:
        for shard in sorted(spans.glob(f"step=*/worker=*/part-*{SEALED_SUFFIX}")):
            try:
                checked = recover_shard(run_dir, shard)
            except UnsafePathError:
                checked = Recovered(shard, note="left alone: it resolves outside the run directory")
            except (FormatError, OSError, pa.ArrowException, ValueError) as exc:
                checked = Recovered(shard, note=f"left alone: {_one_line(str(exc))}")
            if checked is not None:
                files.append(checked)
    return Recovery(files, live)
