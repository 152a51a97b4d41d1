"""Key filters a read pushes down to the span files: step, sample_index, rollout_n, validate, ..."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlreplay.format import arrow_ops as ops
from rlreplay.format.schema import (
    KEY_STR,
    KEYS,
)

FilterValue = Any  # a value, or a sequence of values meaning "any of"
FILTER_KEYS = ("step", "sample_index", "rollout_n", "validate", "experiment", "name", "trajectory_id")


@dataclass
class Filters:
    step: FilterValue = None
    sample_index: FilterValue = None
    rollout_n: FilterValue = None
    validate: bool | None = None
    experiment: FilterValue = None
    name: FilterValue = None
    trajectory_id: FilterValue = None

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
        """Rows of ``table`` that pass every filter (plain compute kernels: no dataset machinery).

        A key filter value matches the int column when it is an integer, else the ``_str`` column.
        """
        mask = None
        for key, values in self.items():
            if key in KEYS:
                term = _key_term(table, key, values)
            else:
                column = table[id_column if key == "trajectory_id" else key]
                term = ops.is_in(column, pa.array(values, type=column.type))
            term = ops.fill_null(term, False)
            mask = term if mask is None else ops.and_(mask, term)
        return table if mask is None else ops.filter(table, mask)

    def single_step(self) -> int | None:
        """The step's partition when the step filter is one integer."""
        if isinstance(self.step, (list, tuple, set, frozenset)):
            return None
        return as_key_int(self.step)


def _key_term(table: pa.Table, key: str, values: list[Any]) -> Any:
    ints, strs = [], []
    for value in values:
        number = as_key_int(value)
        if number is not None:
            ints.append(number)
        if isinstance(value, str) or (number is None and value is not None):
            strs.append(str(value))
    term = ops.is_in(table[key], pa.array(ints, type=pa.int64()))
    if strs and KEY_STR[key] in table.column_names:
        term = ops.or_(ops.fill_null(term, False), ops.is_in(table[KEY_STR[key]], pa.array(strs)))
    return term


def as_key_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value) if value.strip().lstrip("-").isdigit() else None
        except ValueError:
            return None
    try:
        return int(value.__index__())
    except (AttributeError, TypeError, ValueError):
        return None
