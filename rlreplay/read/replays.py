"""What a replayed run says about itself: which trajectories were served from which recording.

Read from the root spans' ``replay``/``replay_of`` attributes and the served spans' ``replay``
attribute (``rlreplay.playback`` writes them); ``ls`` shows them without loading the replay code.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.recorder.replay import SERVED


def replay_rows(run: Run, filters: Filters | None = None) -> dict[str, dict[str, Any]]:
    """``{trajectory id: {"replay": ..., "replay_of": ...}}`` from the root spans of a replayed run."""
    spans = run.spans(filters, columns=["trajectory_id", "parent_id", "kind", "attributes"])
    out: dict[str, dict[str, Any]] = {}
    for row in spans.to_pylist():
        if row["parent_id"] is not None or not row["attributes"] or row["kind"] == "signals":
            continue
        attrs = orjson.loads(row["attributes"])
        if isinstance(attrs, dict) and "replay" in attrs:
            out[row["trajectory_id"]] = {"replay": attrs["replay"], "replay_of": attrs.get("replay_of")}
    return out


def served_count(run: Run) -> int:
    """How many spans of ``run`` were served from a recording."""
    spans = run.spans(columns=["parent_id", "attributes"])
    return sum(
        1
        for row in spans.to_pylist()
        if row["parent_id"] is not None
        and row["attributes"]
        and orjson.loads(row["attributes"]).get("replay") == SERVED
    )
