"""Whether paired trajectories of two runs are equal as stored, column by column over one step's rows.

Two trajectories are equal as stored when, spans taken in order of start time (then name), signals
rows aside, each pair of spans has the same name, kind, error, parent (by position), typed token
values (bit for bit) and the same inputs and output JSON once the keys ``ignored`` drop out and the
spans that shared stretches refer to are named by position instead of by id. Reading restores
values from exactly these, so trajectories equal as stored read back equal; the converse need not
hold (a caller compares the others span by span). Token log-probs holding a NaN are never equal
here: a NaN read back is not equal to itself.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlreplay.format import arrow_ops as ops
from rlreplay.format.payload import TOKENS
from rlreplay.format.schema import KIND_SIGNALS, TOKEN_COLUMNS
from rlreplay.read.scan import POSITION, StepSpans


class _Unsure(Exception):
    """A payload this comparison cannot judge (unreadable, a reference to an unknown span)."""


def equal_as_stored(a: StepSpans, b: StepSpans, ignored: frozenset[str]) -> Any:
    """Per pair ``(a.ids[i], b.ids[i])``: True when the two are equal as stored (numpy bools)."""
    import numpy as np

    n = len(a.ids)
    ta, tb = _plain(a.table), _plain(b.table)
    count_a = np.bincount(ta[POSITION].to_numpy(), minlength=n) if ta.num_rows else np.zeros(n, np.int64)
    count_b = np.bincount(tb[POSITION].to_numpy(), minlength=n) if tb.num_rows else np.zeros(n, np.int64)
    candidate = (count_a == count_b) & (count_a > 0)
    if not candidate.any():
        return candidate
    ta = ops.filter(ta, ops.from_numpy(candidate[ta[POSITION].to_numpy()])).combine_chunks()
    tb = ops.filter(tb, ops.from_numpy(candidate[tb[POSITION].to_numpy()])).combine_chunks()
    # rows now pair up one to one: the k-th span of a pair in A with the k-th in B
    position = ta[POSITION].to_numpy()
    ok = np.ones(ta.num_rows, dtype=bool)
    for name in ("name", "kind"):
        ok &= ops.equal(ta[name], tb[name]).to_numpy(zero_copy_only=False)
    ok &= _same_or_both_null(ta["error"], tb["error"])
    for name in TOKEN_COLUMNS:
        if name in ta.column_names:
            ok &= _lists_equal(ta[name], tb[name], name == "token_logprobs")
    ok &= _payloads_equal(ta, tb, position, ok, ignored)
    bad = np.bincount(position[~ok], minlength=n)
    return candidate & (bad == 0)


def _plain(table: Any) -> Any:
    """The rows compared: all but signals rows."""
    return ops.filter(table, ops.invert(ops.equal(table["kind"], KIND_SIGNALS)))


def _same_or_both_null(a: Any, b: Any) -> Any:
    both_null = ops.and_(ops.is_null(a), ops.is_null(b)).to_numpy(zero_copy_only=False)
    return ops.fill_null(ops.equal(a, b), False).to_numpy(zero_copy_only=False) | both_null


def _lists_equal(a: Any, b: Any, floats: bool) -> Any:
    """Row by row: the two list values hold the same values (floats: the same bits, no NaN)."""
    import numpy as np

    a, b = a.combine_chunks(), b.combine_chunks()
    len_a = ops.fill_null(ops.list_value_length(a), -1).to_numpy(zero_copy_only=False)
    len_b = ops.fill_null(ops.list_value_length(b), -1).to_numpy(zero_copy_only=False)
    ok = len_a == len_b
    rows = np.flatnonzero(ok & (len_a > 0))
    if not len(rows):
        return ok
    lengths = len_a[rows].astype(np.int64)
    # every value of those rows, gathered: its row, and where it sits in each side's values
    row_of = np.repeat(np.arange(len(rows)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    at_a = a.offsets.to_numpy()[rows][row_of] + within
    at_b = b.offsets.to_numpy()[rows][row_of] + within
    values_a = a.values.to_numpy(zero_copy_only=False)[at_a]
    values_b = b.values.to_numpy(zero_copy_only=False)[at_b]
    if floats:
        differ = (values_a.view(np.int32) != values_b.view(np.int32)) | np.isnan(values_a)
    else:
        differ = values_a != values_b
    ok[rows[np.unique(row_of[differ])]] = False
    return ok


def _ordinals(table: Any, position: Any) -> dict[tuple[int, str], int]:
    """(pair, span id) → the span's place among its pair's rows."""
    import numpy as np

    starts = np.r_[0, np.flatnonzero(position[1:] != position[:-1]) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, len(position)]))
    place = (np.arange(len(position)) - first).tolist()
    return dict(zip(zip(position.tolist(), table["span_id"].to_pylist()), place))


def _payloads_equal(ta: Any, tb: Any, position: Any, ok: Any, ignored: frozenset[str]) -> Any:
    """Row by row: parents and inputs/output JSON equal, span references read as positions."""
    import numpy as np

    places_a, places_b = _ordinals(ta, position), _ordinals(tb, position)
    pairs = position.tolist()
    parent_a = [places_a.get((p, s), -1) for p, s in zip(pairs, ta["parent_id"].to_pylist())]
    parent_b = [places_b.get((p, s), -1) for p, s in zip(pairs, tb["parent_id"].to_pylist())]
    out = ok & (np.array(parent_a, dtype=np.int64) == np.array(parent_b, dtype=np.int64))
    for name in ("inputs", "output"):
        text_a, text_b = ta[name], tb[name]
        same_text = _same_or_both_null(text_a, text_b)
        refers = ops.fill_null(ops.match_substring(text_a, '"r":'), False).to_numpy(zero_copy_only=False)
        refers |= ops.fill_null(ops.match_substring(text_b, '"r":'), False).to_numpy(zero_copy_only=False)
        look = np.flatnonzero(out & (refers | ~same_text))
        if not len(look):
            continue
        values_a = ops.take(text_a, ops.from_numpy(look)).to_pylist()
        values_b = ops.take(text_b, ops.from_numpy(look)).to_pylist()
        for row, va, vb in zip(look.tolist(), values_a, values_b):
            pair = pairs[row]
            try:
                equal = _canonical(va, places_a, pair, ignored) == _canonical(vb, places_b, pair, ignored)
            except _Unsure:
                equal = False
            out[row] = equal
    return out


def _canonical(
    text: str | None, places: dict[tuple[int, str], int], pair: int, ignored: frozenset[str]
) -> Any:
    if text is None:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise _Unsure from None
    return _walk(value, places, pair, ignored)


def _walk(value: Any, places: dict[tuple[int, str], int], pair: int, ignored: frozenset[str]) -> Any:
    cls = type(value)
    if cls is dict:
        if value.get("__type__") == TOKENS:
            refs = value.get("r")
            if not refs:
                return value
            if isinstance(refs[0], str):  # early format 2: one stretch, [span, start, length]
                refs = [refs]
            named = []
            for ref in refs:
                place = places.get((pair, ref[0])) if isinstance(ref, list) and ref else None
                if place is None:
                    raise _Unsure
                named.append([place, *ref[1:]])
            return {**value, "r": named}
        out = {}
        for key, item in value.items():
            item = _walk(item, places, pair, ignored)
            if key in ignored and not _holds_tokens(item):
                continue
            out[key] = item
        return out
    if cls is list:
        return [_walk(item, places, pair, ignored) for item in value]
    return value


def _holds_tokens(value: Any) -> bool:
    """Whether a typed-array placeholder sits in ``value`` (dropping it would shift a stream)."""
    if isinstance(value, dict):
        return value.get("__type__") == TOKENS or any(_holds_tokens(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_tokens(v) for v in value)
    return False
