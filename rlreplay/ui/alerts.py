"""The front page's alerts: what ``rlreplay watch`` alerts on, over the run's sealed steps, each
with a link to the trajectories behind it.

Each step is read once, as ``watch`` reads it (its audit and mismatch figures), and kept while its
shards are as read; the trend checks then go over the kept steps, which costs next to nothing. A
run being recorded gets a step once it is sealed and left alone, as ``watch`` takes it.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlencode

#: Trajectory ids an alert shows as links (its list link holds all it names).
SHOWN = 10

#: per run (its address): per step, (its shards' stamps, the step as read)
_read: dict[str, dict[int, tuple[tuple[Any, ...], Any]]] = {}
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def run_alerts(view: Any) -> list[dict[str, Any]]:
    """The alerts of the run's sealed steps, in step order; each alert's dict holds ``list_href``,
    the trajectory list of the trajectories it names."""
    from rlreplay.watch import Watcher, read_step, run_ended, sealed_steps

    run = view.run
    with _guard:
        lock = _locks.setdefault(run.address, threading.Lock())
    with lock:
        kept = _read.setdefault(run.address, {})
        checks = view.checks()
        readings = []
        steps = list(sealed_steps(run, run_ended(run) or not view.recording()))
        for step, _ in steps:
            stamps = tuple(run.store.stamp(p) for p in run.span_files(step)[0])
            found = kept.get(step)
            if found is None or found[0] != stamps:
                found = kept[step] = (stamps, read_step(run, step, checks, tokenizer=view.tokenizer))
            readings.append(found[1])
        for step in set(kept) - {step for step, _ in steps}:
            del kept[step]  # gone, or no longer sealed
    watcher = Watcher(checks)
    out = []
    for reading in readings:
        for alert in watcher.take(reading).alerts:
            shown = alert.to_dict()
            ids = ", ".join(f"'{i}'" for i in alert.trajectories)
            query = {"step": alert.step, "where": f"id in ({ids})"}
            shown["list_href"] = f"{view.base}/trajectories?{urlencode(query)}" if ids else None
            out.append(shown)
    return out
