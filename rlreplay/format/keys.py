"""The trajectory key (step, sample_index, rollout_n, validate, experiment): one type, one rule.

A key value is kept as the recorder stored it: an integer (Python or numpy) is an int, a string
stays a string (``"12"`` is not 12), anything else is its ``str()``. Typed values compare exactly;
text a person typed (a CLI option, a URL, a selector) matches a value whose int or string form
equals it (:func:`text_matches`); it names a number only in ASCII digits (:func:`parse_int`).

The keys a selection can name (the key fields, ``worker``) are declared once here, in
:data:`SELECT_KEYS`: the CLI options, ``show``/``diff`` selectors, the UI's URL parameters and the
filters pushed down to the span files are made from it. Imports nothing heavy: recording
processes use it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Union

KeyValue = Union[int, str, None]  # noqa: UP007 (a runtime alias on Python 3.10)

#: The keys stored as an int64 column with a ``<key>_str`` twin for values that are not integers.
KEYS = ("step", "sample_index", "rollout_n")
KEY_STR = {k: f"{k}_str" for k in KEYS}
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the range of a key's int column


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
        if number is not None and INT64_MIN <= number <= INT64_MAX:
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


_ASCII_INT = re.compile(r"-?[0-9]+")


def parse_int(text: str) -> int | None:
    """The integer ``text`` names: ASCII digits with an optional minus sign (``５`` is not 5)."""
    stripped = text.strip()
    return int(stripped) if _ASCII_INT.fullmatch(stripped) else None


def non_ascii_digits(text: str) -> bool:
    """Whether ``text`` holds digits other than 0-9 (which :func:`int` would read as numbers)."""
    return any(not c.isascii() and (c.isdigit() or c.isnumeric()) for c in text)


_TRUE = ("true", "1", "yes", "val", "validate")
_FALSE = ("false", "0", "no", "train")


def parse_bool(text: str) -> bool | None:
    """``true``/``false`` (also 1/0, yes/no, and for the split ``val``/``train``), else None."""
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def key_order(value: KeyValue) -> tuple[bool, bool, Any]:
    """A sort key for key values of one kind that may mix ints and strings: ints (in order), then
    strings, then None."""
    return (value is None, isinstance(value, str), value if value is not None else 0)


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


# ---- the keys a selection names ----------------------------------------------------------------

#: How a selection key's values are written and matched: a trajectory key (an int column with a
#: ``_str`` twin: ``5``, ``3..7``, ``0..10,20``, or text), a yes/no flag, or one exact text.
KEY, BOOL, TEXT = "key", "bool", "text"


@dataclass(frozen=True)
class SelectKey:
    """A listing column a selection can name: a CLI option, a selector key, a URL parameter."""

    name: str  # the listing column (and the option --NAME, with - for _)
    kind: str  # KEY, BOOL or TEXT
    help: str  # the CLI option's help
    strings: bool = True  # KEY: values that are not integers can be selected too
    flags: tuple[str, str] | None = None  # BOOL: the CLI's pair of flags (yes, no)

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


#: Every key a selection can name, in the order options and selectors list them.
SELECT_KEYS = (
    SelectKey("step", KEY, "Only these steps", strings=False),
    SelectKey("sample_index", KEY, "Only these dataset samples"),
    SelectKey("rollout_n", KEY, "Only these rollouts of a sample"),
    SelectKey(
        "validate", BOOL, "Only validation (or only training) trajectories.", flags=("--validate", "--train")
    ),
    SelectKey("experiment", TEXT, "Only this experiment name."),
    SelectKey("worker", TEXT, "Only trajectories this worker recorded (a Ray actor, or host-pid)."),
)
SELECT_BY_NAME = {k.name: k for k in SELECT_KEYS}

#: Other names of the listing's columns (short display names, older spellings), accepted wherever
#: a column or a key is named; output always uses the listing's own name.
ALIASES = {
    "sample": "sample_index",
    "rollout": "rollout_n",
    "split": "validate",
    "exp": "experiment",
    "experiment_name": "experiment",
    "adv": "advantage",
    "dlogp_max": "logprob_diff_max",
    "is_ratio": "importance_ratio",
    "duration": "duration_s",
    "spans": "num_spans",
}


def column_name(name: str) -> str:
    """The listing's name of a column given by any of its names."""
    return ALIASES.get(name, name)
