"""The trajectory key (step, sample_index, rollout_n, validate, experiment): one type, one rule.

A key value is kept as the recorder stored it: an integer (Python or numpy) is an int, a string
stays a string (``"12"`` is not 12), anything else is its ``str()``. Typed values compare exactly;
text a person typed (a CLI option, a URL, a selector) matches a value whose int or string form
equals it (:func:`text_matches`). Imports nothing heavy: recording processes use it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Union

KeyValue = Union[int, str, None]  # noqa: UP007 (a runtime alias on Python 3.10)

#: The keys stored as an int64 column with a ``<key>_str`` twin for values that are not integers.
KEYS = ("step", "sample_index", "rollout_n")
KEY_STR = {k: f"{k}_str" for k in KEYS}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def key_value(value: Any) -> KeyValue:
    """``value`` as the recorder stores a key: an int (within int64), a string, or None."""
    if value is None:
        return None
    cls = type(value)
    if cls is str:
        return value
    if cls is not bool and hasattr(cls, "__index__"):
        try:
            number = operator.index(value)
        except Exception:
            number = None
        if number is not None and _INT64_MIN <= number <= _INT64_MAX:
            return number
    if isinstance(value, str):
        return str.__str__(value)
    try:
        return str(value)
    except Exception:
        return f"<{cls.__name__}>"


def stored_value(int_value: int | None, str_value: str | None) -> KeyValue:
    """The one value of a key read back from its int column and its ``_str`` twin."""
    return int_value if int_value is not None else str_value


def text_matches(text: str, value: KeyValue) -> bool:
    """Whether ``text`` (typed by a person) names ``value``: ``"12"`` names 12 and ``"12"``."""
    if value is None:
        return False
    return str(value) == text


@dataclass(frozen=True)
class TrajectoryKey:
    """What names a trajectory across runs: the keys verl (or the caller) gave its root span."""

    step: KeyValue = None
    sample_index: KeyValue = None
    rollout_n: KeyValue = None
    validate: bool = False
    experiment: str | None = None

    @classmethod
    def of(
        cls,
        step: Any = None,
        sample_index: Any = None,
        rollout_n: Any = None,
        validate: Any = False,
        experiment: Any = None,
    ) -> TrajectoryKey:
        """A key from values as a framework passes them (numpy ints, strings, None)."""
        return cls(
            key_value(step),
            key_value(sample_index),
            key_value(rollout_n),
            bool(validate),
            None if experiment is None else str(experiment),
        )

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TrajectoryKey:
        """A key from a listing or span row: each key's int column, else its ``_str`` twin."""
        return cls(
            stored_value(row.get("step"), row.get("step_str")),
            stored_value(row.get("sample_index"), row.get("sample_index_str")),
            stored_value(row.get("rollout_n"), row.get("rollout_n_str")),
            bool(row.get("validate")),
            row.get("experiment"),
        )

    def without_experiment(self) -> TrajectoryKey:
        """The key a replay matches on: a replay may run under another experiment name."""
        return replace(self, experiment=None)

    def group(self) -> TrajectoryKey:
        """The key of the trajectory's group (every rollout of one sample at one step and split)."""
        return replace(self, rollout_n=None)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (validate always)."""
        return {f: v for f in FIELDS if (v := getattr(self, f)) is not None}

    def __str__(self) -> str:
        """As a selector: ``step=5,sample_index=12,rollout_n=0,validate=false``."""
        return ",".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.as_dict().items()
        )


FIELDS = tuple(f.name for f in fields(TrajectoryKey))
