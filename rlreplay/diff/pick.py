"""Picking the trajectories a diff compares: ``KEY=VALUE,...`` selectors, ids and id prefixes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlreplay.errors import SelectorError
from rlreplay.model import Trajectory, listing_rows
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run

# ---- selectors ---------------------------------------------------------------------------------

SELECTOR_KEYS = ("step", "sample_index", "rollout_n", "validate", "experiment")
_ALIASES = {
    "sample": "sample_index",
    "rollout": "rollout_n",
    "exp": "experiment",
    "experiment_name": "experiment",
}
_TRUE = {"true", "1", "yes", "val", "validate"}
_FALSE = {"false", "0", "no", "train"}
_HEX = set("0123456789abcdef")
_ASCII_INT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class Selector:
    """What picks one trajectory: an id prefix, or ``key=value`` pairs."""

    text: str
    id_prefix: str | None = None
    keys: dict[str, Any] = field(default_factory=dict)

    @property
    def is_id(self) -> bool:
        return self.id_prefix is not None


def parse_selector(text: str) -> Selector:
    """``"3fa2c1"`` (an id prefix) or ``"step=5,sample_index=12,rollout_n=0"``; raises SelectorError."""
    raw = text.strip()
    if not raw:
        raise SelectorError("empty trajectory selector (give an id prefix or key=value pairs)")
    if "=" not in raw:
        ref = raw.lower()
        if any(c not in _HEX for c in ref):
            raise SelectorError(
                f"{raw!r} is neither a trajectory id (hex) nor a selector "
                f"(key=value pairs, keys: {', '.join(SELECTOR_KEYS)})"
            )
        return Selector(text=raw, id_prefix=ref)
    keys: dict[str, Any] = {}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            raise SelectorError(f"selector {raw!r}: empty item between commas")
        name, sep, value = part.partition("=")
        name, value = name.strip().lower().replace("-", "_"), value.strip()
        if not sep or not name:
            raise SelectorError(f"selector {raw!r}: {part!r} is not key=value")
        name = _ALIASES.get(name, name)
        if name not in SELECTOR_KEYS:
            raise SelectorError(f"selector {raw!r}: unknown key {name!r} (keys: {', '.join(SELECTOR_KEYS)})")
        if name in keys:
            raise SelectorError(f"selector {raw!r}: key {name!r} given twice")
        if not value:
            raise SelectorError(f"selector {raw!r}: no value for {name!r}")
        keys[name] = _parse_value(raw, name, value)
    return Selector(text=raw, keys=keys)


def _parse_value(raw: str, name: str, value: str) -> Any:
    if name == "experiment":
        return value
    if name == "validate":
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise SelectorError(f"selector {raw!r}: validate must be true or false, not {value!r}")
    if _ASCII_INT.fullmatch(value):
        return int(value)
    if value.lstrip("+-").isdigit():  # int() would read "５" (full-width) as 5: refused, not guessed
        raise SelectorError(f"selector {raw!r}: {name} must be an integer in ASCII digits, not {value!r}")
    return value  # a key recorded as a string, such as sample_index=s1-3


def format_keys(keys: dict[str, Any]) -> str:
    return ",".join(f"{k}={_fmt_value(keys[k])}" for k in SELECTOR_KEYS if k in keys)


def _fmt_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def trajectory_keys(traj: Trajectory) -> dict[str, Any]:
    """The selector keys of a trajectory (those it has)."""
    values = {
        "step": traj.step,
        "sample_index": traj.sample_index,
        "rollout_n": traj.rollout_n,
        "validate": traj.validate,
        "experiment": traj.experiment,
    }
    return {k: v for k, v in values.items() if v is not None}


GROUP_KEYS = ("step", "sample_index", "validate", "experiment")


def resolve(
    run: Run, selector: Selector, inherit: dict[str, Any] | None = None, one_group: bool = False
) -> str:
    """The id of the one trajectory ``selector`` picks in ``run``; ``inherit`` fills missing keys.

    With ``one_group``, a selector may match several rollouts of one sample (the first is taken).
    """
    if selector.is_id:
        assert selector.id_prefix is not None
        return run.resolve(selector.id_prefix)[0]
    keys = {**(inherit or {}), **selector.keys}
    wanted = format_keys(keys)
    step = keys.get("step")
    listing = listing_rows(run.trajectories(Filters(step=step) if step is not None else None))
    candidates = listing
    # apply keys one at a time so that the error names the one that left nothing
    for key in SELECTOR_KEYS:
        if key not in keys:
            continue
        kept = [r for r in candidates if r[key] == keys[key]]
        if not kept:
            seen = sorted({r[key] for r in candidates if r[key] is not None}, key=str)
            narrowed = format_keys(
                {k: keys[k] for k in SELECTOR_KEYS[: SELECTOR_KEYS.index(key)] if k in keys}
            )
            where = f"among the {len(candidates)} trajectories with {narrowed}" if narrowed else "in the run"
            shown = _fmt_values(seen)
            raise SelectorError(
                f"{wanted} matches no trajectory in {run.path}: no {key}={_fmt_value(keys[key])} {where}"
                + (f" ({key} values there: {shown})" if seen else "")
            )
        candidates = kept
    if one_group and len({tuple(r[k] for k in GROUP_KEYS) for r in candidates}) == 1:
        return candidates[0]["id"]
    if len(candidates) > 1:
        varying = [k for k in SELECTOR_KEYS if k not in keys and len({r[k] for r in candidates}) > 1]
        if one_group:
            varying = [k for k in varying if k != "rollout_n"]
        listed = ", ".join(
            f"{r['id'][:12]} ({format_keys({k: r[k] for k in varying if r[k] is not None}) or r['name']})"
            for r in candidates[:6]
        )
        more = f", +{len(candidates) - 6} more" if len(candidates) > 6 else ""
        hint = f"; add {' or '.join(varying)} to pick one" if varying else "; pass an id instead"
        raise SelectorError(
            f"{wanted} matches {len(candidates)} trajectories in {run.path}: {listed}{more}{hint}"
        )
    return candidates[0]["id"]


def _fmt_values(values: list[Any], limit: int = 12) -> str:
    ints = values and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    if ints and len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    shown = ", ".join(_fmt_value(v) for v in values[:limit])
    return shown + (f", +{len(values) - limit} more" if len(values) > limit else "")


def select_pair(run_a: Run, a: str, run_b: Run, b: str | None) -> tuple[Trajectory, Trajectory]:
    """Load the two trajectories named by ``a`` and ``b``.

    ``b`` given as ``key=value`` pairs inherits the other keys from trajectory A (the experiment
    only within one run); ``b`` omitted means "the same keys as A", useful across two runs.
    """
    sel_a = parse_selector(a)
    sel_b = parse_selector(b) if b is not None else Selector(text="", keys={})
    same_run = run_a.path.resolve() == run_b.path.resolve()
    if b is None and same_run:
        raise SelectorError("give trajectory B (an id or keys that change, e.g. rollout_n=1), or --group")
    traj_a = run_a.trajectory(resolve(run_a, sel_a))
    inherit = trajectory_keys(traj_a)
    if not same_run:
        inherit.pop("experiment", None)
    traj_b = run_b.trajectory(resolve(run_b, sel_b, inherit=inherit))
    return traj_a, traj_b
