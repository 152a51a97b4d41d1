"""What the web app reads: the runs under its root, cached listings, selections, per-step stats.

Every path the app touches comes from listing the root folder, never from a request: a request
names a run by a name found there and a trajectory by its hex id.
"""

from __future__ import annotations

import math
import os
import re
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlreplay import manifest
from rlreplay.store import Run, RunError, open_run

SPANS_DIR = "spans"
WORKERS_DIR = "_workers"
PAGE_SIZES = (25, 50, 100, 200, 500)
DEFAULT_PAGE_SIZE = 100
KEY_COLUMNS = ("step", "sample_index", "rollout_n")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,200}$")
_SORT_ITEM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(asc|desc)?\s*$", re.IGNORECASE)


class NotFound(RunError):
    """A run or trajectory the app does not have (answered with 404)."""


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / manifest.MANIFEST).is_file() or (path / SPANS_DIR).is_dir())


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:
        return False


class RunSet:
    """One run, or every run directly inside a folder (runs appear as they are created)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if not path.is_dir():
            raise RunError(f"no run or folder of runs at {path}")
        self.root = path.resolve()
        self.single = is_run_dir(self.root)
        if self.single:
            open_run(self.root)  # fails early on an unreadable manifest
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        if self.single:
            return [self.root.name]
        found = []
        for entry in os.scandir(self.root):
            path = Path(entry.path)
            # a symlink leading out of the folder is not one of its runs
            if _NAME.match(entry.name) and _inside(path, self.root) and is_run_dir(path):
                found.append(entry.name)
        return sorted(found)

    def get(self, name: str) -> RunView:
        if not _NAME.match(name) or name not in self.names():
            raise NotFound(f"no run named {name!r}")
        with self._lock:
            view = self._views.get(name)
            if view is None:
                path = self.root if self.single else self.root / name
                view = self._views[name] = RunView(open_run(path))
                threading.Thread(target=view.decoder, daemon=True).start()  # load the tokenizer early
            return view


# ---- a run, cached by the files it holds ------------------------------------------------------


def file_signature(run_dir: Path) -> tuple[Any, ...]:
    """(name, size, mtime) of every span and counter file: changes whenever anything is written."""
    out: list[tuple[str, int, int]] = []
    stack = [run_dir / SPANS_DIR, run_dir / WORKERS_DIR]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    out.append((entry.path, st.st_size, st.st_mtime_ns))
            except OSError:
                continue
    out.sort()
    return tuple(out)


class RunView:
    """A run with its listing cached until its files change, and its tokenizer loaded once."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.name = run.path.name
        self._lock = threading.Lock()
        self._listing: tuple[tuple[Any, ...], pa.Table] | None = None
        self._decoder: Any = None
        self._decoder_error: str | None = None
        self._decoder_loaded = False

    def version(self) -> str:
        sig = file_signature(self.run.path)
        return f"{len(sig)}-{sum(s[1] for s in sig)}-{max((s[2] for s in sig), default=0)}"

    def manifest(self) -> dict[str, Any]:
        try:
            return manifest.read_manifest(self.run.path)
        except (OSError, ValueError):
            return dict(self.run.manifest)

    def counters(self) -> dict[str, int]:
        return self.run.counters()

    def listing(self) -> pa.Table:
        """Every trajectory of the run (the ``ls`` columns), re-read only when files change."""
        sig = file_signature(self.run.path)
        with self._lock:
            if self._listing is not None and self._listing[0] == sig:
                return self._listing[1]
            table = self.run.trajectories()
            self._listing = (sig, table)
            return table

    def row(self, traj_id: str) -> dict[str, Any] | None:
        table = self.listing()
        found = table.filter(pc.equal(table["id"], traj_id))
        return found.to_pylist()[0] if found.num_rows else None

    def trajectory(self, ref: str) -> Any:
        if not re.fullmatch(r"[0-9a-fA-F]{1,64}", ref or ""):
            raise NotFound(f"not a trajectory id: {ref!r}")
        try:
            return self.run.trajectory(ref)
        except RunError as exc:
            raise NotFound(str(exc)) from None

    def decoder(self) -> Any:
        """The run's tokenizer, or None (``decoder_error`` says why)."""
        with self._lock:
            if not self._decoder_loaded:
                from rlreplay.token2text import Decoder, resolve_tokenizer

                self._decoder_loaded = True
                name = resolve_tokenizer(self.run, None)
                if name is None:
                    self._decoder_error = "no tokenizer is named in the run's manifest: showing token ids"
                else:
                    try:
                        self._decoder = Decoder.load(name)
                    except RunError as exc:
                        self._decoder_error = f"{exc} (showing token ids)"
            return self._decoder

    @property
    def decoder_error(self) -> str | None:
        return self._decoder_error


# ---- selection: the grammar of ``ls`` ----------------------------------------------------------


@dataclass
class ListQuery:
    """The trajectory list's query string; every field is a plain string as typed."""

    step: str = ""
    sample_index: str = ""
    rollout_n: str = ""
    split: str = ""  # "", "train", "val"
    experiment: str = ""
    status: str = ""  # "", "ok", "error", "incomplete"
    where: str = ""
    sort: str = ""
    page: int = 1
    per: int = DEFAULT_PAGE_SIZE

    @classmethod
    def from_params(cls, params: Any) -> ListQuery:
        q = cls()
        for f in fields(cls):
            raw = params.get(f.name)
            if raw is None:
                continue
            if f.type in ("int", int):
                try:
                    setattr(q, f.name, max(1, int(raw)))
                except ValueError:
                    raise RunError(f"{f.name} must be a whole number, not {raw!r}") from None
            else:
                setattr(q, f.name, str(raw).strip())
        q.per = min(q.per, PAGE_SIZES[-1])
        return q

    def params(self, **override: Any) -> dict[str, str]:
        """The non-default fields as query parameters (for links), with ``override`` applied."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(override)
        defaults = ListQuery()
        return {k: str(v) for k, v in values.items() if v not in ("", None) and v != getattr(defaults, k)}


def parse_keys(text: str, known: list[Any] | None = None) -> tuple[list[Any], list[tuple[int, int]]]:
    """Values and inclusive ranges from ``5``, ``3..7``, ``0..10,20,-1`` (negative: from the end of
    ``known``) or non-int values such as ``s1-3``."""
    values: list[Any] = []
    ranges: list[tuple[int, int]] = []
    ordered = sorted(v for v in (known or []) if isinstance(v, int))
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if ".." in item:
            lo, _, hi = item.partition("..")
            try:
                ranges.append((_int_key(lo, ordered), _int_key(hi, ordered)))
            except ValueError:
                raise RunError(f"not a range: {item!r} (expected e.g. 3..7)") from None
            continue
        try:
            values.append(_int_key(item, ordered))
        except ValueError:
            values.append(item)
    return values, ranges


def _int_key(text: str, ordered: list[int]) -> int:
    value = int(text.strip())
    if value < 0 and ordered:
        if -value > len(ordered):
            raise RunError(f"{value}: the run has only {len(ordered)} values")
        return ordered[value]
    return value


def _key_mask(table: pa.Table, column: str, text: str) -> pa.ChunkedArray | pa.Array:
    known = pc.unique(table[column]).drop_null().to_pylist() if table.num_rows else []
    values, ranges = parse_keys(text, known)
    ints = [v for v in values if isinstance(v, int)]
    strs = [v for v in values if not isinstance(v, int)]
    col = table[column]
    mask = pc.is_in(col, value_set=pa.array(ints, type=col.type))
    for lo, hi in ranges:
        mask = pc.or_(mask, pc.and_(pc.greater_equal(col, lo), pc.less_equal(col, hi)))
    str_col = f"{column}_str"
    if strs and str_col in table.column_names:
        mask = pc.or_(mask, pc.is_in(table[str_col], value_set=pa.array(strs, type=pa.string())))
    return pc.fill_null(mask, False)


def _where(table: pa.Table, where: str) -> pa.Table:
    """Rows for which the SQL boolean ``where`` holds (DuckDB, no file access)."""
    import duckdb

    if ";" in where:
        raise RunError("the filter is one SQL condition (no ';')")
    con = duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})
    try:
        con.register("trajectories", table)
        return con.sql(f"SELECT * FROM trajectories WHERE ({where})").to_arrow_table()
    except duckdb.Error as exc:
        raise RunError(f"bad filter: {' '.join(str(exc).split())[:300]}") from None
    finally:
        con.close()


def sort_keys(text: str, columns: list[str]) -> list[tuple[str, str]]:
    keys = []
    for item in text.split(","):
        if not item.strip():
            continue
        match = _SORT_ITEM.match(item)
        if not match or match.group(1) not in columns:
            raise RunError(f"cannot sort by {item.strip()!r}: columns are {', '.join(columns)}")
        keys.append(
            (match.group(1), "descending" if (match.group(2) or "").lower() == "desc" else "ascending")
        )
    return keys


def select(table: pa.Table, q: ListQuery) -> pa.Table:
    """The rows of the listing ``q`` asks for, in its order (not paginated)."""
    mask = None
    for column in KEY_COLUMNS:
        text = getattr(q, column)
        if text:
            term = _key_mask(table, column, text)
            mask = term if mask is None else pc.and_(mask, term)
    if q.split:
        if q.split not in ("train", "val"):
            raise RunError(f"split is train or val, not {q.split!r}")
        term = pc.fill_null(pc.equal(table["validate"], q.split == "val"), q.split == "train")
        mask = term if mask is None else pc.and_(mask, term)
    if q.experiment:
        term = pc.fill_null(pc.equal(table["experiment"], q.experiment), False)
        mask = term if mask is None else pc.and_(mask, term)
    if q.status:
        term = pc.fill_null(pc.equal(table["status"], q.status), False)
        mask = term if mask is None else pc.and_(mask, term)
    if mask is not None:
        table = table.filter(mask)
    if q.where:
        table = _where(table, q.where)
    if q.sort:
        table = table.sort_by(sort_keys(q.sort, table.column_names))
    return table


@dataclass
class Page:
    rows: list[dict[str, Any]]
    total: int
    page: int
    pages: int
    per: int


def paginate(table: pa.Table, q: ListQuery) -> Page:
    pages = max(1, math.ceil(table.num_rows / q.per))
    page = min(q.page, pages)
    rows = table.slice((page - 1) * q.per, q.per).to_pylist()
    return Page(rows, table.num_rows, page, pages, q.per)


# ---- per-step statistics -----------------------------------------------------------------------


STAT_SERIES = (
    ("reward_mean", "reward mean"),
    ("zero_std_fraction", "zero-std group fraction"),
    ("response_tokens_mean", "response length (tokens)"),
    ("tool_error_rate", "tool error rate"),
)


def step_stats(table: pa.Table) -> list[dict[str, Any]]:
    """Per step and split: trajectories, reward mean, fraction of groups whose rewards all agree,
    mean response length and tool error rate (where the listing has those columns)."""
    if table.num_rows == 0:
        return []
    cols = set(table.column_names)
    t = table.select([c for c in table.column_names if not c.endswith("_str") or c == "step_str"])
    t = t.append_column("split", pc.fill_null(t["validate"], False))
    aggs: list[tuple[str, str]] = [("id", "count"), ("reward", "mean")]
    if "response_tokens" in cols:
        aggs.append(("response_tokens", "mean"))
    tool_calls = (
        "tool_calls" if "tool_calls" in cols else "num_tool_calls" if "num_tool_calls" in cols else None
    )
    if tool_calls:
        aggs.append((tool_calls, "sum"))
    if "tool_errors" in cols:
        aggs.append(("tool_errors", "sum"))
    per_step = t.group_by(["split", "step"]).aggregate(aggs)
    groups = (
        t.filter(pc.is_valid(t["sample_index"]))
        .group_by(["split", "step", "sample_index"])
        .aggregate([("reward", "min"), ("reward", "max"), ("reward", "count")])
    )
    zero: dict[tuple[Any, Any], list[int]] = {}
    for split, step, lo, hi, n in zip(
        *(groups[c].to_pylist() for c in ("split", "step", "reward_min", "reward_max", "reward_count"))
    ):
        if n < 2:
            continue
        entry = zero.setdefault((split, step), [0, 0])
        entry[0] += int(lo == hi)
        entry[1] += 1
    out = []
    for row in per_step.to_pylist():
        key = (row["split"], row["step"])
        item = {
            "step": row["step"],
            "validate": row["split"],
            "trajectories": row["id_count"],
            "reward_mean": row["reward_mean"],
            "zero_std_fraction": zero[key][0] / zero[key][1] if key in zero else None,
            "response_tokens_mean": row.get("response_tokens_mean"),
            "tool_error_rate": None,
        }
        calls = row.get(f"{tool_calls}_sum") if tool_calls else None
        if calls and "tool_errors_sum" in row:
            item["tool_error_rate"] = (row["tool_errors_sum"] or 0) / calls
        out.append(item)
    out.sort(key=lambda r: (r["validate"], r["step"] is None, r["step"] if r["step"] is not None else 0))
    return out
