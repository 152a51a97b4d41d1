"""A partial load (``Run.load`` with ``kinds`` or ``skip_kinds``) is the whole load, cut: on every
shipped run, each span it holds is the span the whole trajectory holds, token arrays shared with
spans left out included, and nothing is called unreadable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from rlreplay.read.open import open_run

REPO = Path(__file__).parents[2]
SHIPPED = sorted(p for p in (REPO / "sample_runs").iterdir() if (p / "run.json").is_file())


def spans_of(trajectories: list[Any], keep: Any) -> dict[str, list[dict[str, Any]]]:
    return {t.id: [s.to_dict(nested=False) for s in t.spans if keep(s.kind)] for t in trajectories}


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: p.name)
def test_a_partial_load_holds_the_whole_loads_spans_of_its_kinds(shipped: Path) -> None:
    run = open_run(shipped)
    ids = run.trajectories()["id"].to_pylist()
    whole = run.load(ids)
    assert [t.id for t in whole] == ids
    kinds = sorted({s.kind for t in whole for s in t.spans})
    assert len(kinds) >= 3, kinds
    # spans whose token arrays take values from another span's (a reference, ``"r":``), read from
    # the files with pyarrow alone: what a cut load must resolve
    rows = ds.dataset(sorted(shipped.glob("spans/**/*.parquet")), format="parquet").to_table(
        columns=["inputs", "output"]
    )
    assert any('"r":[[' in (r["inputs"] or "") + (r["output"] or "") for r in rows.to_pylist())
    for kind in kinds:
        only = run.load(ids, kinds=[kind])
        assert spans_of(only, lambda k: True) == {
            i: v for i, v in spans_of(whole, lambda k, kind=kind: k == kind).items() if v
        }, kind
    rest = run.load(ids, skip_kinds=["signals"])  # the prompt page's cut
    assert spans_of(rest, lambda k: True) == spans_of(whole, lambda k: k != "signals")
    assert run.notes() == [], run.notes()[:3]


def same_values(light: Any, whole: Any) -> bool:
    """Whether a light view's payload (token id arrays as numpy, other arrays possibly left as their
    placeholders) holds the whole load's values."""
    import numpy as np

    if isinstance(light, np.ndarray):
        return light.tolist() == whole
    if isinstance(light, dict) and light.get("__type__") == "tokens":
        return isinstance(whole, list)  # left as recorded's placeholder: not decoded
    if isinstance(light, dict):
        return (
            isinstance(whole, dict)
            and light.keys() == whole.keys()
            and all(same_values(v, whole[k]) for k, v in light.items())
        )
    if isinstance(light, list):
        return isinstance(whole, list) and len(light) == len(whole) and all(map(same_values, light, whole))
    return light == whole


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: p.name)
def test_the_audits_light_views_hold_the_whole_loads_values(shipped: Path) -> None:
    """``read.scan.step_calls`` (the audit's and the search's one pass over a step, one kind of
    span decoded) gives each span's payload as the whole load does."""
    from rlreplay.read.scan import by_step, step_calls

    run = open_run(shipped)
    compared = 0
    for step, ids in by_step(run.trajectories()).items():
        whole = {t.id: {s.span_id: s for s in t.spans} for t in run.load(ids)}
        for kind in ("llm", "tool", "agent"):
            calls = step_calls(run, step, ids, [kind])
            for k, tid in enumerate(ids):
                light = calls.trajectory(k)
                for span in light.spans if light is not None else []:
                    held = whole[tid][span.span_id]
                    assert span.kind == held.kind == kind
                    assert same_values(span.inputs, held.inputs), (tid, span.span_id)
                    assert same_values(span.output, held.output), (tid, span.span_id)
                    compared += 1
    assert compared and run.notes() == [], run.notes()[:3]
