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

import json
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Union

from rlreplay.errors import KeyTextError

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
        """As a selector: ``step=5,sample_index=12,rollout_n=0,validate=false``; a text value that
        would read back otherwise (``"12"``, one with a comma) is quoted as a JSON string."""
        return ",".join(f"{k}={_value_text(k, v)}" for k, v in self.as_dict().items())

    @classmethod
    def parse(cls, text: str) -> TrajectoryKey:
        """The key ``str(key)`` writes (``step=5,sample_index=12,validate=false``; a field may be
        named by an alias, ``sample=12``): integers as integers, a quoted value as text; raises
        :class:`KeyTextError` naming what is wrong."""
        values: dict[str, Any] = {}
        for name, value, quoted in key_pairs(text, FIELDS):
            if name == "validate":
                flag = parse_bool(value) if not quoted else None
                if flag is None:
                    raise KeyTextError(f"validate={value!r} is not true or false")
                values[name] = flag
            elif name == "experiment" or quoted:
                values[name] = value
            else:
                number = parse_int(value)
                values[name] = number if number is not None else value
        return cls.of(**values)


FIELDS = tuple(f.name for f in fields(TrajectoryKey))
#: The keys that name a group: every rollout of one sample at one step (in one split).
GROUP_KEYS = KEYS[:2]


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name)


def group_key(item: Any) -> tuple[KeyValue, ...]:
    """The group ``item`` belongs to (a key, a trajectory, a finding, a listing row as a dict): its
    :data:`GROUP_KEYS` values."""
    return tuple(_field(item, k) for k in GROUP_KEYS)


def key_fields(item: Any) -> str:
    """An item's keys as ``step=1 sample_index=26 rollout_n=0`` ("-" for one it has not)."""
    return " ".join(f"{k}={'-' if (v := _field(item, k)) is None else v}" for k in KEYS)


def _value_text(name: str, value: Any) -> str:
    """A key field's value as ``str(key)`` writes it (see :meth:`TrajectoryKey.parse`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if not isinstance(value, str):
        return str(value)
    plain = (
        value
        and value == value.strip()
        and "," not in value
        and not value.startswith('"')
        and (name == "experiment" or parse_int(value) is None)
    )
    return value if plain else json.dumps(value, ensure_ascii=False)


_QUOTED = json.JSONDecoder()


def key_pairs(text: str, known: Iterable[str]) -> list[tuple[str, str, bool]]:
    """``name=value,name=value`` as ``(name, value, quoted)`` triples, each name the listing's (an
    alias, any case, ``-`` for ``_``), each in ``known``; a value in double quotes is a JSON
    string. Raises :class:`KeyTextError` on an empty item (a trailing comma too), an unknown or
    repeated name, or an empty value."""
    names = tuple(known)
    out: list[tuple[str, str, bool]] = []
    if not text.strip():
        raise KeyTextError(f"no keys given (keys: {', '.join(names)})")
    at, end = 0, len(text)
    while True:
        comma = text.find(",", at)
        part = text[at : comma if comma >= 0 else end]
        if not part.strip():
            raise KeyTextError("empty item between commas" if comma >= 0 else "trailing comma")
        raw_name, sep, value = part.partition("=")
        name = column_name(raw_name.strip().lower().replace("-", "_"))
        if not sep or not name:
            raise KeyTextError(f"{part.strip()!r} is not key=value")
        if name not in names:
            raise KeyTextError(f"unknown key {raw_name.strip()!r} (keys: {', '.join(names)})")
        if any(name == seen for seen, _, _ in out):
            raise KeyTextError(f"key {name!r} given twice")
        quoted = value.strip().startswith('"')
        if quoted:
            start = at + len(raw_name) + 1 + (len(value) - len(value.lstrip()))
            try:
                value, stop = _QUOTED.raw_decode(text, start)
            except ValueError:
                raise KeyTextError(f"{name}: unfinished quoted value") from None
            if not isinstance(value, str):
                raise KeyTextError(f"{name}: a quoted value is one string")
            comma = text.find(",", stop)
            rest = text[stop : comma if comma >= 0 else end]
            if rest.strip():
                raise KeyTextError(f"{name}: {rest.strip()!r} after a quoted value")
        else:
            value = value.strip()
            if not value:
                raise KeyTextError(f"no value for {name!r}")
        out.append((name, value, quoted))
        if comma < 0:
            return out
        at = comma + 1


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
