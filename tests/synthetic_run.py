"""Large synthetic runs for tests and benchmarks: a recorded step's spans replicated to many
trajectories and steps, written as sealed span files the way the recorder lays them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlreplay.format.schema import FORMAT_VERSION, PAYLOAD_COLUMNS, SPAN_SCHEMA
from rlreplay.shards.layout import partition_dir
from rlreplay.shards.seal import write_sealed

ID_COLUMNS = ("trajectory_id", "span_id", "parent_id")


def _prefixed(table: pa.Table, name: str, prefix: str, keep_from: int = 4) -> pa.Table:
    """``name``'s ids with their first characters replaced by ``prefix``."""
    column = pc.binary_join_element_wise(
        pa.scalar(prefix), pc.utf8_slice_codeunits(table[name], keep_from), ""
    )
    return table.set_column(table.column_names.index(name), name, column)


REF_COLUMNS = ("inputs", "output")
#: A stretch copied from an earlier span, as payloads name it: ``["<span id>", start, length, at]``.
SPAN_REF = r'\["[0-9a-f]{4}([0-9a-f]{12}",\d)'


def _refs_prefixed(table: pa.Table, prefix: str) -> pa.Table:
    """``table``'s payload references to other spans renamed as ``_prefixed`` renames the spans."""
    for name in REF_COLUMNS:
        column = pc.replace_substring_regex(table[name], SPAN_REF, f'["{prefix}\\1')
        table = table.set_column(table.column_names.index(name), name, column)
    return table


def replicate(base: pa.Table, copies: int, sample_stride: int) -> pa.Table:
    """``copies`` of ``base``'s spans, each with ids of its own (trajectory, span, parent) and its
    sample indexes moved up by ``sample_stride`` per copy (its own prompts)."""
    parts = []
    for r in range(copies):
        part = base
        for name in ID_COLUMNS:
            part = _prefixed(part, name, f"{r:04x}")
        part = _refs_prefixed(part, f"{r:04x}")
        shifted = pc.add(part["sample_index"], r * sample_stride)
        part = part.set_column(part.column_names.index("sample_index"), "sample_index", shifted)
        parts.append(part)
    return pa.concat_tables(parts)


def as_step(table: pa.Table, step: int) -> pa.Table:
    """``table``'s spans as step ``step``: its step column, and trajectory ids of their own."""
    table = table.set_column(
        table.column_names.index("step"), "step", pa.array([step] * table.num_rows, pa.int64())
    )
    ids = table["trajectory_id"]
    stepped = pc.binary_join_element_wise(
        pc.utf8_slice_codeunits(ids, 0, 4), pa.scalar(f"{step:04x}"), pc.utf8_slice_codeunits(ids, 8), ""
    )
    return table.set_column(table.column_names.index("trajectory_id"), "trajectory_id", stepped)


def without_payloads(table: pa.Table) -> pa.Table:
    """The spans with their payload columns (inputs, output, token arrays) empty."""
    for name in PAYLOAD_COLUMNS:
        if name in table.column_names:
            field = table.schema.field(name)
            table = table.set_column(
                table.column_names.index(name), name, pa.nulls(table.num_rows, field.type)
            )
    return table


def with_rewards(table: pa.Table, rng: Any, places: int = 3) -> pa.Table:
    """One reward drawn per trajectory (uniform in [0, 1), ``places`` decimals), on each span that
    carried a reward."""
    ids = table["trajectory_id"]
    unique = pc.unique(ids)
    drawn = pa.array(rng.random(len(unique)).round(places))
    rewards = pc.take(drawn, pc.index_in(ids, unique))
    rewarded = pc.is_valid(table["reward"])
    return table.set_column(
        table.column_names.index("reward"),
        "reward",
        pc.if_else(rewarded, rewards, pa.scalar(None, pa.float64())),
    )


def collapsed(table: pa.Table, groups: int, reward: float = 0.25) -> pa.Table:
    """``table`` with every rollout of its first ``groups`` prompts (lowest sample indexes) given the
    same ``reward``: groups with zero advantage, which ``group_collapse`` flags."""
    samples = pc.unique(table["sample_index"]).sort()[:groups]
    planted = pc.and_(pc.is_in(table["sample_index"], samples), pc.is_valid(table["reward"]))
    return table.set_column(
        table.column_names.index("reward"),
        "reward",
        pc.if_else(planted, pa.scalar(reward, pa.float64()), table["reward"]),
    )


def far_ratios(table: pa.Table, trajectories: int, ratio: float = 100.0) -> pa.Table:
    """``table`` with a trainer's signals span of importance ratio ``ratio`` added to each of its
    first ``trajectories`` trajectories (lowest ids): trainer-vs-rollout outliers ``mismatch`` flags."""
    ids = pc.unique(table["trajectory_id"]).sort()[:trajectories]
    roots = table.filter(
        pc.and_(pc.is_in(table["trajectory_id"], ids), pc.equal(table["kind"], "trajectory"))
    )
    n = roots.num_rows
    signals = {
        "span_id": _prefixed(roots, "span_id", "5e1a")["span_id"],
        "parent_id": roots["span_id"],
        "name": pa.array(["signals"] * n),
        "kind": pa.array(["signals"] * n),
        "importance_ratio": pa.array([ratio] * n, pa.float64()),
    }
    for name, column in signals.items():
        roots = roots.set_column(roots.column_names.index(name), name, column)
    return pa.concat_tables([table, roots.cast(table.schema)])


def plant_token_change(table: pa.Table, every: int, rollouts: int = 8) -> tuple[pa.Table, int]:
    """``table`` with the first stored token id of the last model call of every ``every``-th
    trajectory (by sample_index * ``rollouts`` + rollout_n) changed; and how many were changed."""
    order = (pc.multiply(table["sample_index"], rollouts).to_numpy() + table["rollout_n"].to_numpy()) % every
    llm = pc.equal(table["kind"], "llm").to_numpy(zero_copy_only=False)
    last: dict[str, int] = {}
    starts = table["start_ns"].to_numpy()
    ids = table["token_ids"].combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy()
    for row, tid in enumerate(table["trajectory_id"].to_pylist()):
        if (
            llm[row]
            and order[row] == 0
            and lengths[row]
            and (tid not in last or starts[row] > starts[last[tid]])
        ):
            last[tid] = row
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy().copy()
    for row in last.values():
        values[offsets[row]] += 1
    changed = pa.LargeListArray.from_arrays(ids.offsets, pa.array(values, pa.int32()))
    return table.set_column(table.column_names.index("token_ids"), "token_ids", changed), len(last)


def write_step(run_dir: Path, table: pa.Table, step: int, tag: str = "synthetic") -> None:
    """One step's spans as sealed span files, one per worker, where the recorder puts them."""
    for worker in sorted(set(table["worker"].to_pylist())):
        folder = partition_dir(run_dir, step, worker)
        folder.mkdir(parents=True, exist_ok=True)
        write_sealed(table.filter(pc.equal(table["worker"], worker)), folder / f"part-{tag}-{step}.parquet")


def write_manifest(run_dir: Path, experiment: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(f'{{"experiment": "{experiment}", "format_version": {FORMAT_VERSION}}}')


def build_run(
    run_dir: Path,
    base: pa.Table,
    steps: int,
    per_step: int,
    sample_stride: int = 1000,
    payload_steps: int | None = None,
    seed: int | None = None,
    collapse: int = 0,
    outliers: int = 0,
) -> int:
    """A run of ``steps`` steps, each ``base``'s spans replicated to about ``per_step`` trajectories;
    payloads kept on the first ``payload_steps`` steps (all by default); ``seed``: rewards drawn per
    trajectory and step (else ``base``'s); ``collapse``: the rollouts of each step's first ``collapse``
    prompts given one reward (``collapsed``); ``outliers``: that many trajectories a step with a far
    importance ratio (``far_ratios``). Returns the trajectories per step."""
    n_base = len(pc.unique(base["trajectory_id"]))
    template = replicate(base, max(1, per_step // n_base), sample_stride).cast(SPAN_SCHEMA)
    bare = without_payloads(template) if payload_steps is not None else template
    rng = np.random.default_rng(seed) if seed is not None else None
    for step in range(steps):
        table = as_step(template if payload_steps is None or step < payload_steps else bare, step)
        if rng is not None:
            table = with_rewards(table, rng)
        if collapse:
            table = collapsed(table, collapse)
        if outliers:
            table = far_ratios(table, outliers)
        write_step(run_dir, table, step)
    write_manifest(run_dir, run_dir.name)
    return len(pc.unique(template["trajectory_id"]))
