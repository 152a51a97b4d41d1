"""Choosing trajectories: the selection grammar every command shares, and per-step sampling.

Works on the listing from ``Run.trajectories()``: one row per trajectory. Key filters take
``5``, ``3..7`` (inclusive) or lists such as ``0..10,20,-1``; ``--where`` is an SQL boolean
over the listing's columns (DuckDB, imported only when used). The unit of sampling is a
*group*, every rollout of one dataset sample at one step in one split (training or
validation), so GRPO groups always stay whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from rlreplay.errors import SelectionError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.index import LISTING_FIELDS, LISTING_SCHEMA
from rlreplay.format.schema import KEY_STR, KEYS
from rlreplay.read.filters import Filters
from rlreplay.read.where import filter_where

STATUSES = ("ok", "error", "incomplete")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


@dataclass
class Group:
    """All rollouts of one sample at one step in one split (or one lone trajectory)."""

    step: int | None
    validate: bool
    sample_index: int | None
    ids: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.step, self.validate, self.sample_index if self.sample_index is not None else self.ids[0])


def parse_size(text: str) -> int:
    """Bytes from a size such as ``900MB``, ``1.5GiB``, ``500k`` or ``1234`` (k = 1000, Ki = 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 500k, 900MB, 1.5GiB)")
    number, prefix, binary, _b = match.groups()
    if binary and not prefix:
        raise ValueError(f"not a size: {text!r} (examples: 500k, 900MB, 1.5GiB)")
    value = float(number) * (1024 if binary else 1000) ** _POWERS[prefix.lower()]
    if value >= 2**63:  # also inf: int() of it would raise OverflowError
        raise ValueError(f"size too large: {text[:20]!r}{'…' if len(text) > 20 else ''}")
    return int(value)


def filter_status(table: pa.Table, status: str | None) -> pa.Table:
    """Only trajectories that ended ``ok``, with an ``error``, or are ``incomplete`` (no root span)."""
    if status is None:
        return table
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    return ops.filter(table, ops.equal(table["status"], status))


def _rank(seed: int, step: int | None, validate: bool, sample_key: Any) -> bytes:
    """A reproducible pseudo-random rank: same seed, same choice, whatever else is in the table."""
    return hashlib.blake2b(f"{seed}|{step}|{int(validate)}|{sample_key}".encode(), digest_size=8).digest()


def groups(table: pa.Table, seed: int = 0) -> list[Group]:
    """The table's trajectories as groups: by step, training before validation, then seeded order."""
    by_key: dict[tuple[Any, ...], Group] = {}
    cols = [table[c].to_pylist() for c in ("id", "step", "validate", "sample_index")]
    for traj_id, step, validate, sample in zip(*cols):
        split = bool(validate)
        key = (step, split, sample if sample is not None else ("trajectory", traj_id))
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = Group(step=step, validate=split, sample_index=sample)
        group.ids.append(traj_id)
    ordered = sorted(
        by_key.values(),
        key=lambda g: (
            g.step is None,
            g.step if g.step is not None else 0,
            g.validate,
            _rank(seed, g.step, g.validate, g.key[2]),
        ),
    )
    return ordered


def sample_groups(table: pa.Table, max_samples: int | None = None, seed: int = 0) -> list[Group]:
    """Up to ``max_samples`` groups per step and split, chosen reproducibly from ``seed``.

    The offline counterpart of verl's ``max_samples_per_step_per_worker``, decided after the
    fact: each chosen sample keeps all of its rollouts.
    """
    if max_samples is not None and max_samples < 0:
        raise ValueError("max_samples must be >= 0")
    ordered = groups(table, seed)
    if max_samples is None:
        return ordered
    taken: dict[tuple[Any, bool], int] = {}
    chosen = []
    for group in ordered:
        split = (group.step, group.validate)
        if taken.get(split, 0) < max_samples:
            taken[split] = taken.get(split, 0) + 1
            chosen.append(group)
    return chosen


def _span_text(values: Iterable[int]) -> str:
    found = sorted(set(values))
    return str(found[0]) if len(found) == 1 else f"{found[0]}–{found[-1]}"


def _plural(count: str, word: str) -> str:
    return f"{count} {word}" if count == "1" else f"{count} {word}s"


def describe_groups(chosen: list[Group]) -> str:
    """What a per-step choice of groups amounts to, e.g. ``4 prompts a step × 8 steps × 4 rollouts
    (128) + validation: 8 prompts a step × 2 steps × 1 rollout (16) = 144 trajectories``."""
    parts = []
    for validate in (False, True):
        split = [g for g in chosen if g.validate == validate]
        if not split:
            continue
        per_step: dict[Any, int] = {}
        for g in split:
            per_step[g.step] = per_step.get(g.step, 0) + 1
        prompts = _plural(_span_text(per_step.values()), "prompt")
        rollouts = _plural(_span_text(len(g.ids) for g in split), "rollout")
        steps = _plural(str(len(per_step)), "step")
        text = f"{prompts} a step × {steps} × {rollouts} ({sum(len(g.ids) for g in split)})"
        parts.append(f"validation: {text}" if validate else text)
    total = sum(len(g.ids) for g in chosen)
    return f"{' + '.join(parts) or 'nothing'} = {total} trajectories"


def select(
    table: pa.Table, *, status: str | None = None, max_samples: int | None = None, seed: int = 0
) -> list[Group]:
    """Status filter, then per-step-and-split sampling: the groups to upload, in upload order."""
    return sample_groups(filter_status(table, status), max_samples, seed)


def group_ids(selected: Iterable[Group]) -> list[str]:
    return [traj_id for group in selected for traj_id in group.ids]


# --- the selection grammar -------------------------------------------------------------------

#: The trajectory listing's columns (contract C2), in order; ``*_str`` hold non-int key values.
LISTING_COLUMNS = tuple(f.name for f in LISTING_FIELDS if f.name not in KEY_STR.values())

_INT = re.compile(r"-?[0-9]+\Z")
_SORT_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s+(asc|desc))?\s*\Z", re.IGNORECASE)
#: Key lists at most this long are pushed down to the file reader (row-group statistics).
PUSHDOWN_VALUES = 4096
_EXAMPLES = "examples: 5, 3..7, 0..10,20,-1"


@dataclass(frozen=True)
class KeySpec:
    """A parsed key filter: single ints, inclusive int ranges, and (where allowed) other values."""

    option: str
    ints: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()
    strings: tuple[str, ...] = ()

    def int_values(self, cap: int = PUSHDOWN_VALUES) -> list[int] | None:
        """Every int the spec matches, when it matches only ints and at most ``cap`` of them."""
        if self.strings or sum(hi - lo + 1 for lo, hi in self.ranges) + len(self.ints) > cap:
            return None
        values = set(self.ints)
        for lo, hi in self.ranges:
            values.update(range(lo, hi + 1))
        return sorted(values)

    def matches(self, value: Any) -> bool:
        if isinstance(value, bool) or value is None:
            return False
        if isinstance(value, int):
            return value in self.ints or any(lo <= value <= hi for lo, hi in self.ranges)
        return str(value) in self.strings

    def mask(self, ints: pa.ChunkedArray | pa.Array, strings: pa.ChunkedArray | pa.Array | None) -> Any:
        """Boolean mask over a key's int column and its string column (nulls never match)."""
        terms = []
        if self.ints:
            terms.append(ops.is_in(ints, pa.array(self.ints, type=pa.int64())))
        for lo, hi in self.ranges:
            terms.append(ops.and_(ops.greater_equal(ints, lo), ops.less_equal(ints, hi)))
        if self.strings and strings is not None:
            terms.append(ops.is_in(strings, pa.array(self.strings, type=pa.string())))
        if not terms:
            return pa.array([False] * len(ints), type=pa.bool_())
        mask = terms[0]
        for term in terms[1:]:
            mask = ops.or_(mask, term)
        return ops.fill_null(mask, False)


def _non_ascii_digits(text: str) -> bool:
    return any(not c.isascii() and (c.isdigit() or c.isnumeric()) for c in text)


def parse_keys(option: str, text: str, allow_strings: bool = False) -> KeySpec:
    """``"5"``, ``"3..7"``, ``"0..10,20,-1"``; with ``allow_strings`` other values (``"s1-3"``) too.

    Only ASCII digits make numbers: ``５`` is refused, never read as 5.
    """
    raw = str(text).strip()
    if not raw:
        raise SelectionError(f"{option}: empty value ({_EXAMPLES})")
    ints: list[int] = []
    ranges: list[tuple[int, int]] = []
    strings: list[str] = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            raise SelectionError(f"{option} {raw!r}: empty item between commas ({_EXAMPLES})")
        if _non_ascii_digits(part):
            raise SelectionError(f"{option} {raw!r}: {part!r} has non-ASCII digits (write numbers with 0-9)")
        if ".." in part:
            lo, _, hi = (s.strip() for s in part.partition(".."))
            if not (_INT.match(lo) and _INT.match(hi)):
                raise SelectionError(
                    f"{option} {raw!r}: bad range {part!r} (a range is START..END with integers, {_EXAMPLES})"
                )
            if int(lo) > int(hi):
                raise SelectionError(f"{option} {raw!r}: bad range {part!r} (start is after end)")
            ranges.append((int(lo), int(hi)))
        elif _INT.match(part):
            ints.append(int(part))
        elif allow_strings:
            strings.append(part)
        else:
            raise SelectionError(f"{option} {raw!r}: {part!r} is not an integer ({_EXAMPLES})")
    return KeySpec(option, tuple(ints), tuple(ranges), tuple(strings))


def parse_sort(text: str, columns: Iterable[str] = LISTING_COLUMNS) -> list[tuple[str, str]]:
    """``"reward desc, duration_s"`` as ``[("reward", "descending"), ("duration_s", "ascending")]``."""
    known = list(columns)
    out = []
    for part in str(text).split(","):
        match = _SORT_ITEM.match(part)
        if not match:
            raise SelectionError(f"--sort {text!r}: {part.strip()!r} is not COLUMN [asc|desc]")
        column, order = match.group(1), (match.group(2) or "asc").lower()
        if column not in known:
            raise SelectionError(f"--sort: unknown column {column!r} (columns: {', '.join(known)})")
        out.append((column, "descending" if order == "desc" else "ascending"))
    return out


def listing(run: Any, filters: Any = None) -> pa.Table:
    """``run.trajectories(filters)``: the contract-C2 listing with the ``*_str`` key columns."""
    return run.trajectories(filters)


@dataclass
class Selection:
    """Which trajectories a command works on (contract C4); key filters use :func:`parse_keys`."""

    step: str | None = None
    sample_index: str | None = None
    rollout_n: str | None = None
    validate: bool | None = None
    experiment: str | None = None
    status: str | None = None
    where: str | None = None
    sort: str | None = None
    limit: int | None = None

    def keys(self) -> dict[str, KeySpec]:
        """The parsed key filters; raises :class:`SelectionError` on bad input."""
        out = {}
        for key in KEYS:
            text = getattr(self, key)
            if text is not None:
                option = "--" + key.replace("_", "-")
                out[key] = parse_keys(option, str(text), allow_strings=key != "step")
        return out

    def check(self) -> None:
        """Raise :class:`SelectionError` for anything malformed that needs no run to tell."""
        self.keys()
        if self.status is not None and self.status not in STATUSES:
            raise SelectionError(f"--status must be one of: {', '.join(STATUSES)} (got {self.status!r})")
        if self.sort is not None:
            parse_sort(self.sort)
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise SelectionError(f"--limit must be at least 1 (got {self.limit!r})")
        if self.where is not None and not self.where.strip():
            raise SelectionError("--where: empty expression")

    def filters(self) -> Filters:
        """What the file reader can apply itself: steps, split and experiment."""
        keys = self.keys()
        step = keys["step"].int_values() if "step" in keys else None
        return Filters(step=step, validate=self.validate, experiment=self.experiment)

    def trajectories(self, run: Any) -> pa.Table:
        """The run's listing (contract C2 columns), filtered, sorted and limited.

        A step filter reads only the matching ``spans/step=N/`` partitions (or the run index's
        row groups that hold them).
        """
        self.check()
        filters = self.filters()
        steps = _partition_steps(run, self.keys().get("step"))
        if steps is None:
            return self.apply(listing(run, filters))
        table = listing(run, replace(filters, step=steps)) if steps else LISTING_SCHEMA.empty_table()
        return self.apply(table)

    def apply(self, table: pa.Table) -> pa.Table:
        """This selection over a listing already read."""
        self.check()
        mask = None
        for key, spec in self.keys().items():
            str_key = f"{key}_str"
            term = spec.mask(table[key], table[str_key] if str_key in table.column_names else None)
            mask = term if mask is None else ops.and_(mask, term)
        for column, value in (("validate", self.validate), ("experiment", self.experiment)):
            if value is not None:
                term = ops.fill_null(ops.equal(table[column], value), False)
                mask = term if mask is None else ops.and_(mask, term)
        if self.status is not None:
            term = ops.fill_null(ops.equal(table["status"], self.status), False)
            mask = term if mask is None else ops.and_(mask, term)
        if mask is not None:
            table = ops.filter(table, mask)
        if self.where is not None:
            table = filter_where(table, self.where)
        if self.sort is not None:
            table = sort_table(table, parse_sort(self.sort))
        if self.limit is not None:
            table = table.slice(0, self.limit)
        return table


def _partition_steps(run: Any, spec: KeySpec | None) -> list[int] | None:
    """The run's step partitions that ``spec`` matches, in order (None: read without pruning)."""
    partitions = getattr(run, "step_partitions", None)
    if spec is None or partitions is None:
        return None
    steps = []
    for value in partitions():
        if _INT.match(value) and spec.matches(int(value)):
            steps.append(int(value))
    return sorted(steps)


def sort_table(table: pa.Table, order: list[tuple[str, str]]) -> pa.Table:
    """A stable sort (ties keep the listing's order), nulls last; a key sorts ints, then strings."""
    keys = []
    for column, direction in order:
        keys.append((column, direction))
        if f"{column}_str" in table.column_names:
            keys.append((f"{column}_str", direction))
    return ops.sort_by(table, keys)
