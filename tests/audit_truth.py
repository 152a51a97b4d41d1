"""What ``rlreplay audit`` must find in the shipped real-verl run, computed from its span files
by the checks' rules written out here, not by the audit code."""

from __future__ import annotations

import glob
import itertools
from pathlib import Path
from typing import Any


def verl_sample_truth(run_dir: Path) -> dict[str, set[Any]]:
    """Per check: the flagged trajectory ids (group_collapse: the (step, sample_index) groups)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlreplay.format import payload
    from rlreplay.read.open import open_run

    spans = pa.concat_tables(
        [pq.read_table(f) for f in sorted(glob.glob(str(run_dir / "spans" / "*" / "*" / "*.parquet")))]
    ).to_pylist()
    # tool calls that raised or returned an error text
    tool_errors = set()
    for s in spans:
        if s["kind"] != "tool":
            continue
        out, _ = payload.decode_safe(s["output"])
        text = out[0].get("text") if isinstance(out, list) and out and isinstance(out[0], dict) else None
        if s["status"] == "error" or (isinstance(text, str) and text.lower().startswith("error")):
            tool_errors.add(s["trajectory_id"])
    # training groups whose rollouts all got one reward (the signals rows hold the rewards)
    rewards: dict[tuple[int, int], list[float]] = {}
    for s in spans:
        if s["kind"] == "signals" and not s["validate"] and s["reward"] is not None:
            rewards.setdefault((s["step"], s["sample_index"]), []).append(s["reward"])
    collapsed = {g for g, r in rewards.items() if len(r) > 1 and len(set(r)) == 1}
    # model calls stopped on the length limit, and re-tokenized turns (from the recorded ids)
    run = open_run(run_dir)
    truncated, retokenized = set(), set()
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        calls = sorted((s for s in traj.spans if s.kind == "llm"), key=lambda s: s.start_ns)
        for s in calls:
            if s.output.get("stop_reason") == "length":
                truncated.add(traj.id)
        for a, b in itertools.pairwise(calls):
            before = a.inputs["prompt_ids"] + a.output["token_ids"]
            if b.inputs["prompt_ids"][: len(before)] != before:
                retokenized.add(traj.id)
    return {
        "tool_error": tool_errors,
        "group_collapse": collapsed,
        "truncated": truncated,
        "retokenization": retokenized,
    }
