"""The trajectory index: one row per trajectory per shard, with partial aggregates that merge.

A sealed shard ``part-X.parquet`` has its index beside it in ``part-X.index`` (Parquet), written
at seal time; for a live file (or a shard without one) it is built from the span metadata on
the fly. ``merge`` combines the rows of one trajectory found in several files (a spilled span, a
``signals`` row from the trainer process); ``listing`` turns merged rows into the trajectory
listing (contract C2). ``summarize`` is ``listing(merge(build(spans)))``: the
status and reward rules live here only. A run of many shards also keeps a run index of merged
rows (``format/run_index.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rlreplay.format import arrow_ops as ops
from rlreplay.format.schema import (
    KEY_STR,
    KEYS,
    KIND_AGENT,
    KIND_LLM,
    KIND_SIGNALS,
    KIND_TOOL,
    KIND_TRAJECTORY,
    SIGNAL_COLUMNS,
    SPAN_SCHEMA,
    STATUS_ERROR,
    STATUS_INCOMPLETE,
    STATUS_OK,
)

INDEX_SUFFIX = ".index"
INDEX_VERSION = (
    b"4"  # 4: llm_tool_calls; 3: tool_errors by rlreplay.format.tool_errors (2: raised calls only)
)
#: Index files of these versions still read, when they hold no tool call (3 changed only tool_errors).
_TOOL_FREE_VERSIONS = (b"2",)
INDEX_KEY = b"rlreplay.index_version"
SHARD_BYTES_KEY = b"rlreplay.shard_bytes"

_KEY_FIELDS = [
    *(pa.field(k, pa.int64()) for k in KEYS),
    *(pa.field(KEY_STR[k], pa.string()) for k in KEYS),
]
INDEX_FIELDS = [
    pa.field("id", pa.string()),
    *_KEY_FIELDS,
    pa.field("validate", pa.bool_()),
    pa.field("experiment", pa.string()),
    pa.field("worker", pa.string()),
    pa.field("num_spans", pa.int64()),
    pa.field("model_calls", pa.int64()),
    pa.field("tool_calls", pa.int64()),
    pa.field("tool_errors", pa.int64()),
    pa.field("llm_tool_calls", pa.int64()),  # the tool calls the model answers hold
    pa.field("start_ns", pa.int64()),
    pa.field("end_ns", pa.int64()),
    pa.field("root_span", pa.string()),
    pa.field("root_name", pa.string()),
    pa.field("root_status", pa.string()),
    pa.field("root_error", pa.string()),
    pa.field("agent", pa.string()),
    pa.field("agent_rank", pa.int64()),
    pa.field("agent_start", pa.int64()),
    pa.field("err", pa.string()),
    pa.field("err_start", pa.int64()),
    pa.field("agent_tok_end", pa.int64()),
    pa.field("agent_prompt_tokens", pa.int64()),
    pa.field("agent_response_tokens", pa.int64()),
    pa.field("llm_start", pa.int64()),
    pa.field("llm_prompt_tokens", pa.int64()),
    pa.field("llm_response_tokens", pa.int64()),
    pa.field("reward_agent", pa.float64()),
    pa.field("reward_agent_end", pa.int64()),
    *(
        f
        for c in SIGNAL_COLUMNS
        for f in (pa.field(f"{c}_sig", pa.float64()), pa.field(f"{c}_sig_end", pa.int64()))
    ),
    pa.field("row_groups", pa.list_(pa.int32())),
]
INDEX_SCHEMA = pa.schema(INDEX_FIELDS, metadata={INDEX_KEY: INDEX_VERSION})

#: The span columns ``build`` reads.
SPAN_COLUMNS = [
    "trajectory_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "status", "error",
    "worker", "experiment", "validate", *KEYS, *KEY_STR.values(), *SIGNAL_COLUMNS,
    "prompt_tokens", "response_tokens",
]  # fmt: skip
#: ``SPAN_COLUMNS`` and the payload column ``build`` also reads when it is given: with it, tool
#: calls recorded before the recorder wrote a reason for a returned failure are judged from their
#: output (``rlreplay.format.tool_errors``).
JUDGED_COLUMNS = [*SPAN_COLUMNS, "output"]

LISTING_FIELDS = [
    pa.field("id", pa.string()),
    *(pa.field(k, pa.int64()) for k in KEYS),
    pa.field("validate", pa.bool_()),
    pa.field("experiment", pa.string()),
    pa.field("worker", pa.string()),
    pa.field("name", pa.string()),
    pa.field("agent", pa.string()),
    pa.field("start_time", pa.float64()),
    pa.field("duration_s", pa.float64()),
    pa.field("num_spans", pa.int64()),
    pa.field("model_calls", pa.int64()),
    pa.field("tool_calls", pa.int64()),
    pa.field("tool_errors", pa.int64()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("response_tokens", pa.int64()),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    *(pa.field(c, pa.float64()) for c in SIGNAL_COLUMNS),
    *(pa.field(KEY_STR[k], pa.string()) for k in KEYS),
]
LISTING_SCHEMA = pa.schema(LISTING_FIELDS)
LISTING_SORT = [(c, "ascending") for k in KEYS for c in (k, KEY_STR[k])] + [
    ("start_time", "ascending"),
    ("id", "ascending"),
]


def index_path(sealed: Path) -> Path:
    return sealed.with_name(sealed.name.removesuffix(".parquet") + INDEX_SUFFIX)


# ---- numpy helpers ---------------------------------------------------------------------------------


def _np(column: Any, fill: Any = None) -> Any:
    if fill is not None:
        column = ops.fill_null(column, fill)
    return column.to_numpy(zero_copy_only=False)


def _pick(group: Any, n: int, mask: Any, key: Any, largest: bool) -> Any:
    """Per group, the row (among ``mask``) with the largest (or smallest) ``key``; -1 where none."""
    out = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(mask)
    if not len(rows):
        return out
    order = rows[np.lexsort((key[rows], group[rows]))]
    g = group[order]
    if largest:
        edge = np.flatnonzero(np.r_[g[1:] != g[:-1], True])
    else:
        edge = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    out[g[edge]] = order[edge]
    return out


def _take(column: Any, rows: Any) -> pa.Array:
    indices = ops.from_numpy(np.where(rows < 0, 0, rows), rows < 0)
    if len(column) == 0:
        return pa.nulls(len(rows), type=column.type)
    return ops.take(column, indices)


def _groups(ids: Any) -> tuple[Any, pa.Array]:
    encoded = ops.dictionary_encode(ids)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks() if encoded.num_chunks != 1 else encoded.chunk(0)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), encoded.dictionary


def _sum(group: Any, n: int, values: Any) -> Any:
    return np.bincount(group, weights=values, minlength=n).astype(np.int64)


def answer_calls(spans: pa.Table) -> Any:
    """Per span row: the tool calls an ``llm`` span's answer makes (``rlreplay.format.tool_errors``;
    0 without the ``output`` column). Only outputs that may name a tool call are decoded."""
    calls = np.zeros(spans.num_rows, dtype=np.int64)
    if "output" not in spans.column_names:
        return calls
    from rlreplay.format import payload
    from rlreplay.format.marks import holds_any
    from rlreplay.format.tool_errors import TOOL_CALL_MARKS, answer_tool_calls

    output = spans["output"]
    named = holds_any(output, TOOL_CALL_MARKS)
    rows = np.flatnonzero((_np(spans["kind"]) == KIND_LLM) & named)
    if len(rows):
        for row, text in zip(rows, ops.take(output, ops.from_numpy(rows)).to_pylist()):
            value, _ = payload.decode_safe(text)
            calls[row] = answer_tool_calls(value)
    return calls


def tool_failed(spans: pa.Table) -> Any:
    """Per span row: a tool call that failed (``rlreplay.format.tool_errors``): it raised, the
    recorder wrote why its result says it failed, or (given the ``output`` column) its output says so."""
    from rlreplay.format import payload
    from rlreplay.format.tool_errors import tool_error

    kind = _np(spans["kind"])
    is_tool = kind == KIND_TOOL
    failed = is_tool & ((_np(spans["status"]) == STATUS_ERROR) | _np(ops.is_valid(spans["error"])))
    if "output" in spans.column_names:
        rows = np.flatnonzero(is_tool & ~failed)
        if len(rows):
            outputs = ops.take(spans["output"], ops.from_numpy(rows)).to_pylist()
            for row, text in zip(rows, outputs):
                value, _ = payload.decode_safe(text)
                failed[row] = tool_error(STATUS_OK, None, value) is not None
    return failed


# ---- build, merge, list ----------------------------------------------------------------------------


def build(spans: pa.Table, row_groups: Sequence[int] | None = None, calls: Any = None) -> pa.Table:
    """Index rows (one per trajectory) of span metadata rows; ``row_groups[i]``: row i's row group;
    ``calls[i]``: row i's ``answer_calls`` (else read from the ``output`` column when given)."""
    if spans.num_rows == 0:
        return INDEX_SCHEMA.empty_table()
    spans = spans.combine_chunks()
    group, ids = _groups(spans["trajectory_id"])
    n = len(ids)
    kind = _np(spans["kind"])
    start = _np(spans["start_ns"])
    end = _np(spans["end_ns"])
    status = _np(spans["status"])
    is_root = _np(ops.is_null(spans["parent_id"]))
    is_signals = kind == KIND_SIGNALS
    is_root = is_root & ~is_signals
    is_llm = kind == KIND_LLM
    is_tool = kind == KIND_TOOL
    errored = status == STATUS_ERROR
    first_row = _pick(group, n, np.ones(len(kind), bool), start, largest=False)
    # a trajectory's time is its own spans': a signals row is written later, by another process
    timed = ~is_signals
    first_timed = _pick(group, n, timed, start, largest=False)
    end_timed = _max_per_group(group, n, np.where(timed, end, _NO_TIME))
    # a trajectory written in parts has a root span each: the first that failed, else the first
    root_row = _pick(group, n, is_root, _failed_first(errored, start), largest=False)
    owner = np.where(root_row >= 0, root_row, first_row)

    root_span = _take(spans["span_id"], root_row)
    root_of_row = _np(ops.take(root_span, ops.from_numpy(group)), "")
    child_of_root = _np(spans["parent_id"], "") == root_of_row
    is_agent = kind == KIND_AGENT
    agent_candidate = is_agent | (child_of_root & ~is_signals)
    agent_rank = np.where(is_agent, 0, 1)
    # order agents by (rank, start): rank in the high part of the key
    agent_key = agent_rank * (1 << 62) + (start - start.min()) if len(start) else start
    agent_row = _pick(group, n, agent_candidate, agent_key, largest=False)
    err_row = _pick(group, n, errored, start, largest=False)

    prompt = spans["prompt_tokens"]
    response = spans["response_tokens"]
    has_prompt = ~_np(ops.is_null(prompt))
    agent_tok_row = _pick(group, n, is_agent & (has_prompt | ~_np(ops.is_null(response))), end, largest=True)
    llm_row = _pick(group, n, is_llm & has_prompt, start, largest=False)
    llm_resp = _np(response, 0)
    has_llm_resp = np.bincount(group, weights=(is_llm & ~_np(ops.is_null(response))), minlength=n) > 0
    llm_resp_sum = _sum(group, n, np.where(is_llm, llm_resp, 0))

    rewarded_kind = (kind == KIND_AGENT) | (kind == KIND_TRAJECTORY)
    reward = spans["reward"]
    has_reward = ~_np(ops.is_null(reward))
    reward_agent_row = _pick(group, n, rewarded_kind & has_reward, end, largest=True)

    columns: dict[str, Any] = {"id": ids}
    for name in (*KEYS, *KEY_STR.values(), "validate", "experiment", "worker"):
        columns[name] = _take(spans[name], owner)
    columns.update(
        num_spans=ops.from_numpy(np.bincount(group, minlength=n).astype(np.int64)),
        model_calls=ops.from_numpy(_sum(group, n, is_llm)),
        tool_calls=ops.from_numpy(_sum(group, n, is_tool)),
        tool_errors=ops.from_numpy(_sum(group, n, tool_failed(spans))),
        llm_tool_calls=ops.from_numpy(_sum(group, n, answer_calls(spans) if calls is None else calls)),
        start_ns=_take(spans["start_ns"], first_timed),
        end_ns=ops.from_numpy(end_timed, end_timed == _NO_TIME),
        root_span=root_span,
        root_name=_take(spans["name"], root_row),
        root_status=_take(spans["status"], root_row),
        root_error=_take(spans["error"], root_row),
        agent=_take(spans["name"], agent_row),
        agent_rank=ops.from_numpy(np.where(agent_row >= 0, agent_rank[np.maximum(agent_row, 0)], 2)),
        agent_start=_take(spans["start_ns"], agent_row),
        err=_take(spans["error"], err_row),
        err_start=_take(spans["start_ns"], err_row),
        agent_tok_end=_take(spans["end_ns"], agent_tok_row),
        agent_prompt_tokens=_take(prompt, agent_tok_row),
        agent_response_tokens=_take(response, agent_tok_row),
        llm_start=_take(spans["start_ns"], llm_row),
        llm_prompt_tokens=_take(prompt, llm_row),
        llm_response_tokens=ops.from_numpy(llm_resp_sum, ~has_llm_resp),
        reward_agent=_take(reward, reward_agent_row),
        reward_agent_end=_take(spans["end_ns"], reward_agent_row),
    )
    for c in SIGNAL_COLUMNS:
        has = is_signals & ~_np(ops.is_null(spans[c]))
        row = _pick(group, n, has, end, largest=True)
        columns[f"{c}_sig"] = _take(spans[c], row)
        columns[f"{c}_sig_end"] = _take(spans["end_ns"], row)
    if row_groups is not None:
        rg = np.asarray(row_groups, dtype=np.int32)
        order = np.lexsort((rg, group))
        g, r = group[order], rg[order]
        keep = np.r_[True, (g[1:] != g[:-1]) | (r[1:] != r[:-1])]
        g, r = g[keep], r[keep]
        offsets = np.r_[0, np.cumsum(np.bincount(g, minlength=n))].astype(np.int32)
        columns["row_groups"] = pa.ListArray.from_arrays(ops.from_numpy(offsets), ops.from_numpy(r))
    else:
        columns["row_groups"] = pa.nulls(n, type=pa.list_(pa.int32()))
    return ops.cast_table(pa.table(columns), INDEX_SCHEMA)


_NO_TIME = np.iinfo(np.int64).min


def _failed_first(failed: Any, start: Any) -> Any:
    """A sort key over rows: failed ones first, each group by start."""
    if not len(start):
        return start
    with np.errstate(over="ignore"):  # rows without a time are never picked
        return np.where(failed, 0, 1 << 62) + (start - start.min())


def _max_per_group(group: Any, n: int, values: Any) -> Any:
    out = np.full(n, _NO_TIME, dtype=np.int64)
    np.maximum.at(out, group, values)
    return out


def merge(rows: pa.Table) -> pa.Table:
    """One index row per trajectory from rows of several files (already-merged rows merge again)."""
    if rows.num_rows == 0:
        return INDEX_SCHEMA.empty_table()
    rows = rows.combine_chunks()
    group, ids = _groups(rows["id"])
    n = len(ids)
    if n == rows.num_rows:
        return rows
    everything = np.ones(rows.num_rows, bool)

    def present(name: str) -> Any:
        return ~_np(ops.is_null(rows[name]))

    def pick(name: str, largest: bool, mask: Any = None) -> Any:
        m = present(name) if mask is None else mask
        return _pick(group, n, m, _np(rows[name], 0), largest)

    has_root = present("root_span")
    starts = _np(rows["start_ns"], np.iinfo(np.int64).max)  # rows of signals alone have no time
    first = _pick(group, n, everything, starts, largest=False)
    root_failed = _np(rows["root_status"], "") == STATUS_ERROR
    root = _pick(group, n, has_root, _failed_first(root_failed, starts), largest=False)
    owner = np.where(root >= 0, root, first)
    agent_key = _np(rows["agent_rank"], 2) * (1 << 62) + (
        _np(rows["agent_start"], 0) - (ops.min(rows["agent_start"]).as_py() or 0)
    )
    agent = _pick(group, n, present("agent"), agent_key, largest=False)
    llm_resp = rows["llm_response_tokens"]
    has_resp = np.bincount(group, weights=present("llm_response_tokens"), minlength=n) > 0
    columns: dict[str, Any] = {"id": ids}
    for name in (*KEYS, *KEY_STR.values(), "validate", "experiment", "worker"):
        columns[name] = _take(rows[name], owner)
    for name in ("num_spans", "model_calls", "tool_calls", "tool_errors", "llm_tool_calls"):
        columns[name] = ops.from_numpy(_sum(group, n, _np(rows[name], 0)))
    columns["start_ns"] = _take(rows["start_ns"], first)
    ends = _max_per_group(group, n, _np(rows["end_ns"], _NO_TIME))
    columns["end_ns"] = ops.from_numpy(ends, ends == _NO_TIME)
    for name in ("root_span", "root_name", "root_status", "root_error"):
        columns[name] = _take(rows[name], root)
    for name in ("agent", "agent_rank", "agent_start"):
        columns[name] = _take(rows[name], agent)
    err = pick("err_start", largest=False, mask=present("err_start"))
    columns["err"], columns["err_start"] = _take(rows["err"], err), _take(rows["err_start"], err)
    tok = pick("agent_tok_end", largest=True)
    for name in ("agent_tok_end", "agent_prompt_tokens", "agent_response_tokens"):
        columns[name] = _take(rows[name], tok)
    llm = pick("llm_start", largest=False)
    columns["llm_start"], columns["llm_prompt_tokens"] = (
        _take(rows["llm_start"], llm),
        _take(rows["llm_prompt_tokens"], llm),
    )
    columns["llm_response_tokens"] = ops.from_numpy(_sum(group, n, _np(llm_resp, 0)), ~has_resp)
    ra = pick("reward_agent_end", largest=True)
    columns["reward_agent"], columns["reward_agent_end"] = (
        _take(rows["reward_agent"], ra),
        _take(rows["reward_agent_end"], ra),
    )
    for c in SIGNAL_COLUMNS:
        r = pick(f"{c}_sig_end", largest=True)
        columns[f"{c}_sig"], columns[f"{c}_sig_end"] = (
            _take(rows[f"{c}_sig"], r),
            _take(rows[f"{c}_sig_end"], r),
        )
    columns["row_groups"] = pa.nulls(n, type=pa.list_(pa.int32()))
    return ops.cast_table(pa.table(columns), INDEX_SCHEMA)


def listing(index: pa.Table) -> pa.Table:
    """The trajectory listing (contract C2) of merged index rows, sorted by keys and start."""
    if index.num_rows == 0:
        return LISTING_SCHEMA.empty_table()
    has_root = _np(ops.is_valid(index["root_span"]))
    root_error = _np(index["root_status"], "") == STATUS_ERROR
    status_of = pa.array([STATUS_OK, STATUS_ERROR, STATUS_INCOMPLETE])
    status = ops.take(status_of, ops.from_numpy(np.where(~has_root, 2, np.where(root_error, 1, 0))))
    error = ops.if_else(
        ops.from_numpy(root_error),
        index["root_error"],
        ops.if_else(ops.from_numpy(~has_root), index["err"], None),
    )
    has_agent_tokens = _np(ops.is_valid(index["agent_tok_end"]))
    prompt = ops.if_else(
        ops.from_numpy(has_agent_tokens), index["agent_prompt_tokens"], index["llm_prompt_tokens"]
    )
    response = ops.if_else(
        ops.from_numpy(has_agent_tokens), index["agent_response_tokens"], index["llm_response_tokens"]
    )
    reward = ops.coalesce(index["reward_sig"], index["reward_agent"])
    start = _np(index["start_ns"], 0)
    columns = {
        "id": index["id"],
        **{k: index[k] for k in KEYS},
        "validate": index["validate"],
        "experiment": index["experiment"],
        "worker": index["worker"],
        "name": index["root_name"],
        "agent": index["agent"],
        "start_time": ops.from_numpy(start / 1e9),
        "duration_s": ops.from_numpy(
            (_np(ops.coalesce(index["end_ns"], index["start_ns"]), 0) - start) / 1e9
        ),
        "num_spans": index["num_spans"],
        "model_calls": index["model_calls"],
        # the model's tool calls (rlreplay.format.tool_errors): its answers', or its tool spans where more
        "tool_calls": ops.from_numpy(
            np.maximum(_np(index["tool_calls"], 0), _np(ops.fill_null(index["llm_tool_calls"], 0), 0))
        ),
        "tool_errors": index["tool_errors"],
        "prompt_tokens": prompt,
        "response_tokens": response,
        "status": status,
        "error": error,
        "reward": reward,
        **{c: index[f"{c}_sig"] for c in SIGNAL_COLUMNS[1:]},
        **{KEY_STR[k]: index[KEY_STR[k]] for k in KEYS},
    }
    return ops.sort_by(ops.cast_table(pa.table(columns), LISTING_SCHEMA), LISTING_SORT)


def read(path: Path, shard_bytes: int) -> pa.Table | None:
    """A sealed shard's index file, or None when it is missing, unreadable, or not of this shard
    as it is now (``shard_bytes``): then the caller rebuilds it from the shard."""
    from rlreplay.format.checksums import CheckedParquet

    try:
        with CheckedParquet(path) as pf:  # its checksums verified (a damaged one is rebuilt)
            schema = pf.schema_arrow  # checked before any row is read
            metadata = schema.metadata or {}
            version = metadata.get(INDEX_KEY)
            if version not in (INDEX_VERSION, *_TOOL_FREE_VERSIONS) or schema.names != INDEX_SCHEMA.names:
                return None
            if metadata.get(SHARD_BYTES_KEY) != str(shard_bytes).encode():
                return None
            # threads cost more than they save on a small file
            table = ops.cast_table(pf.read(use_threads=False), INDEX_SCHEMA)
        if version != INDEX_VERSION and (ops.sum(table["tool_calls"]).as_py() or 0):
            return None  # its tool_errors counted raised calls only: rebuilt from the shard
        return table
    except (OSError, pa.ArrowException, ValueError):
        return None


def write(index: pa.Table, path: Path, shard_bytes: int) -> None:
    """Write the index of a shard of ``shard_bytes`` bytes durably (temp name, fsync, rename)."""
    import os

    from rlreplay.format import checksums

    tmp = path.with_name("_" + path.name + ".tmp")
    metadata = {**INDEX_SCHEMA.metadata, SHARD_BYTES_KEY: str(shard_bytes).encode()}
    checksums.write_table(
        index.replace_schema_metadata(metadata),
        tmp,
        durable=True,
        compression="zstd",
        use_dictionary=False,
        write_statistics=False,
    )
    os.rename(tmp, path)


def merge_into(merged: pa.Table, more: Sequence[pa.Table]) -> pa.Table:
    """``merge`` of merged rows and more rows: only the merged rows sharing an id with ``more``
    merge again."""
    extra = [t for t in more if t.num_rows]
    if not extra:
        return merged
    added = pa.concat_tables(extra)
    if merged.num_rows == 0:
        return merge(added)
    hit = ops.is_in(merged["id"], ops.unique(added["id"]))
    again = merge(pa.concat_tables([ops.filter(merged, hit), added]))
    return pa.concat_tables([ops.filter(merged, ops.invert(hit)), again])


def summarize(spans: pa.Table) -> pa.Table:
    """The trajectory listing (contract C2) from span metadata rows: the rules above."""
    if spans.num_rows == 0:
        return LISTING_SCHEMA.empty_table()
    missing = [c for c in SPAN_COLUMNS if c not in spans.column_names]
    if missing:
        for name in missing:
            spans = spans.append_column(
                SPAN_SCHEMA.field(name), pa.nulls(spans.num_rows, SPAN_SCHEMA.field(name).type)
            )
    return listing(
        merge(build(spans.select(JUDGED_COLUMNS if "output" in spans.column_names else SPAN_COLUMNS)))
    )


STR_KEYS = tuple(KEY_STR[key] for key in KEYS)


def merged(table: pa.Table) -> pa.Table:
    """The listing as users see it: one value per key (ints stay ints; a key holding any non-int
    value becomes a string column), without the internal ``*_str`` columns."""
    out = table
    for key, str_key in zip(KEYS, STR_KEYS):
        if str_key not in out.column_names:
            continue
        strings = out[str_key]
        if key in out.column_names and strings.null_count < len(strings):
            value = ops.coalesce(ops.cast(out[key], pa.string()), strings)
            out = out.set_column(out.column_names.index(key), key, value)
        out = out.drop_columns([str_key])
    return out
