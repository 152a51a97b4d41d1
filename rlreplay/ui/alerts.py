"""The front page's alerts: what ``rlreplay watch`` alerts on, over the steps of the run read so far,
each with a link to the trajectories behind it."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from rlreplay.errors import RunError

#: Trajectory ids an alert shows as links (its list link holds all it names).
SHOWN = 10


def run_alerts(view: Any) -> list[dict[str, Any]]:
    """The alerts of the run's training steps (a run being recorded: but its newest step), from
    the run's audit and mismatch reports as the other pages have them; each alert's dict holds
    ``list_href``, the trajectory list of the trajectories it names."""
    from rlreplay.format.keys import parse_int
    from rlreplay.watch import alerts_over

    listing = view.listing()
    steps = sorted({s for s in (parse_int(str(v)) for v in view.run.step_partitions()) if s is not None})
    until = None
    if view.recording():
        if len(steps) < 2:
            return []
        until = steps[-2]  # the newest step may still be written
    try:
        verdicts = {r["step"]: r["verdict"] for r in view.mismatch().steps if not r["validate"]}
    except RunError:  # no per-token trainer log-probs: no verdicts
        verdicts = {}
    out = []
    for alert in alerts_over(listing, view.findings(), verdicts, until=until):
        shown = alert.to_dict()
        ids = ", ".join(f"'{i}'" for i in alert.trajectories)
        shown["list_href"] = (
            f"{view.base}/trajectories?{urlencode({'step': alert.step, 'where': f'id in ({ids})'})}"
            if ids
            else None
        )
        out.append(shown)
    return out
