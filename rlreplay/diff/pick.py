"""Picking the trajectories a diff compares: selectors (``Selection.parse``), ids and id prefixes."""

from __future__ import annotations

from typing import Any

from rlreplay.errors import SelectorError
from rlreplay.format.keys import SELECT_KEYS, TrajectoryKey
from rlreplay.model import Trajectory, listing_rows
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.read.selection import Selection

#: A selector (``step=5,sample_index=12,rollout_n=0`` or an id prefix) is a Selection.
parse_selector = Selection.parse


def resolve(run: Run, selection: Any, inherit: TrajectoryKey | None = None, one_group: bool = False) -> str:
    """The id of the one trajectory ``selection`` picks in ``run``; ``inherit`` (another
    trajectory's key) fills the keys it does not give.

    With ``one_group``, a selector may match several rollouts of one sample (the first is taken).
    """
    if selection.id is not None:
        return run.resolve(selection.id)[0]
    given = selection.chosen()
    inherited = {k: v for k, v in (inherit.as_dict() if inherit else {}).items() if k not in given}
    wanted = ",".join(
        f"{k.name}={_fmt_value(inherited[k.name] if k.name in inherited else given[k.name])}"
        for k in SELECT_KEYS
        if k.name in given or k.name in inherited
    )
    step = inherited["step"] if "step" in inherited else selection.filters().step
    candidates = run.trajectories(Filters(step=step) if step is not None else None)
    # apply keys one at a time so that the error names the one that left nothing
    narrowed: list[str] = []
    for key in SELECT_KEYS:
        if key.name in given:
            kept = Selection(**{key.name: given[key.name]}).apply(candidates)
        elif key.name in inherited:
            kept = Filters(**{key.name: inherited[key.name]}).apply(candidates)
        else:
            continue
        value = given.get(key.name, inherited.get(key.name))
        if not kept.num_rows:
            seen = sorted({r[key.name] for r in listing_rows(candidates) if r[key.name] is not None}, key=str)
            where = (
                f"among the {candidates.num_rows} trajectories with {','.join(narrowed)}"
                if narrowed
                else "in the run"
            )
            raise SelectorError(
                f"{wanted} matches no trajectory in {run.path}: no {key.name}={_fmt_value(value)} {where}"
                + (f" ({key.name} values there: {_fmt_values(seen)})" if seen else "")
            )
        narrowed.append(f"{key.name}={_fmt_value(value)}")
        candidates = kept
    rows = listing_rows(candidates)
    if one_group and len({TrajectoryKey.from_row(r).group() for r in rows}) == 1:
        return rows[0]["id"]
    if len(rows) > 1:
        varying = [
            k.name
            for k in SELECT_KEYS
            if k.name not in given and k.name not in inherited and len({r[k.name] for r in rows}) > 1
        ]
        if one_group:
            varying = [k for k in varying if k != "rollout_n"]
        listed = ", ".join(f"{r['id'][:12]} ({_keys_text(r, varying) or r['name']})" for r in rows[:6])
        more = f", +{len(rows) - 6} more" if len(rows) > 6 else ""
        hint = f"; add {' or '.join(varying)} to pick one" if varying else "; pass an id instead"
        raise SelectorError(f"{wanted} matches {len(rows)} trajectories in {run.path}: {listed}{more}{hint}")
    return rows[0]["id"]


def _keys_text(row: dict[str, Any], names: list[str]) -> str:
    return ",".join(f"{k}={_fmt_value(row[k])}" for k in names if row[k] is not None)


def _fmt_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
    sel_b = parse_selector(b) if b is not None else Selection()
    same_run = run_a.path.resolve() == run_b.path.resolve()
    if b is None and same_run:
        raise SelectorError("give trajectory B (an id or keys that change, e.g. rollout_n=1), or --group")
    traj_a = run_a.trajectory(resolve(run_a, sel_a))
    inherit = traj_a.key if same_run else traj_a.key.without_experiment()
    traj_b = run_b.trajectory(resolve(run_b, sel_b, inherit=inherit))
    return traj_a, traj_b
