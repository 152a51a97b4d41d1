"""``sample_runs/README.md`` says what the shipped verl runs hold: each figure of their tables is
computed here from the span files with pyarrow and found, as written, in the run's section."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "sample_runs" / "README.md").read_text()


def section(name: str) -> str:
    start = README.index(f"## `{name}/`")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def spans(name: str) -> list[dict]:
    files = sorted((ROOT / "sample_runs" / name).glob("spans/*/*/*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default").to_pylist()


def _manifest(name: str) -> dict:
    return json.loads((ROOT / "sample_runs" / name / "run.json").read_text())


def figures(name: str) -> dict[str, object]:
    rows = spans(name)
    signals = [r for r in rows if r["kind"] == "signals"]
    train = [r for r in signals if not r["validate"]]
    val = [r for r in signals if r["validate"]]
    groups: dict[tuple, set] = defaultdict(set)
    per_step: dict[int, list[float]] = defaultdict(list)
    for r in train:
        groups[(r["step"], r["sample_index"])].add(r["reward"])
        per_step[r["step"]].append(r["reward"])
    llm = [json.loads(r["output"]) for r in rows if r["kind"] == "llm"]
    tool_text = [r["output"] or "" for r in rows if r["kind"] == "tool"]
    return {
        "trajectories": f"{len(train) + len(val)} ({len(train)} training + {len(val)} validation)",
        "rewarded": f"{sum(r['reward'] > 0 for r in train)} of {len(train)} training rollouts",
        "per_step": ", ".join(f"{statistics.fmean(v):.2f}" for _, v in sorted(per_step.items())),
        "spread": f"{sum(len(v) > 1 for v in groups.values())} of {len(groups)} groups",
        "validation": f"validation {sum(r['reward'] > 0 for r in val)} of {len(val)}",
        "length": f"{sum(o.get('stop_reason') == 'length' for o in llm)} model calls stopped",
        "tool_errors": f"{sum('error:' in t for t in tool_text)} of the {len(tool_text)} calculator calls",
        "manifest_tokens": f"{_manifest(name)['token_ids']:,}",
    }


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("verl-arith-smollm2", ("trajectories", "rewarded", "per_step", "spread", "validation", "length")),
        (
            "verl-toolagent-smollm2",
            ("trajectories", "rewarded", "validation", "tool_errors", "manifest_tokens"),
        ),
    ],
)
def test_the_tables_say_what_the_files_hold(name: str, shown: tuple[str, ...]) -> None:
    text = section(name)
    found = figures(name)
    for key in shown:
        assert str(found[key]) in text, (name, key, found[key])


def test_the_audit_summary_in_readme_counts_the_showcase() -> None:
    """docs/audit.md's sentence before the showcase's audit: collapsed groups and truncated trajectories."""
    rows = spans("verl-arith-smollm2")
    groups: dict[tuple, set] = defaultdict(set)
    for r in rows:
        if r["kind"] == "signals" and not r["validate"]:
            groups[(r["step"], r["sample_index"])].add(r["reward"])
    truncated = {
        r["trajectory_id"]
        for r in rows
        if r["kind"] == "llm" and json.loads(r["output"]).get("stop_reason") == "length"
    }
    collapsed = sum(len(v) == 1 for v in groups.values())
    sentence = (
        f"{collapsed} of its {len(groups)} training groups got one reward for every rollout and "
        f"{len(truncated)} trajectories"
    )
    assert sentence in " ".join((ROOT / "docs" / "audit.md").read_text().split())
