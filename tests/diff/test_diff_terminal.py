"""``diff --group`` on a real terminal 100 to 140 columns wide: every line fits, headers and ids whole,
the signals readable, and what the best rollout and this one say under the row they belong to.

Expected values come from ``ls --json`` (the listing) and ``diff --group --json`` (the previews),
never from the table being checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from support import on_terminal

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "sample_runs" / "verl-arith-smollm2"
HEADERS = {
    "rollout_n",
    "id",
    "reward",
    "advantage",
    "logprob_diff_max",
    "importance_ratio",
    "model_calls",
    "response_tokens",
    "tool_errors",
    "diverges",
    "at",
}


def _json(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "rlreplay", *args, "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _group() -> tuple[str, dict[str, dict], dict]:
    """A training group whose rollouts differ in advantage and in what they say."""
    rows = [json.loads(line) for line in _json("ls", str(RUN), "--train").splitlines()]
    by_group: dict[tuple, list[dict]] = {}
    for r in rows:
        by_group.setdefault((r["step"], r["sample_index"]), []).append(r)
    for (step, sample), members in sorted(by_group.items()):
        if len({m["advantage"] for m in members}) < 2:
            continue
        selector = f"step={step},sample_index={sample}"
        got = json.loads(_json("diff", "-r", str(RUN), "--group", selector))
        if sum(m["preview"] is not None for m in got["rollouts"]) >= 2:
            return selector, {m["id"][:12]: m for m in members}, got
    raise AssertionError("the run has no group with different advantages and diverging rollouts")


@pytest.fixture(scope="module")
def group() -> tuple[str, dict[str, dict], dict]:
    return _group()


@pytest.mark.parametrize("columns", [100, 120, 140])
def test_group_fits_the_terminal(group, columns: int) -> None:
    selector, rows, got = group
    text = on_terminal("diff", "-r", str(RUN), "--group", selector, columns=columns)
    lines = text.splitlines()
    assert lines and all(len(line) <= columns for line in lines), [len(line) for line in lines]
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rollout_n", "id"])
    header = lines[at].split()
    assert set(header) <= HEADERS and {"reward", "advantage", "diverges", "at"} <= set(header)
    assert "…" not in lines[at]
    previews = {m["id"][:12]: m for m in got["rollouts"]}
    body = [line for line in lines[at + 1 :] if line.strip()]
    seen = []
    i = 0
    while i < len(body):
        cells = body[i].split()
        short = cells[1]
        assert short in rows, body[i]  # a whole 12-character id prefix
        row = rows[short]
        seen.append(short)
        advantage = float(cells[header.index("advantage")])
        assert math.isclose(advantage, row["advantage"], rel_tol=5e-3, abs_tol=1e-12), (cells, row)
        assert float(cells[header.index("reward")]) == row["reward"]
        member = previews[short]
        i += 1
        if member["preview"] is None:
            continue
        # what the best says and what this one says, on the two lines under its row
        for label, value in (("best says:", member["preview_best"]), ("this says:", member["preview"])):
            said = body[i].lstrip()
            assert said.startswith(label + " "), (body[i], label)
            shown = said[len(label) + 1 :]
            expected = repr(value)[1:-1]
            assert shown == expected or (shown.endswith("…") and expected.startswith(shown[:-1])), shown
            i += 1
    assert sorted(seen) == sorted(rows)
