"""Compare badges: each trajectory's status (same, changed, only here) in the comparison its run shows.

The comparison is the last one the compare page showed with the run, else, for a replay, the one
with its source when that run is in the folder; it is computed once per pair while both listings
stand.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from rlreplay.errors import RunError
from rlreplay.playback import ReplayConfig
from rlreplay.read.selection import Selection
from rlreplay.ui.data import RunSet, RunView


@dataclass(frozen=True)
class Shown:
    """A comparison as the compare page shows it: run A with run B, within a step and split."""

    a: str
    b: str
    step: str | None = None
    validate: bool | None = None

    def selection(self) -> Selection:
        return Selection(step=self.step, validate=self.validate)


@dataclass
class Badge:
    status: str  # same, changed or only (in this run)
    label: str
    href: str
    tip: str


class Comparisons:
    """Pairs of two runs of the folder (``rlreplay compare``), kept while both listings stand."""

    def __init__(self, runs: RunSet) -> None:
        self.runs = runs
        self._lock = threading.Lock()
        self._pairs: dict[Shown, tuple[Any, list[Any]]] = {}
        self._badges: dict[Shown, tuple[Any, dict[str, dict[str, Badge]]]] = {}
        self._shown: dict[str, Shown] = {}

    def pairs(self, shown: Shown) -> list[Any]:
        """The pairs of ``shown``'s two runs, computed again only when a listing changed."""
        from rlreplay.compare import compare_runs

        a, b = self.runs.get(shown.a), self.runs.get(shown.b)
        key = (a.listing(), b.listing())
        with self._lock:
            cached = self._pairs.get(shown)
        if cached is not None and cached[0][0] is key[0] and cached[0][1] is key[1]:
            return cached[1]
        selection = shown.selection()
        found = list(compare_runs(a.run, b.run, selection if selection.chosen() else None))
        with self._lock:
            self._pairs[shown] = (key, found)
        return found

    def show(self, shown: Shown) -> None:
        """The comparison the compare page shows now: both runs' pages wear its badges."""
        with self._lock:
            self._shown[shown.a] = self._shown[shown.b] = shown

    def current(self, view: RunView) -> Shown | None:
        """The comparison ``view``'s pages show badges of: the last one shown with it, else, for a
        replay, with its source when that run is in the folder."""
        with self._lock:
            shown = self._shown.get(view.name)
        if shown is not None:
            return shown
        source = _replay_source(view)
        if source is None or self.runs.single:
            return None
        names = [n for n in self.runs.names() if n != view.name]
        by_path = [n for n in names if (self.runs.root / n).resolve() == source]
        found = by_path or [n for n in names if n == source.name]
        return Shown(view.name, found[0]) if found else None

    def badges(self, view: RunView) -> dict[str, Badge]:
        """Each of ``view``'s trajectories in the current comparison: same, changed or only here."""
        shown = self.current(view)
        if shown is None:
            return {}
        try:
            pairs = self.pairs(shown)
            key = (self.runs.get(shown.a).listing(), self.runs.get(shown.b).listing())
        except RunError:  # the other run went away
            return {}
        with self._lock:
            cached = self._badges.get(shown)
        if cached is None or cached[0][0] is not key[0] or cached[0][1] is not key[1]:
            cached = (key, _badges(self.runs, shown, pairs))
            with self._lock:
                self._badges[shown] = cached
        return cached[1].get(view.name, {})


def _replay_source(view: RunView) -> Path | None:
    config = ReplayConfig.from_manifest(view.manifest())
    if config is None or not config.source:
        return None
    try:
        return Path(config.source).resolve()
    except (OSError, RuntimeError):
        return None


def compare_href(runs: RunSet, shown: Shown, anchor: str | None = None) -> str:
    """The compare page of ``shown``; ``anchor``: scrolled to the pair of this trajectory."""
    params = {"with": shown.b, **shown.selection().params()}
    href = f"{runs.get(shown.a).base}/compare?{urlencode(params)}"
    return f"{href}#pair-{anchor}" if anchor else href


def _badges(runs: RunSet, shown: Shown, pairs: list[Any]) -> dict[str, dict[str, Badge]]:
    a, b = runs.get(shown.a), runs.get(shown.b)
    out: dict[str, dict[str, Badge]] = {shown.a: {}, shown.b: {}}
    for p in pairs:
        for mine, theirs, here, there in ((p.a, p.b, shown.a, b), (p.b, p.a, shown.b, a)):
            if mine is None:
                continue
            if theirs is None:
                badge = Badge(
                    "only", "only in this run", compare_href(runs, shown, mine), f"not in {there.name}"
                )
            elif p.same:
                badge = Badge("same", "same", f"{there.base}/t/{theirs}", f"the same as in {there.name}")
            else:
                anchor = p.a
                tip = f"differs from {there.name}"
                if p.first_difference:
                    d = p.first_difference
                    tip += f": first at span {d.get('span')} ({d.get('name')}), {d.get('field')}"
                badge = Badge("changed", "changed", compare_href(runs, shown, anchor), tip)
            out[here][mine] = badge
    return out
