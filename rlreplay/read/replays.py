"""What a replayed run says about itself: which trajectories were served from which recording.

Read from the root spans' ``replay``/``replay_of``/``replay_reason`` attributes and the served
spans' ``replay`` attribute (the recorder writes them); ``ls`` shows them without loading the
replay code.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.recorder.replay import REASON_KEY, SERVED, SOURCE_KEY, STATUS_KEY

#: The listing columns a replay adds: served/diverged/live, the source trajectory, why it diverged.
COLUMNS = (STATUS_KEY, SOURCE_KEY, REASON_KEY)


def replay_rows(run: Run, filters: Filters | None = None) -> dict[str, dict[str, Any]]:
    """``{trajectory id: {"replay": ..., "replay_of": ..., "replay_reason": ...}}`` from the root
    spans of a replayed run (``replay_reason``: why it diverged, else None)."""
    spans = run.spans(filters, columns=["trajectory_id", "parent_id", "kind", "attributes"])
    out: dict[str, dict[str, Any]] = {}
    for row in spans.to_pylist():
        if row["parent_id"] is not None or not row["attributes"] or row["kind"] == "signals":
            continue
        attrs = orjson.loads(row["attributes"])
        if isinstance(attrs, dict) and STATUS_KEY in attrs:
            out[row["trajectory_id"]] = {k: attrs.get(k) for k in COLUMNS}
    return out


def served_count(run: Run) -> int:
    """How many spans of ``run`` were served from a recording."""
    spans = run.spans(columns=["parent_id", "attributes"])
    return sum(
        1
        for row in spans.to_pylist()
        if row["parent_id"] is not None
        and row["attributes"]
        and orjson.loads(row["attributes"]).get(STATUS_KEY) == SERVED
    )
