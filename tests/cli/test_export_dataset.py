"""``export`` as an RL dataset: only what an audit check flags (``--finding``), per-token fields
(ids, mask, rollout and trainer log-probs), and files that load with the same types in
``datasets``, DuckDB and polars. Expected values come from the run's spans (read with the reader)
and from ``tests/audit_truth.py``'s rules, never from the export code."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from audit_truth import verl_sample_truth

from rlreplay.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "sample_runs" / "verl-arith-smollm2"  # trainer log-probs, tool calls, length stops
PER_TOKEN = ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "trainer_log_probs")


def export(tmp_path: Path, name: str, *extra: str, run: Path = RUN) -> Path:
    out = tmp_path / name
    assert main(["export", str(run), "--out", str(out), *extra]) == 0
    return out


def records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_finding_exports_what_the_check_flags(tmp_path: Path, capsys) -> None:
    truth = verl_sample_truth(RUN)["truncated"]
    assert truth
    for fmt in ("jsonl", "parquet"):
        got = records(export(tmp_path, f"cut.{fmt}", "--finding", "truncated"))
        assert {r["id"] for r in got} == truth
    # with the other selection options, applied before --limit
    got = records(export(tmp_path, "cut-train.jsonl", "--finding", "truncated", "--train", "--limit", "3"))
    assert len(got) == 3 and all(not r["validate"] and r["id"] in truth for r in got)
    capsys.readouterr()
    assert main(["export", str(RUN), "--out", str(tmp_path / "x.jsonl"), "--finding", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and len(err.strip().splitlines()) == 1


def _per_token_truth() -> dict[str, dict[str, Any]]:
    """Each trajectory's agent-loop ids, mask and rollout log-probs, and the trainer's log-probs."""
    from rlreplay.read.open import open_run

    run = open_run(RUN)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        agent = next(s.output for s in traj.spans if s.kind == "agent")
        signals = [s.output for s in traj.spans if s.kind == "signals" and isinstance(s.output, dict)]
        out[traj.id] = {
            "prompt_ids": agent["prompt_ids"],
            "response_ids": agent["response_ids"],
            "response_mask": agent["response_mask"],
            "rollout_log_probs": agent["response_logprobs"],
            "trainer_log_probs": signals[-1]["old_log_probs"] if signals else None,
        }
    return out


def _same_floats(got: list[float] | None, want: list[float] | None) -> bool:
    if got is None or want is None:
        return got is want
    # float32 in the run: the export keeps them exactly (JSON writes the shortest repr of the float)
    return len(got) == len(want) and all(
        math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-7) for g, w in zip(got, want)
    )


def test_per_token_fields(tmp_path: Path) -> None:
    truth = _per_token_truth()
    assert any(t["trainer_log_probs"] for t in truth.values())
    for fmt in ("jsonl", "parquet"):
        got = records(export(tmp_path, f"tokens.{fmt}", "--token-ids", "--logprobs"))
        assert {r["id"] for r in got} == set(truth)
        for r in got:
            want = truth[r["id"]]
            for name in ("prompt_ids", "response_ids", "response_mask"):
                assert r[name] == want[name], name
            for name in ("rollout_log_probs", "trainer_log_probs"):
                assert _same_floats(r[name], want[name]), name
            assert len(r["rollout_log_probs"]) == len(r["response_ids"]) == len(r["response_mask"])
    plain = records(export(tmp_path, "plain.jsonl"))
    assert not set(PER_TOKEN) & set(plain[0])
    only_probs = records(export(tmp_path, "probs.jsonl", "--logprobs"))
    assert {"rollout_log_probs", "trainer_log_probs"} <= set(only_probs[0])
    assert not {"prompt_ids", "response_ids"} & set(only_probs[0])


def _canonical(kind: str, t: Any) -> str:
    """A loader's column type in one spelling: string, bool, int8..int64, float32/64, list<...>,
    struct{name: type, ...}."""
    if kind == "datasets":
        import datasets

        if isinstance(t, dict):
            return "struct{" + ", ".join(f"{k}: {_canonical(kind, v)}" for k, v in t.items()) + "}"
        if isinstance(t, (datasets.List, datasets.Sequence, list)):
            inner = t[0] if isinstance(t, list) else t.feature
            return f"list<{_canonical(kind, inner)}>"
        if isinstance(t, datasets.Value):
            return {"large_string": "string", "float": "float32", "double": "float64"}.get(t.dtype, t.dtype)
        return type(t).__name__  # Json, ...: not a type the others have
    if kind == "polars":
        import polars as pl

        if isinstance(t, pl.Struct):
            return "struct{" + ", ".join(f"{f.name}: {_canonical(kind, f.dtype)}" for f in t.fields) + "}"
        if isinstance(t, pl.List):
            return f"list<{_canonical(kind, t.inner)}>"
        names = {pl.String: "string", pl.Boolean: "bool", pl.Int8: "int8", pl.Int16: "int16"}
        names |= {pl.Int32: "int32", pl.Int64: "int64", pl.Float32: "float32", pl.Float64: "float64"}
        return names.get(t.base_type(), str(t))
    # duckdb
    if t.id == "struct":
        return "struct{" + ", ".join(f"{n}: {_canonical(kind, c)}" for n, c in t.children) + "}"
    if t.id == "list":
        return f"list<{_canonical(kind, t.child)}>"
    names = {"varchar": "string", "boolean": "bool", "tinyint": "int8", "smallint": "int16"}
    names |= {"integer": "int32", "bigint": "int64", "float": "float32", "double": "float64"}
    return names.get(t.id, t.id)


def _types(path: Path) -> dict[str, dict[str, str]]:
    """The column types ``datasets``, polars and DuckDB give the file, and the rows each reads."""
    import datasets
    import duckdb
    import polars as pl

    json_lines = path.suffix == ".jsonl"
    ds = datasets.load_dataset("json" if json_lines else "parquet", data_files=str(path), split="train")
    frame = pl.read_ndjson(path) if json_lines else pl.read_parquet(path)
    rel = duckdb.sql(f"SELECT * FROM '{path}'")
    out = {
        "datasets": {k: _canonical("datasets", v) for k, v in ds.features.items()},
        "polars": {k: _canonical("polars", v) for k, v in frame.schema.items()},
        "duckdb": {c: _canonical("duckdb", t) for c, t in zip(rel.columns, rel.types)},
    }
    assert len(ds) == frame.height == rel.shape[0] == len(records(path))
    return out


def _widths_aside(types: dict[str, str]) -> dict[str, str]:
    """JSON has no int or float widths: int8..int64 as int, float32/64 as float."""
    import re

    return {
        k: re.sub(r"float(32|64)", "float", re.sub(r"int(8|16|32|64)", "int", v)) for k, v in types.items()
    }


def test_an_export_loads_with_the_same_types_in_datasets_duckdb_and_polars(tmp_path: Path) -> None:
    by_format = {}
    for fmt in ("parquet", "jsonl"):
        path = export(tmp_path, f"all.{fmt}", "--token-ids", "--logprobs")
        types = _types(path)
        assert types["datasets"] == types["polars"] == types["duckdb"], (fmt, types)
        by_format[fmt] = types["polars"]
    assert _widths_aside(by_format["parquet"]) == _widths_aside(by_format["jsonl"])
    messages = by_format["parquet"]["messages"]
    assert messages.startswith("list<struct{role: string, content: string, tool_calls: list<struct{")
    assert by_format["parquet"]["tools"] == "string"  # JSON Schema objects of any shape: see README


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_every_message_has_the_same_keys(tmp_path: Path, fmt: str) -> None:
    """A message without tool calls still has ``tool_calls`` (null): one struct type in every record."""
    got = records(export(tmp_path, f"m.{fmt}", "--step", "1"))
    keys = {tuple(m) for r in got for m in r["messages"]}
    assert keys == {("role", "content", "tool_calls", "tool_call_id")}
    assert any(m["tool_calls"] for r in got for m in r["messages"])
