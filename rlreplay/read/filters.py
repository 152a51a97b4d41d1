"""The one test of each selection key, and the filters a read pushes down to the span files.

:class:`KeySpec` is a trajectory key's filter (ints, inclusive int ranges, other values) and the
only code that matches one against a key's int column and its ``_str`` twin; :func:`term` is the
only code that matches any selection key (``rlreplay.format.keys.SELECT_KEYS``). ``Filters`` (what
``Run`` reads with) and ``rlreplay.read.selection.Selection`` (what a user asks for) both use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import pyarrow as pa

from rlreplay.errors import SelectionError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.keys import (
    INT64_MAX,
    INT64_MIN,
    KEY,
    KEY_STR,
    SELECT_BY_NAME,
    SELECT_KEYS,
    key_value,
    non_ascii_digits,
    parse_int,
)

FilterValue = Any  # a value, or a sequence of values meaning "any of"
#: Filters on columns that are not selection keys: a span's name, the trajectory's id.
_OTHER_FILTERS = ("name", "trajectory_id")
FILTER_KEYS = (*(k.name for k in SELECT_KEYS), *_OTHER_FILTERS)
#: Key lists at most this long are pushed down to the file reader (row-group statistics).
PUSHDOWN_VALUES = 4096
_EXAMPLES = "examples: 5, 3..7, 0..10,20,-1"


@dataclass(frozen=True)
class KeySpec:
    """A trajectory key's filter: single ints, inclusive int ranges, and other values (text).

    An int matches the key's int column, and text a person typed (``12``) also names the string
    ``"12"``; other values match the ``_str`` column as written.
    """

    option: str = ""
    ints: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()
    strings: tuple[str, ...] = ()
    typed: tuple[str, ...] = field(default=(), compare=False)  # the ints as typed, for the _str column

    @classmethod
    def of_values(cls, values: Iterable[Any]) -> KeySpec:
        """The filter of values given in code: an int (numpy too) is an int; a string is text
        (``"12"`` names 12 and ``"12"``); anything else is its ``str()``."""
        ints: list[int] = []
        strings: list[str] = []
        for value in values:
            stored = key_value(value)
            if isinstance(stored, int):
                ints.append(stored)
            elif stored is not None:
                strings.append(stored)
                number = parse_int(stored) if isinstance(value, str) else None
                if number is not None and in_int64(number):
                    ints.append(number)
        return cls("", tuple(ints), (), tuple(strings))

    def int_values(self, cap: int = PUSHDOWN_VALUES) -> list[int] | None:
        """Every int the spec matches, when it matches only ints and at most ``cap`` of them."""
        if self.strings or sum(hi - lo + 1 for lo, hi in self.ranges) + len(self.ints) > cap:
            return None
        values = set(self.ints)
        for lo, hi in self.ranges:
            values.update(range(lo, hi + 1))
        return sorted(values)

    def matches_int(self, value: int) -> bool:
        """Whether the spec matches the int ``value`` (a step partition, say)."""
        return value in self.ints or any(lo <= value <= hi for lo, hi in self.ranges)

    def mask(self, table: pa.Table, key: str) -> Any:
        """Boolean mask over ``table``'s column ``key`` and its ``_str`` twin (nulls never match)."""
        ints = table[key]
        strings = table[KEY_STR[key]] if KEY_STR[key] in table.column_names else None
        terms = []
        if self.ints:
            terms.append(ops.is_in(ints, pa.array(self.ints, type=pa.int64())))
        for lo, hi in self.ranges:
            terms.append(ops.and_(ops.greater_equal(ints, lo), ops.less_equal(ints, hi)))
        texts = (*self.strings, *self.typed)
        if texts and strings is not None:
            terms.append(ops.is_in(strings, pa.array(texts, type=pa.string())))
        if not terms:
            return pa.array([False] * len(ints), type=pa.bool_())
        mask = ops.fill_null(terms[0], False)  # a null (a key in the other column) is no match
        for more in terms[1:]:
            mask = ops.or_(mask, ops.fill_null(more, False))
        return mask


def parse_keys(option: str, text: str, allow_strings: bool = False) -> KeySpec:
    """``"5"``, ``"3..7"``, ``"0..10,20,-1"``; with ``allow_strings`` other values (``"s1-3"``) too.

    Only ASCII digits make numbers: ``５`` is refused, never read as 5.
    """
    raw = str(text).strip()
    if not raw:
        raise SelectionError(f"{option}: empty value ({_EXAMPLES})")
    ints: list[int] = []
    typed: list[str] = []
    ranges: list[tuple[int, int]] = []
    strings: list[str] = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            raise SelectionError(f"{option} {raw!r}: empty item between commas ({_EXAMPLES})")
        if non_ascii_digits(part):
            raise SelectionError(f"{option} {raw!r}: {part!r} has non-ASCII digits (write numbers with 0-9)")
        number = parse_int(part)
        if ".." in part:
            lo, _, hi = (s.strip() for s in part.partition(".."))
            start, end = parse_int(lo), parse_int(hi)
            if start is None or end is None:
                raise SelectionError(
                    f"{option} {raw!r}: bad range {part!r} (a range is START..END with integers, {_EXAMPLES})"
                )
            if start > end:
                raise SelectionError(f"{option} {raw!r}: bad range {part!r} (start is after end)")
            if end >= INT64_MIN and start <= INT64_MAX:  # the int column holds int64 values only
                ranges.append((max(start, INT64_MIN), min(end, INT64_MAX)))
        elif number is not None and in_int64(number):
            ints.append(number)
            typed.append(part)
        elif number is not None:
            strings.append(part)  # beyond int64, a key is recorded as its text (format.keys.key_value)
        elif allow_strings:
            strings.append(part)
        else:
            raise SelectionError(f"{option} {raw!r}: {part!r} is not an integer ({_EXAMPLES})")
    return KeySpec(option, tuple(ints), tuple(ranges), tuple(strings), tuple(typed))


def term(table: pa.Table, name: str, value: Any, id_column: str = "trajectory_id") -> Any:
    """Mask of ``table``'s rows whose column ``name`` passes ``value``: a :class:`KeySpec` for a
    trajectory key, else a value or a list of values meaning any of them (nulls never match)."""
    if isinstance(value, KeySpec):
        return value.mask(table, name)
    values = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    declared = SELECT_BY_NAME.get(name)
    if declared is not None and declared.kind == KEY:
        return KeySpec.of_values(values).mask(table, name)
    column = table[id_column if name == "trajectory_id" else name]
    return ops.fill_null(ops.is_in(column, pa.array(values, type=column.type)), False)


class _Filtering:
    """What ``Filters`` does (its fields are made from the selection keys, below)."""

    def items(self) -> list[tuple[str, list[Any]]]:
        """(column, allowed values) for every filter that is set."""
        out = []
        for key in FILTER_KEYS:
            value = getattr(self, key)
            if value is not None:
                out.append(
                    (key, list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value])
                )
        return out

    def apply(self, table: pa.Table, id_column: str = "trajectory_id") -> pa.Table:
        """Rows of ``table`` that pass every filter (plain compute kernels: no dataset machinery)."""
        mask = None
        for key, values in self.items():
            found = term(table, key, values, id_column)
            mask = found if mask is None else ops.and_(mask, found)
        return table if mask is None else ops.filter(table, mask)

    def single_step(self) -> int | None:
        """The step's partition when the step filter is one integer."""
        step = self.step  # type: ignore[attr-defined]  # a field of the class made below
        if isinstance(step, (list, tuple, set, frozenset)):
            return None
        return as_key_int(step)


#: Filters a read pushes down to the span files: one field per selection key (a value, or a list
#: of values meaning any of them), the span's ``name`` and the ``trajectory_id``.
Filters = make_dataclass(
    "Filters",
    [(name, FilterValue, field(default=None)) for name in FILTER_KEYS],
    bases=(_Filtering,),
    namespace={"__module__": __name__},
)
Filters.__doc__ = "Filters a read pushes down: " + ", ".join(FILTER_KEYS) + " (a value or a list of values)."


def as_key_int(value: Any) -> int | None:
    """The integer a filter value names in a key's int column: an int (numpy too) or text in
    ASCII digits, within int64; else None."""
    number = parse_int(value) if isinstance(value, str) else key_value(value)
    return number if isinstance(number, int) and in_int64(number) else None


def in_int64(number: int) -> bool:
    """Whether a key's int column can hold ``number`` (larger keys are stored as their text)."""
    return INT64_MIN <= number <= INT64_MAX
