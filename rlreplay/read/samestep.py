"""Whether paired trajectories of two runs are equal as stored, column by column over one step's rows.

Two trajectories are equal as stored when, spans taken in order of start time (then name), signals
rows aside, each pair of spans has the same name, kind, error, parent (by position), typed token
values (bit for bit), the same inputs and output JSON (``payload.same``: bit for bit) and output
type records (a tuple is not a list) once the keys ``ignored`` drop out and the spans that shared
stretches refer to are named by position instead of by id. Reading restores
values from exactly these, so trajectories equal as stored read back equal; the converse need not
hold (a caller compares the others span by span). Token log-probs holding a NaN are never equal
here: a NaN read back is not equal to itself.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlreplay.format import arrow_ops as ops
from rlreplay.format.payload import OUTPUT_TYPE, TOKENS, first_type_difference, same
from rlreplay.format.schema import KIND_SIGNALS, TOKEN_COLUMNS
from rlreplay.read.scan import POSITION, StepSpans


class _Unsure(Exception):
    """A payload this comparison cannot judge (unreadable, a reference to an unknown span)."""


def equal_as_stored(a: StepSpans, b: StepSpans, ignored: frozenset[str]) -> Any:
    """Per pair ``(a.ids[i], b.ids[i])``: True when the two are equal as stored (numpy bools)."""
    import numpy as np

    n = len(a.ids)
    ta, tb = a.table, b.table
    pos_a, pos_b = _positions(ta), _positions(tb)
    plain_a, plain_b = _not_signals(ta), _not_signals(tb)
    count_a = np.bincount(pos_a[plain_a], minlength=n)
    count_b = np.bincount(pos_b[plain_b], minlength=n)
    candidate = (count_a == count_b) & (count_a > 0)
    if not candidate.any():
        return candidate
    # rows of the candidates pair up one to one: the k-th span of a pair in A with the k-th in B
    rows_a = np.flatnonzero(plain_a & candidate[pos_a])
    rows_b = np.flatnonzero(plain_b & candidate[pos_b])
    small_a = ops.take(ta.select(["name", "kind", "error"]), ops.from_numpy(rows_a))
    small_b = ops.take(tb.select(["name", "kind", "error"]), ops.from_numpy(rows_b))
    ok = np.ones(len(rows_a), dtype=bool)
    for name in ("name", "kind"):
        ok &= ops.equal(small_a[name], small_b[name]).to_numpy(zero_copy_only=False)
    ok &= _same_or_both_null(small_a["error"], small_b["error"])
    for name in TOKEN_COLUMNS:
        if name in ta.column_names:
            ok &= _lists_equal(ta[name], rows_a, tb[name], rows_b, name == "token_logprobs")
    position = pos_a[rows_a]
    ok &= _payloads_equal(ta, rows_a, tb, rows_b, position, ok, ignored)
    ok &= _output_types_equal(ta, rows_a, tb, rows_b, ok, ignored)
    bad = np.bincount(position[~ok], minlength=n)
    return candidate & (bad == 0)


def _positions(table: Any) -> Any:
    import numpy as np

    return table[POSITION].to_numpy() if table.num_rows else np.zeros(0, np.int64)


def _not_signals(table: Any) -> Any:
    """The rows compared: all but signals rows."""
    return ops.invert(ops.equal(table["kind"], KIND_SIGNALS)).to_numpy(zero_copy_only=False)


def _same_or_both_null(a: Any, b: Any) -> Any:
    both_null = ops.and_(ops.is_null(a), ops.is_null(b)).to_numpy(zero_copy_only=False)
    return ops.fill_null(ops.equal(a, b), False).to_numpy(zero_copy_only=False) | both_null


def _lists_equal(a: Any, rows_a: Any, b: Any, rows_b: Any, floats: bool) -> Any:
    """Row by row (rows ``rows_a`` of list column ``a`` against ``rows_b`` of ``b``): the same
    values (floats: the same bits, and no NaN); a null list only equals a null list."""
    import numpy as np

    a, b = a.combine_chunks(), b.combine_chunks()
    off_a, off_b = a.offsets.to_numpy(), b.offsets.to_numpy()
    start_a, start_b = off_a[rows_a], off_b[rows_b]
    len_a, len_b = off_a[rows_a + 1] - start_a, off_b[rows_b + 1] - start_b
    ok = len_a == len_b
    if a.null_count or b.null_count:
        ok &= (
            a.is_null().to_numpy(zero_copy_only=False)[rows_a]
            == b.is_null().to_numpy(zero_copy_only=False)[rows_b]
        )
    rows = np.flatnonzero(ok & (len_a > 0))
    if not len(rows):
        return ok
    lengths = len_a[rows]
    # every value of those rows, gathered: its row, and where it sits in each side's values
    row_of = np.repeat(np.arange(len(rows)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    values_a = a.values.to_numpy(zero_copy_only=False)[start_a[rows][row_of] + within]
    values_b = b.values.to_numpy(zero_copy_only=False)[start_b[rows][row_of] + within]
    ok[rows[np.unique(row_of[_differ(values_a, values_b, floats)])]] = False
    return ok


def _differ(a: Any, b: Any, floats: bool) -> Any:
    """Where two value arrays differ (floats: by their bits, and wherever a NaN is)."""
    import numpy as np

    if floats:
        return (a.view(np.int32) != b.view(np.int32)) | np.isnan(a)
    return a != b


def _ordinals(table: Any, rows: Any, position: Any) -> dict[tuple[int, str], int]:
    """(pair, span id) → the span's place among its pair's rows (``rows`` of ``table``)."""
    import numpy as np

    starts = np.r_[0, np.flatnonzero(position[1:] != position[:-1]) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, len(position)]))
    place = (np.arange(len(position)) - first).tolist()
    span_ids = ops.take(table["span_id"], ops.from_numpy(rows)).to_pylist()
    return dict(zip(zip(position.tolist(), span_ids), place))


def _payloads_equal(
    ta: Any, rows_a: Any, tb: Any, rows_b: Any, position: Any, ok: Any, ignored: frozenset[str]
) -> Any:
    """Row by row: parents and inputs/output JSON equal, span references read as positions."""
    import numpy as np

    places_a, places_b = _ordinals(ta, rows_a, position), _ordinals(tb, rows_b, position)
    pairs = position.tolist()
    parents_a = ops.take(ta["parent_id"], ops.from_numpy(rows_a)).to_pylist()
    parents_b = ops.take(tb["parent_id"], ops.from_numpy(rows_b)).to_pylist()
    parent_a = [places_a.get((p, s), -1) for p, s in zip(pairs, parents_a)]
    parent_b = [places_b.get((p, s), -1) for p, s in zip(pairs, parents_b)]
    out = ok & (np.array(parent_a, dtype=np.int64) == np.array(parent_b, dtype=np.int64))
    for name in ("inputs", "output"):
        text_a = ops.take(ta[name], ops.from_numpy(rows_a))
        text_b = ops.take(tb[name], ops.from_numpy(rows_b))
        same_text = _same_or_both_null(text_a, text_b)
        refers = _holds(text_a, '"r":') | _holds(text_b, '"r":')
        refers |= _holds(text_a, '"truncated"')  # one without its SHA-256 is never the same
        look = np.flatnonzero(out & (refers | ~same_text))
        if not len(look):
            continue
        values_a = ops.take(text_a, ops.from_numpy(look)).to_pylist()
        values_b = ops.take(text_b, ops.from_numpy(look)).to_pylist()
        for row, va, vb in zip(look.tolist(), values_a, values_b):
            pair = pairs[row]
            try:
                equal = same(_canonical(va, places_a, pair, ignored), _canonical(vb, places_b, pair, ignored))
            except _Unsure:
                equal = False
            out[row] = equal
    return out


def _output_types_equal(ta: Any, rows_a: Any, tb: Any, rows_b: Any, ok: Any, ignored: frozenset[str]) -> Any:
    """Row by row: the outputs' type records agree (``payload.first_type_difference``: a tuple is
    not a list), where the attributes that hold them differ as stored."""
    import numpy as np

    text_a = ops.take(ta["attributes"], ops.from_numpy(rows_a))
    text_b = ops.take(tb["attributes"], ops.from_numpy(rows_b))
    out = ok.copy()
    look = np.flatnonzero(out & ~_same_or_both_null(text_a, text_b))
    if not len(look):
        return out
    values_a = ops.take(text_a, ops.from_numpy(look)).to_pylist()
    values_b = ops.take(text_b, ops.from_numpy(look)).to_pylist()
    for row, va, vb in zip(look.tolist(), values_a, values_b):
        out[row] = first_type_difference(_output_type(va), _output_type(vb), ignored) is None
    return out


def _output_type(attributes: str | None) -> Any:
    """The output's type record in a span's attributes (None: none, or unreadable)."""
    try:
        value = orjson.loads(attributes) if attributes is not None else None
    except orjson.JSONDecodeError:
        return None
    record = value.get(OUTPUT_TYPE) if type(value) is dict else None
    return record if type(record) is dict else None


def _holds(texts: Any, part: str) -> Any:
    return ops.fill_null(ops.match_substring(texts, part), False).to_numpy(zero_copy_only=False)


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
