"""Choosing, after training, which trajectories are worth sending somewhere.

Works on the listing from ``Run.trajectories()``: one row per trajectory. The unit of choice
is a *group*, every rollout of one dataset sample at one step in one split (training or
validation), so GRPO groups always stay whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

STATUSES = ("ok", "error")

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
    """Only trajectories that ended ``ok`` or with an ``error``."""
    if status is None:
        return table
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    return table.filter(pc.equal(table["status"], status))


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


def select(
    table: pa.Table, *, status: str | None = None, max_samples: int | None = None, seed: int = 0
) -> list[Group]:
    """Status filter, then per-step-and-split sampling: the groups to upload, in upload order."""
    return sample_groups(filter_status(table, status), max_samples, seed)


def group_ids(selected: Iterable[Group]) -> list[str]:
    return [traj_id for group in selected for traj_id in group.ids]
