"""``rlreplay compare RUN_A RUN_B``: pair the trajectories of two runs and say which changed and where."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    JsonOption,
    app,
    fail,
    key_fields,
    open_run_arg,
    report_warnings,
    selection_options,
)


def _keys(pair: Any) -> str:
    split = " validate" if pair.validate else ""
    return f"{key_fields(pair)}{split}"


def _values(diff: dict[str, Any] | None) -> str:
    """Both values where the pair first differs, a line each under the pair (none: that side has none)."""
    if diff is None or (diff.get("a") is None and diff.get("b") is None):
        return ""
    shown = {side: diff.get(side) for side in ("a", "b")}
    return "".join(f"    {side.upper()}: {'(none)' if v is None else v}\n" for side, v in shown.items())


def _reward(pair: Any) -> str:
    delta = pair.reward_delta
    return "" if delta is None or delta == 0 else f" reward {pair.reward_a} -> {pair.reward_b}"


def _check_paired(result: list[Any], run_a: Any, run_b: Any) -> None:
    """Bad input (exit 2) when no trajectory of A has a partner in B: nothing was compared."""
    if any(pair.a is not None and pair.b is not None for pair in result):
        return
    if not result:
        fail(f"the selection matches no trajectory in {run_a.address} or {run_b.address}: nothing to compare")
    only_a = sum(pair.b is None for pair in result)
    fail(
        f"no trajectory of {run_a.address} ({only_a}) has the keys (step, sample_index, rollout_n, "
        f"validate) of one of {run_b.address} ({len(result) - only_a}): nothing to compare"
    )


@app.command("compare")
@selection_options
def compare_command(
    run_a: Annotated[Path, typer.Argument(metavar="RUN_A", help="The first run (A).")],
    run_b: Annotated[Path, typer.Argument(metavar="RUN_B", help="The second run (B).")],
    as_json: JsonOption = False,
    *,
    selection: Any,
) -> None:
    """Compare two runs trajectory by trajectory.

    Pairs trajectories by (step, sample_index, rollout_n, validate): same or changed (where they
    first differ, and both values there), and those present in one run only.
    """
    from rlreplay.compare import compare_runs, summary, where

    opened_a, opened_b = open_run_arg(None, run_a), open_run_arg(None, run_b)
    if os.path.realpath(opened_a.path) == os.path.realpath(opened_b.path):
        fail(f"RUN_A and RUN_B are the same run ({opened_a.address}): nothing to compare")
    result = list(compare_runs(opened_a, opened_b, selection))
    report_warnings(opened_a)
    report_warnings(opened_b)
    _check_paired(result, opened_a, opened_b)
    write = sys.stdout.write
    if as_json:
        for pair in result:
            write(orjson.dumps(pair.to_dict()).decode() + "\n")
        return
    counts = summary(result)
    mean = counts["reward_delta_mean"]
    write(
        f"{len(result)} pairs: {counts['same']} same, {counts['changed']} changed, "
        f"{counts['only_a']} only in A, {counts['only_b']} only in B\n"
        f"reward: {counts['reward_changed']} changed, delta sum {counts['reward_delta_sum']:+g}"
        + (f", mean {mean:+g}\n" if mean is not None else "\n")
    )
    order = {"changed": 0, "only_a": 1, "only_b": 2, "same": 3}
    for pair in sorted(result, key=lambda p: order[p.status]):
        ids = f"{(pair.a or '-')[:12]} {(pair.b or '-')[:12]}"
        line = f"{pair.status:<8} {_keys(pair)} {ids}{_reward(pair)}"
        if pair.status == "changed":
            line += f"  {where(pair.first_difference)}"
        write(line + "\n")
        if pair.status == "changed":
            write(_values(pair.first_difference))
