"""Replaying whole agent loops of a verl batch whose rollouts share one ``extra_info`` dict per prompt
(``DataProto.repeat``), which verl's reward managers add to in place: every agent loop is served."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

from support import rlreplay_proc

SCRIPT = Path(__file__).parents[1] / "verl_scripts" / "replay_shared_extra_info.py"


rlreplay = partial(rlreplay_proc, check=True, timeout=400)


def engine_calls(proc: subprocess.CompletedProcess) -> int:
    return int(next(x for x in proc.stdout.splitlines() if x.startswith("ENGINE_CALLS ")).split()[1])


def test_serve_agent_serves_every_rollout_of_a_prompt_whose_rows_share_extra_info(tmp_path: Path) -> None:
    (tmp_path / "w1").mkdir()
    (tmp_path / "w2").mkdir()
    live = rlreplay("record", "--out", "src", "--", sys.executable, str(SCRIPT), "w1", cwd=tmp_path)
    source = {
        (r["sample_index"], r["rollout_n"]): r
        for r in map(json.loads, rlreplay("ls", "src", "--json", cwd=tmp_path).stdout.splitlines())
    }
    assert len(source) == 9  # 3 prompts x 3 rollouts
    assert engine_calls(live) == sum(r["model_calls"] for r in source.values()) > 0
    new = rlreplay(
        "replay",
        "src",
        "--serve",
        "agent",
        "--out",
        "new",
        "--",
        sys.executable,
        str(SCRIPT),
        "w2",
        cwd=tmp_path,
    )
    assert engine_calls(new) == 0
    assert "9 ops served; 0 trajectories diverged" in new.stderr
    rows = [json.loads(x) for x in rlreplay("ls", "new", "--json", cwd=tmp_path).stdout.splitlines()]
    assert sorted((r["sample_index"], r["rollout_n"]) for r in rows) == sorted(source)
    for row in rows:
        assert (row["replay"], row["replay_of"]) == (
            "served",
            source[row["sample_index"], row["rollout_n"]]["id"],
        )
        assert row["model_calls"] == 0
