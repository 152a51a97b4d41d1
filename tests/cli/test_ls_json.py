"""``ls --json`` writes, byte for byte, ``orjson.dumps`` of each listing row with its keys merged
(int, string or null), computed here from the listing table row by row."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.format.index import LISTING_SCHEMA
from rlreplay.model import listing_json

KEYS = ("step", "sample_index", "rollout_n")


def expected_lines(table: pa.Table, extra: dict[str, list[Any]] | None = None) -> str:
    out = []
    for i, row in enumerate(table.to_pylist()):
        merged = {}
        for name, value in row.items():
            if name.endswith("_str"):
                continue
            merged[name] = row[f"{name}_str"] if name in KEYS and value is None else value
        for name, values in (extra or {}).items():
            merged[name] = values[i]
        out.append(orjson.dumps(merged).decode() + "\n")
    return "".join(out)


@rlreplay.trace_op(name="Tool.execute", kind="tool")
async def execute(fail: str | None) -> dict:
    if fail:
        raise ValueError(fail)
    return {"text": "ok"}


def test_ls_json_is_each_listing_row_with_int_string_and_null_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "keys"
    rlreplay.init(run_dir, experiment='say "hi"\n', worker="w0")
    keys = [(1, 0, 0), ("warmup", 'q"1\n', 1), (None, None, None), (2, "é\\", "r\x01")]

    async def go() -> None:
        for i, (step, sample, rollout) in enumerate(keys):
            try:
                async with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=rollout):
                    await execute('bad "x"\n\t' if i % 2 else None)
            except ValueError:
                pass

    asyncio.run(go())
    rlreplay.close()
    table = rlreplay.open_run(run_dir).trajectories()
    assert main(["ls", str(run_dir), "--json"]) == 0
    out = capsys.readouterr().out
    assert out == expected_lines(table)
    rows = [orjson.loads(line) for line in out.splitlines()]
    assert {tuple(r[k] for k in KEYS) for r in rows} == set(keys)


def test_listing_json_matches_row_by_row_over_many_distinct_values() -> None:
    rng = np.random.default_rng(7)
    n = 10_000
    hexes = [f"{v:032x}" for v in rng.integers(0, 2**62, n)]
    ids = [h if i % 97 else h + '"\\\n' for i, h in enumerate(hexes)]
    steps = [int(v) if v % 3 else None for v in rng.integers(0, 50, n)]
    floats = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 20, n)
    floats[::101] = -0.0
    columns: dict[str, Any] = {}
    for field in LISTING_SCHEMA:
        name, kind = field.name, field.type
        if name == "id":
            values: list[Any] = ids
        elif name == "step":
            values = steps
        elif name == "step_str":
            values = [None if s is not None else f"s{i % 5000}" for i, s in enumerate(steps)]
        elif name.endswith("_str"):
            values = [None] * n
        elif kind == pa.string():
            values = [None if i % 7 == 0 else f"v{i % 13}" for i in range(n)]
        elif kind == pa.float64():
            values = [None if i % 11 == 0 else float(v) for i, v in enumerate(floats)]
        elif kind == pa.bool_():
            values = [bool(i % 2) for i in range(n)]
        else:
            values = [int(v) for v in rng.integers(-(2**40), 2**40, n)]
        columns[name] = values
    table = pa.table(columns, schema=LISTING_SCHEMA)
    extra = {"replay": ["served" if i % 3 else None for i in range(n)], "replay_of": [None] * n}
    expected = expected_lines(table, extra)
    assert "".join(listing_json(table, extra, chunk=6000)) == expected
    # slices made on several threads come out in order, each whole
    for threads, chunk in ((2, 999), (4, 1000), (3, n)):
        assert "".join(listing_json(table, extra, chunk=chunk, threads=threads)) == expected
    assert "".join(listing_json(table.slice(0, 0))) == ""
    assert "".join(listing_json(table.slice(0, 0), threads=4)) == ""
    # a reader that stops early (a closed pipe): what was made ahead is dropped, nothing hangs
    lines = listing_json(table, extra, chunk=500, threads=2)
    assert next(lines) == "".join(expected.splitlines(keepends=True)[:500])
    lines.close()
