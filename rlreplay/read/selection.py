"""Choosing trajectories: the selection grammar every command shares, and per-step sampling.

Works on the listing from ``Run.trajectories()``: one row per trajectory. A ``Selection`` is the
one way to say which: made from CLI options, a ``show``/``diff`` selector or the UI's URL
parameters, with a field per selection key (``rlreplay.format.keys.SELECT_KEYS``). Key filters
take ``5``, ``3..7`` (inclusive) or lists such as ``0..10,20,-1``; ``--where`` is an SQL boolean
over the listing's columns (DuckDB, imported only when used); ``grep`` a regular expression the
trajectory's decoded response or tool output must match (``rlreplay.read.search``). The unit of sampling is a
*group*, every rollout of one dataset sample at one step in one split (training or
validation), so GRPO groups always stay whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any

import pyarrow as pa

from rlreplay.errors import KeyTextError, SelectionError, SelectorError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.index import LISTING_FIELDS, LISTING_SCHEMA
from rlreplay.format.keys import (
    BOOL,
    INT64_MAX,
    KEY,
    KEY_STR,
    SELECT_BY_NAME,
    SELECT_KEYS,
    SelectKey,
    column_name,
    key_pairs,
    parse_bool,
    parse_int,
)
from rlreplay.read.filters import Filters, KeySpec, parse_keys, term
from rlreplay.read.search import TextSearch, check_pattern, matching
from rlreplay.read.where import filter_where
from rlreplay.words import plural, trajectories

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
        prompts = plural(_span_text(per_step.values()), "prompt")
        rollouts = plural(_span_text(len(g.ids) for g in split), "rollout")
        steps = plural(str(len(per_step)), "step")
        text = f"{prompts} a step × {steps} × {rollouts} ({sum(len(g.ids) for g in split)})"
        parts.append(f"validation: {text}" if validate else text)
    total = sum(len(g.ids) for g in chosen)
    return f"{' + '.join(parts) or 'nothing'} = {trajectories(total)}"


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

_SORT_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s+(asc|desc))?\s*\Z", re.IGNORECASE)
_HEX = set("0123456789abcdef")
_KEY_NAMES = ", ".join(k.name for k in SELECT_KEYS)


def parse_sort(text: str, columns: Iterable[str] = LISTING_COLUMNS) -> list[tuple[str, str]]:
    """``"reward desc, duration_s"`` as ``[("reward", "descending"), ("duration_s", "ascending")]``;
    a column may be named by an alias (``adv``)."""
    known = list(columns)
    out = []
    for part in str(text).split(","):
        match = _SORT_ITEM.match(part)
        if not match:
            raise SelectionError(f"--sort {text!r}: {part.strip()!r} is not COLUMN [asc|desc]")
        column, order = column_name(match.group(1)), (match.group(2) or "asc").lower()
        if column not in known:
            raise SelectionError(f"--sort: unknown column {match.group(1)!r} (columns: {', '.join(known)})")
        out.append((column, "descending" if order == "desc" else "ascending"))
    return out


def listing(run: Any, filters: Any = None) -> pa.Table:
    """``run.trajectories(filters)``: the contract-C2 listing with the ``*_str`` key columns."""
    return run.trajectories(filters)


def key_text(key: SelectKey, text: str, label: str) -> Any:
    """A selection key's value from text (an option, a selector, a URL): checked, as ``Selection``
    holds it (a flag as a bool); raises :class:`SelectionError` naming ``label``."""
    if key.kind == BOOL:
        value = parse_bool(text)
        if value is None:
            raise SelectionError(f"{label} must be true or false, not {text!r}")
        return value
    if key.kind == KEY:
        parse_keys(label, text, allow_strings=key.strings)
    return text


class _Selecting:
    """What a ``Selection`` does (its key fields are made from ``SELECT_KEYS``, below)."""

    def chosen(self) -> dict[str, Any]:
        """The selection keys that are set, by name, as held (key filters as text)."""
        return {k.name: v for k in SELECT_KEYS if (v := getattr(self, k.name)) is not None}

    def keys(self) -> dict[str, KeySpec]:
        """The parsed trajectory-key filters; raises :class:`SelectionError` on bad input."""
        return {
            k.name: parse_keys(k.option, str(getattr(self, k.name)), allow_strings=k.strings)
            for k in SELECT_KEYS
            if k.kind == KEY and getattr(self, k.name) is not None
        }

    def check(self) -> None:
        """Raise :class:`SelectionError` for anything malformed that needs no run to tell."""
        me: Any = self
        self.keys()
        if me.status is not None and me.status not in STATUSES:
            raise SelectionError(f"--status must be one of: {', '.join(STATUSES)} (got {me.status!r})")
        if me.sort is not None:
            parse_sort(me.sort)
        if me.limit is not None and (isinstance(me.limit, bool) or me.limit < 1):
            raise SelectionError(f"--limit must be at least 1 (got {me.limit!r})")
        if me.where is not None and not me.where.strip():
            raise SelectionError("--where: empty expression")
        if me.grep is not None:
            check_pattern(me.grep)

    def filters(self) -> Filters:
        """What the file reader can apply itself: the flags and names, and the keys that hold only
        integers (the steps: their partitions) as lists of ints."""
        keys = self.keys()
        pushed: dict[str, Any] = {}
        for key in SELECT_KEYS:
            value = getattr(self, key.name)
            if value is None:
                continue
            if key.kind != KEY:
                pushed[key.name] = value
            elif not key.strings and (ints := keys[key.name].int_values()) is not None:
                pushed[key.name] = ints
        return Filters(**pushed)

    def trajectories(
        self,
        run: Any,
        keep: Callable[[pa.Table], pa.Table] | None = None,
        texts: TextSearch | None = None,
    ) -> pa.Table:
        """The run's listing (contract C2 columns), filtered, sorted and limited (``keep``,
        ``texts``: see :meth:`apply`; with ``grep`` and no ``texts``, the run's own tokenizer
        decodes).

        A step filter reads only the matching ``spans/step=N/`` partitions (or the run index's
        row groups that hold them).
        """
        self.check()
        me: Any = self
        if me.grep is not None and texts is None:
            texts = TextSearch.for_run(run)
        filters = self.filters()
        steps = _partition_steps(run, self.keys().get("step"))
        if steps is None:
            return self.apply(listing(run, filters), keep, texts)
        table = listing(run, replace(filters, step=steps)) if steps else LISTING_SCHEMA.empty_table()
        return self.apply(table, keep, texts)

    def apply(
        self,
        table: pa.Table,
        keep: Callable[[pa.Table], pa.Table] | None = None,
        texts: TextSearch | None = None,
    ) -> pa.Table:
        """This selection over a listing already read: the keys, status and id, then ``--where``,
        then ``--grep`` (over ``texts``, the run's searched texts), then ``keep`` (a further
        filter, such as ``ls --finding``), then the sort and the limit."""
        self.check()
        me: Any = self
        keys = self.keys()
        tests: list[tuple[str, Any]] = [
            (name, keys.get(name, value)) for name, value in self.chosen().items()
        ]
        if me.status is not None:
            tests.append(("status", me.status))
        mask = None
        for name, value in tests:
            found = term(table, name, value)
            mask = found if mask is None else ops.and_(mask, found)
        if me.id is not None:
            found = ops.starts_with(table["id"], me.id)
            mask = found if mask is None else ops.and_(mask, found)
        if mask is not None:
            table = ops.filter(table, mask)
        if me.where is not None:
            table = filter_where(table, me.where)
        if me.grep is not None:
            if texts is None:
                raise SelectionError("--grep searches a run's text: select through the run (trajectories)")
            table = matching(table, me.grep, texts)
        if keep is not None:
            table = keep(table)
        if me.sort is not None:
            table = sort_table(table, parse_sort(me.sort))
        if me.limit is not None:
            table = table.slice(0, min(me.limit, table.num_rows))  # any whole number, however large
        return table

    def params(self) -> dict[str, str]:
        """What is set, as URL parameters (a flag as ``true``/``false``)."""
        out = {name: _text(value) for name, value in self.chosen().items()}
        out.update((name, str(v)) for name in _URL_OPTIONS if (v := getattr(self, name)) is not None)
        return out

    def __str__(self) -> str:
        """The keys as a selector (``step=5,sample_index=12,validate=false``), else the id prefix."""
        me: Any = self
        return ",".join(f"{k}={_text(v)}" for k, v in self.chosen().items()) or (me.id or "")

    @classmethod
    def parse(cls, text: str) -> Any:
        """A ``show``/``diff`` selector: an id prefix (``3fa2c1``) or ``key=value`` pairs
        (``step=5,sample_index=12,rollout_n=0``; a key may be named by an alias)."""
        raw = text.strip()
        if not raw:
            raise SelectorError("empty trajectory selector (give an id prefix or key=value pairs)")
        if "=" not in raw:
            if any(c not in _HEX for c in raw.lower()):
                raise SelectorError(
                    f"{raw!r} is neither a trajectory id (hex) nor a selector "
                    f"(key=value pairs, keys: {_KEY_NAMES})"
                )
            return cls(id=raw.lower())
        values: dict[str, Any] = {}
        try:
            for name, value, _ in key_pairs(raw, SELECT_BY_NAME):
                values[name] = key_text(SELECT_BY_NAME[name], value, f"selector {raw!r}: {name}")
        except (KeyTextError, SelectionError) as exc:
            prefix = "" if isinstance(exc, SelectionError) else f"selector {raw!r}: "
            raise SelectorError(f"{prefix}{exc}") from None
        return cls(**values)

    @classmethod
    def from_params(cls, params: Any) -> Any:
        """A selection from URL parameters (the CLI's names; an alias such as ``split=train``
        too); empty ones are not set."""
        values: dict[str, Any] = {}
        for name, raw in params.items():
            name = column_name(name)
            key = SELECT_BY_NAME.get(name)
            text = str(raw).strip()
            if text and key is not None and name not in values:
                values[name] = key_text(key, text, name)
            elif text and name in _URL_OPTIONS:
                values[name] = text if name != "limit" else parse_int(text)
                if values[name] is None:
                    raise SelectionError(f"limit must be a whole number, not {text!r}")
                if name == "limit":
                    values[name] = min(values[name], INT64_MAX)  # "at most N": any N
        return cls(**values)


#: The selection's options besides its keys that a URL carries.
_URL_OPTIONS = ("status", "where", "grep", "sort", "limit")


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


#: Which trajectories a command works on (contract C4): a field per selection key (key filters
#: as text, parsed by :func:`parse_keys`; the flags as bools), then ``status``, ``where``,
#: ``grep``, ``sort``, ``limit`` and ``id`` (an id prefix, from a selector).
Selection = make_dataclass(
    "Selection",
    [
        *(
            (k.name, "bool | None" if k.kind == BOOL else "str | None", field(default=None))
            for k in SELECT_KEYS
        ),
        ("status", "str | None", field(default=None)),
        ("where", "str | None", field(default=None)),
        ("grep", "str | None", field(default=None)),
        ("sort", "str | None", field(default=None)),
        ("limit", "int | None", field(default=None)),
        ("id", "str | None", field(default=None)),
    ],
    bases=(_Selecting,),
    namespace={"__module__": __name__},
)
Selection.__doc__ = (
    "Which trajectories a command works on: "
    + ", ".join(f.name for f in fields(Selection))
    + " (every selection key, then the listing's own filters, order and limit)."
)


def _partition_steps(run: Any, spec: KeySpec | None) -> list[int] | None:
    """The run's step partitions that ``spec`` matches, in order (None: read without pruning)."""
    partitions = getattr(run, "step_partitions", None)
    if spec is None or spec.strings or partitions is None:
        return None  # a step recorded as text (beyond int64) has its own partition name
    steps = []
    for value in partitions():
        number = parse_int(value)
        if number is not None and spec.matches_int(number):
            steps.append(number)
    return sorted(steps)


def sort_table(table: pa.Table, order: list[tuple[str, str]]) -> pa.Table:
    """A stable sort (ties keep the listing's order), nulls last; a key sorts ints, then strings."""
    keys = []
    for column, direction in order:
        keys.append((column, direction))
        if f"{column}_str" in table.column_names:
            keys.append((f"{column}_str", direction))
    return ops.sort_by(table, keys)
