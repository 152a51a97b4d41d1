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
