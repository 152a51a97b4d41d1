"""The run index: segment files of merged trajectory rows, each naming the sealed shards it covers.

A cache, rebuilt at will: a segment that is damaged, stale (a shard it covers changed or went) or
that covers a shard another segment covers is not used, and only its shards are read again from
their own index files. Segments are written in ``RUN/_run_index/`` (else in the user's cache),
hold at most ``SEGMENT_MAX_SHARDS`` shards, and ``FANOUT`` small ones merge into one, so a live
run's listing writes little and a damaged segment costs little.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rlreplay.format import arrow_ops as ops
from rlreplay.format.index import INDEX_KEY, INDEX_SCHEMA, INDEX_SUFFIX, INDEX_VERSION
from rlreplay.format.schema import KEY_STR, KEYS

#: Segments' folder in the run directory (or, when that cannot be written, in the user's cache).
RUN_INDEX_DIR = "_run_index"
#: The whole-run file that runs written before segments keep; read as one segment.
LEGACY_RUN_INDEX = "_trajectories.index"
RUN_INDEX_KEY = b"rlreplay.run_index_version"
RUN_INDEX_VERSION = b"2"  # 2: pages carry checksums (damage that still decodes is caught)
COVERED_KEY = b"rlreplay.run_index_shards"
#: Runs with fewer sealed shards are listed from their shards' own index files, fast enough.
RUN_INDEX_MIN_SHARDS = 32
#: Rows per row group: a step range reads only the groups (sorted by step) that hold its steps.
RUN_INDEX_ROW_GROUP = 8192
#: Shards one segment covers at most: what a damaged or stale segment costs to read again.
SEGMENT_MAX_SHARDS = 2048
#: This many segments of about the same size merge into one.
FANOUT = 8

#: ``{shard path relative to the run: [bytes, mtime in ns]}``
Covered = dict[str, list[int]]


@dataclass(frozen=True)
class Segment:
    path: Path
    covered: Covered
    folder: Path  # the segment folder it belongs to (a legacy file: its run's)
    file: Any = field(default=None, compare=False, repr=False)  # its open Parquet file, when read


def folders(run_dir: Path) -> list[Path]:
    """Where a run's segments may be: in the run directory, else in the user's cache."""
    import hashlib

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlreplay" / "index"
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:24]
    return [Path(run_dir) / RUN_INDEX_DIR, cache / key]


def find(run_dir: Path) -> tuple[list[Segment], list[tuple[Path, str]]]:
    """The run's segments (their footers read), and ``(path, why)`` of those that are unreadable."""
    found: list[Segment] = []
    bad: list[tuple[Path, str]] = []
    places = folders(run_dir)
    candidates = [(Path(run_dir) / LEGACY_RUN_INDEX, places[0])]
    for folder in places:
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.name.endswith(INDEX_SUFFIX))
        except OSError:
            continue
        candidates += [(folder / name, folder) for name in names if not name.startswith(".")]
    for path, folder in candidates:
        try:
            opened = _open(path)
        except ValueError as exc:
            bad.append((path, str(exc)))
            continue
        if opened is not None:
            found.append(Segment(path, opened[1], folder, opened[0]))
    return found, bad


def steps_of(run_dir: Path, traj_id: str) -> list[int | None]:
    """The steps the run's segments give trajectory ``traj_id`` (a hint: segments are not checked
    against the shards here, and unreadable ones are passed over)."""
    from rlreplay.format import checksums

    places = folders(run_dir)
    paths = [Path(run_dir) / LEGACY_RUN_INDEX]
    for folder in places:
        try:
            paths += [Path(e.path) for e in os.scandir(folder) if e.name.endswith(INDEX_SUFFIX)]
        except OSError:
            continue
    steps: list[int | None] = []
    for path in paths:
        try:
            table = checksums.read_table(path, columns=["id", "step"])
            steps += ops.filter(table["step"], ops.equal(table["id"], traj_id)).to_pylist()
        except (OSError, KeyError, pa.ArrowException, ValueError):
            continue
    return steps


def _open(path: Path) -> tuple[Any, Covered] | None:
    import orjson

    from rlreplay.format.checksums import CheckedParquet

    try:
        # a damaged byte may still decode (to other ids): its checksums tell
        pf = CheckedParquet(path)
        metadata = pf.schema_arrow.metadata or {}
        if metadata.get(RUN_INDEX_KEY) != RUN_INDEX_VERSION or metadata.get(INDEX_KEY) != INDEX_VERSION:
            return None
        covered = orjson.loads(metadata[COVERED_KEY])
        if not isinstance(covered, dict):  # a value that is not a stamp matches no shard: stale
            raise ValueError("bad list of shards")
        if pf.schema_arrow.names != INDEX_SCHEMA.names:
            raise ValueError("not a run index")
        return pf, covered
    except FileNotFoundError:
        return None
    except (OSError, KeyError, orjson.JSONDecodeError, pa.ArrowException, ValueError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc


def read_covered(path: Path) -> Covered | None:
    """The shards a segment covers; None when it is missing or of another version. Raises
    ``ValueError`` when it is unreadable."""
    found = _open(path)
    return None if found is None else found[1]


def read_rows(segment: Segment, steps: Sequence[int] | None = None) -> pa.Table | None:
    """A segment's merged rows (with ``steps``: at least those of these steps, reading only the row
    groups that may hold them); None when it is gone. Raises ``ValueError`` when it is unreadable."""
    found = (segment.file, segment.covered) if segment.file is not None else _open(segment.path)
    if found is None:
        return None
    pf = found[0]
    groups = range(pf.num_row_groups) if steps is None else _step_groups(pf, steps)
    try:
        return ops.cast_table(pf.read_row_groups(list(groups)), INDEX_SCHEMA)
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc


def _step_groups(pf: Any, steps: Sequence[int]) -> list[int]:
    """Row groups of a segment (sorted by step) whose step statistics may hold one of ``steps``."""
    column = INDEX_SCHEMA.get_field_index("step")
    wanted = np.asarray(sorted(set(steps)), dtype=np.int64)
    out = []
    for i in range(pf.num_row_groups):
        stats = pf.metadata.row_group(i).column(column).statistics
        if stats is None or not stats.has_min_max:
            if stats is None or stats.null_count != pf.metadata.row_group(i).num_rows:
                out.append(i)
            continue
        first = np.searchsorted(wanted, stats.min)
        if first < len(wanted) and wanted[first] <= stats.max:
            out.append(i)
    return out


def choose(
    segments: Sequence[Segment], stamps: Covered, prefixes: tuple[str, ...] | None = None
) -> tuple[list[Segment], list[Segment]]:
    """(used, not used): the segments whose shards (those under ``prefixes``, when given) are all
    as they are now (``stamps``), no two covering the same shard, the largest first."""
    used: list[Segment] = []
    unused: list[Segment] = []
    taken: set[str] = set()
    for segment in sorted(segments, key=lambda s: (-len(s.covered), s.path.name, str(s.path))):
        mine = _under(segment.covered, prefixes)
        if mine and all(stamps.get(rel) == stamp for rel, stamp in mine.items()) and taken.isdisjoint(mine):
            used.append(segment)
            taken.update(mine)
        else:
            unused.append(segment)
    return used, unused


def _under(covered: Covered, prefixes: tuple[str, ...] | None) -> Covered:
    if prefixes is None:
        return covered
    return {rel: stamp for rel, stamp in covered.items() if rel.startswith(prefixes)}


def covered_by(segments: Sequence[Segment], prefixes: tuple[str, ...] | None = None) -> set[str]:
    return {rel for s in segments for rel in _under(s.covered, prefixes)}


def to_merge(segments: Sequence[Segment]) -> list[Segment]:
    """Segments to merge into one: up to ``FANOUT`` of the smallest of a size tier holding
    ``FANOUT`` or more, as many as fit in one segment; none when no tier is that full."""
    tiers: dict[int, list[Segment]] = defaultdict(list)
    for segment in segments:
        tiers[int(math.log(max(len(segment.covered), 1), FANOUT))].append(segment)
    for tier in sorted(tiers):
        members = sorted(tiers[tier], key=lambda s: (len(s.covered), s.path.name))
        if len(members) < FANOUT:
            continue
        picked: list[Segment] = []
        total = 0
        for segment in members[:FANOUT]:
            if total + len(segment.covered) > SEGMENT_MAX_SHARDS:
                break
            picked.append(segment)
            total += len(segment.covered)
        if len(picked) >= 2:
            return picked
    return []


def write(rows: pa.Table, covered: Covered, folder: Path) -> Segment:
    """Write merged rows covering the shards ``covered`` as a new segment in ``folder``, atomically
    (temp name, rename)."""
    import secrets
    import time

    import orjson

    from rlreplay.format import checksums

    folder.mkdir(parents=True, exist_ok=True)
    rows = rows.set_column(
        rows.schema.get_field_index("row_groups"), "row_groups", pa.nulls(rows.num_rows, pa.list_(pa.int32()))
    )
    metadata = {
        **INDEX_SCHEMA.metadata,
        RUN_INDEX_KEY: RUN_INDEX_VERSION,
        COVERED_KEY: orjson.dumps(dict(sorted(covered.items()))),
    }
    name = f"{time.time_ns():x}-{secrets.token_hex(4)}{INDEX_SUFFIX}"
    path = folder / name
    tmp = folder / f".{name}.tmp"
    try:
        order = [(c, "ascending") for k in KEYS for c in (k, KEY_STR[k])] + [("start_ns", "ascending")]
        checksums.write_table(
            ops.sort_by(rows, [*order, ("id", "ascending")]).replace_schema_metadata(metadata),
            tmp,
            row_group_rows=RUN_INDEX_ROW_GROUP,
            compression="snappy",
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return Segment(path, covered, folder)


def remove(paths: Sequence[Path]) -> None:
    """Remove segments (those that cannot be removed, in a read-only place, stay unused)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
