"""Token arrays (format 2): number lists as typed columns, stretches shared with earlier spans, restored."""

from __future__ import annotations

import contextlib
import struct
from typing import Any, ClassVar

import orjson

from rlreplay.format.payload import ESCAPED, MARKER, MAX_PROBES, MIN_ARRAY, MIN_SHARED, TOKENS

#
# A number list of a span's inputs/output goes to a typed column; the JSON keeps a placeholder
# ``{"__type__": "tokens", "t": dtype, "o": offset, "n": stored count, "s": stream position,
# "r": [[span, start, length, at], ...]}``. ``r`` lists stretches copied from earlier spans of the
# same trajectory (their "stream": all their arrays of that dtype, end to end): ``length`` values
# of span ``span`` from ``start`` go at position ``at``; the stored values fill the rest in order.
# That is how a model call's prompt (the previous prompt + response + an observation) and the
# agent's response ids and log-probs (every turn's) are kept once.

_I8, _I32, _F32 = "i8", "i32", "f32"
#: Placeholder dtype → typed column (see ``rlreplay.format.schema.TOKEN_COLUMNS``).
DTYPE_COLUMNS = {_I32: "token_ids", _I8: "token_masks", _F32: "token_logprobs"}
_SHARED = (_I32, _F32)  # dtypes whose stretches are shared between spans


_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def _small_ints(values: list | tuple) -> Any:
    """``values`` as int8 when every one is an int (or bool) from 0 to 127, else None."""
    import numpy as np

    try:
        array = np.frombuffer(bytes(values), dtype=np.int8)
    except (TypeError, ValueError):
        return None
    return array if len(array) and array.min() >= 0 else None


def _int32(values: list | tuple) -> Any:
    """Ints as an int32 array; OverflowError for one beyond int32 (``struct`` packs them with a
    third of the instructions numpy's conversion takes)."""
    import numpy as np

    out = np.empty(len(values), dtype=np.int32)
    try:
        struct.pack_into(f"={len(values)}i", out, 0, *values)
    except struct.error:
        return np.array(values, dtype=np.int32)  # says why: OverflowError
    return out


def _types_at(values: list | tuple, positions: Any) -> set[type]:
    """The types of ``values`` at ``positions`` (a numpy index array), gathered at C speed."""
    import operator

    if not len(positions):
        return set()
    if len(positions) == 1:
        return {type(values[int(positions[0])])}
    return set(map(type, operator.itemgetter(*positions.tolist())(values)))


class Arrays:
    """Collects a span's number lists as typed arrays, leaving placeholders in its JSON.

    ``shared`` (a ``SharedIndex`` of the trajectory, optional) lets a list store only what earlier
    spans of the trajectory do not already hold.
    """

    def __init__(self, shared: Any = None, kinds: dict[int, Any] | None = None) -> None:
        self.kinds = kinds  # from to_jsonable: number lists already summed
        self.parts: dict[str, list[Any]] = {_I32: [], _I8: [], _F32: []}
        self.sizes = dict.fromkeys(self.parts, 0)
        self.streams: dict[str, list[Any]] = {_I32: [], _F32: []}  # full arrays, in order
        self.stream_len = dict.fromkeys(self.streams, 0)
        self.lists: list[Any] = []  # the id lists as given, parallel to streams[_I32]
        self.shared = shared
        self._last: tuple[str, int] | None = None  # where the previous array's last stretch ended
        self.bytes = 0

    def extract(self, data: Any, key: str = "") -> Any:
        cls = type(data)
        if cls is dict:
            return {k: self.extract(v, k if type(k) is str else "") for k, v in data.items()}
        if cls is list or cls is tuple:
            if len(data) >= MIN_ARRAY:
                placeholder = self._take(key, data)
                if placeholder is not None:
                    return placeholder
            if any(type(v) in (dict, list, tuple) for v in data):
                return [self.extract(v, key) for v in data]
        return data

    def _take(self, key: str, values: list | tuple) -> dict[str, Any] | None:
        # sum() tells, at C speed, int lists (ints and bools) from float lists (floats, maybe ints,
        # bools) and refuses anything else (strings, None, containers)
        known = self.kinds.get(id(values)) if self.kinds else None
        if known is not None and known[0] is values:
            kind = known[1]
        else:
            try:
                kind = type(sum(values))
            except Exception:
                return None
        try:
            if kind is int:
                return self._ints(key, values)
            if kind is float:
                return self._floats(values)
        except (OverflowError, ValueError, TypeError):
            pass
        return None

    def _ints(self, key: str, values: list | tuple) -> dict[str, Any] | None:
        """Ints exactly (bools refused), as int8 (masks) or int32 (shared with earlier spans)."""
        import numpy as np

        mask = "mask" in key.lower()
        found: list[list[Any]] = []
        after = self._last
        if not mask and self.shared is not None and type(values) is list and len(values) >= MIN_SHARED:
            found, after = self.shared.list_cover(values, self._last)  # no conversion of what repeats
        array = _small_ints(values) if mask else None  # 0..127: bytes() converts 3x faster than numpy
        if array is None and mask:
            with contextlib.suppress(OverflowError):
                array = np.array(values, dtype=np.int8)
        if array is None:  # numpy refuses a value beyond int32 (OverflowError): JSON keeps them
            array = self._int32(values, found)
        # a bool counts as 0 or 1 to sum() and numpy: only those positions need a look
        small = np.flatnonzero(array.view(np.uint32 if array.dtype == np.int32 else np.uint8) < 2)
        if len(small) > 256:
            if b"e" in orjson.dumps(values):  # true/false; JSON integers have no "e"
                return None
        elif bool in _types_at(values, small):
            return None
        if array.dtype == np.int8:
            return self._add(_I8, array)
        return self._shared(_I32, array, values, found, after)

    def _int32(self, values: list | tuple, found: list[list[Any]]) -> Any:
        """``values`` as int32: the stretches ``found`` in the latest id stream copied from it, only
        the rest converted."""
        import numpy as np

        if not found:
            return _int32(values)
        stream = self.shared.latest[2]
        pieces, pos = [], 0
        for _, start, length, at in found:
            if at > pos:
                pieces.append(_int32(values[pos:at]))
            pieces.append(stream[start : start + length])
            pos = at + length
        if pos < len(values):
            pieces.append(_int32(values[pos:]))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _floats(self, values: list | tuple) -> dict[str, Any] | None:
        """Floats exact in float32 (bit for bit: -0.0, NaN payloads); else None (JSON keeps them)."""
        import numpy as np

        array = np.array(values, dtype=np.float64)
        single = array.astype(np.float32)
        if not np.array_equal(single.astype(np.float64).view(np.int64), array.view(np.int64)):
            return None
        # ints and bools among the floats have whole values: only those positions need a look
        whole = np.flatnonzero(array == np.trunc(array))
        types = set(map(type, values)) if len(whole) > 256 else _types_at(values, whole)
        if types - {float} and not all(issubclass(t, float) for t in types):
            return None
        return self._shared(_F32, single)

    def _add(self, dtype: str, array: Any) -> dict[str, Any]:
        placeholder = {"__type__": TOKENS, "t": dtype, "o": self.sizes[dtype], "n": len(array)}
        self.parts[dtype].append(array)
        self.sizes[dtype] += len(array)
        self.bytes += array.nbytes
        return placeholder

    def _shared(
        self,
        dtype: str,
        array: Any,
        values: Any = None,
        found: list[list[Any]] | None = None,
        after: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Store ``array`` less the stretches earlier spans hold; ``found``: stretches
        ``[span, start, length, at]`` already found on the values as given (``list_cover``), and
        ``after`` where the last of them ended; the gaps between them are searched as arrays."""
        import numpy as np

        refs: list[list[Any]] = []
        if found:
            state, pos = self._last, 0
            for ref in found:
                refs += self._cover_gap(dtype, array, pos, ref[3], state)
                refs.append(ref)
                pos = ref[3] + ref[2]
                state = (ref[0], ref[1] + ref[2])
            self._last = state
            refs += self._cover_gap(dtype, array, pos, len(array), after)
        else:
            refs = self._cover_gap(dtype, array, 0, len(array), self._last)
        stored = array
        if len(refs) == 1 and refs[0][2] == len(array):
            stored = array[:0]
        elif refs:
            keep = np.ones(len(array), dtype=bool)
            for _, _, length, at in refs:
                keep[at : at + length] = False
            stored = array[keep]
        placeholder = self._add(dtype, stored)
        placeholder["s"] = self.stream_len[dtype]
        if refs:
            placeholder["r"] = refs
        self.streams[dtype].append(array)
        self.stream_len[dtype] += len(array)
        if dtype == _I32:
            self.lists.append(values if type(values) is list else None)
        return placeholder

    def _cover_gap(
        self, dtype: str, array: Any, begin: int, end: int, after: tuple[str, int] | None
    ) -> list[list[Any]]:
        """Stretches of earlier streams that make up parts of ``array[begin:end]`` (``after``: where
        the stretch before it ended); sets where the last one ended."""
        if end <= begin:
            self._last = after
            return []
        if self.shared is None or end - begin < MIN_SHARED:
            self._last = None  # a gap too short to share: the next stretch cannot continue one
            return []
        part = array[begin:end] if begin or end < len(array) else array
        more, self._last = self.shared.cover(dtype, part, after)
        return [[span, start, length, at + begin] for span, start, length, at in more]

    def columns(self) -> tuple[Any, Any, Any]:
        """The span's values per typed column (token_ids, token_masks, token_logprobs)."""
        import numpy as np

        out = []
        for dtype in (_I32, _I8, _F32):
            parts = self.parts[dtype]
            if not parts:
                out.append(None)
            else:
                out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return tuple(out)  # type: ignore[return-value]


class SharedIndex:
    """The id and log-prob streams of a trajectory's latest spans, to share stretches with."""

    __slots__ = ("by_first", "latest", "streams")
    #: streams kept per dtype: an id stream holds the ones before it; log-probs are per call
    KEEP: ClassVar[dict[str, int]] = {_I32: 6, _F32: 32}

    def __init__(self) -> None:
        # (span, values, [(start key, start)]) of the latest streams per dtype, oldest first
        self.streams: dict[str, list[tuple[str, Any, list[tuple[int, int]]]]] = {_I32: [], _F32: []}
        # per dtype: the bits of the first two values of each kept array → (span, stream bits, start);
        # values are compared as bits (-0.0 is not 0.0), two at a time (one common id starts many)
        self.by_first: dict[str, dict[int, list[tuple[str, Any, int]]]] = {_I32: {}, _F32: {}}
        # the latest id stream as given (span, one list of its ids, stream, where its arrays begin):
        # the next model call's prompt usually repeats stretches of it, which list comparisons find
        # before any conversion
        self.latest: tuple[str, list[int], Any, list[int]] | None = None

    def add(self, span_id: str, arrays: Arrays) -> None:
        import numpy as np

        for dtype, parts in arrays.streams.items():
            if not parts or arrays.stream_len[dtype] < MIN_SHARED:
                continue
            stream = parts[0] if len(parts) == 1 else np.concatenate(parts)
            starts, pos = [], 0
            for part in parts:
                starts.append(pos)
                pos += len(part)
            kept = self.streams[dtype]
            keys = _start_keys(stream, starts)
            kept.append((span_id, stream, keys))
            by_first = self.by_first[dtype]
            for old_span, _, old_keys in kept[: -self.KEEP[dtype]]:  # no longer kept: forget its starts
                for key, _ in old_keys:
                    left = [e for e in by_first.get(key, ()) if e[0] != old_span]
                    if left:
                        by_first[key] = left
                    else:
                        by_first.pop(key, None)
            del kept[: -self.KEEP[dtype]]
            bits = stream.view(np.uint32)
            for key, start in keys:
                by_first.setdefault(key, []).append((span_id, bits, start))
            if dtype == _I32:  # a copy: a caller may change a list it gave after the call returns
                lists = arrays.lists
                self.latest = None
                if None not in lists:
                    flat: list[int] = []
                    for part in lists:
                        flat += part
                    self.latest = (span_id, flat, stream, starts)

    def list_cover(
        self, values: list, after: tuple[str, int] | None
    ) -> tuple[list[list[Any]], tuple[str, int] | None]:
        """Stretches ``[span, start, length, at]`` of the latest id stream that make up parts of
        ``values`` (greedy, longest first at each position, as ``cover``), and where the last one
        ended; found by comparing lists (C speed, no conversion) from the stream's array starts and
        from ``after`` (where the span's previous array ended in it)."""
        if self.latest is None:
            return [], after
        span, flat, _, starts = self.latest
        size, n = len(flat), len(values)
        by_first: dict[int, list[int]] = {}
        for start in starts:
            if size - start >= MIN_SHARED:
                by_first.setdefault(flat[start], []).append(start)
        cont = after[1] if after is not None and after[0] == span else None
        refs: list[list[Any]] = []
        p, probes = 0, 0
        while n - p >= MIN_SHARED and probes < MAX_PROBES:
            probes += 1
            options = by_first.get(values[p], [])
            if cont is not None and cont not in options:
                options = [*options, cont]
            best, best_start = 0, 0
            for start in reversed(options):  # ``after`` first, then the latest array: they win ties
                m = min(n - p, size - start)
                if m < MIN_SHARED or best >= m:
                    continue
                length = _common(values, p, flat, start, m)
                if length > best:
                    best, best_start = length, start
            if best >= MIN_SHARED:
                refs.append([span, best_start, best, p])
                p += best
                cont = best_start + best
                after = (span, cont)
                continue
            cont, after = None, None
            limit = n - MIN_SHARED + 1  # the next position where one of its arrays begins
            for first in by_first:
                with contextlib.suppress(ValueError):
                    limit = values.index(first, p + 1, limit)
            if limit > n - MIN_SHARED:
                break
            p = limit
        return refs, after

    @property
    def nbytes(self) -> int:
        # the kept lists: an 8-byte pointer per item, and the int itself when the caller has let
        # go of it (counted always: a bound, not a guess)
        lists = 40 * len(self.latest[1]) if self.latest is not None else 0
        return lists + sum(s[1].nbytes for kept in self.streams.values() for s in kept)

    def cover(
        self, dtype: str, array: Any, after: tuple[str, int] | None
    ) -> tuple[list[list[Any]], tuple[str, int] | None]:
        """Stretches ``[span, start, length, at]`` of earlier streams that make up parts of ``array``
        (greedy, longest first at each position), and where the last one ended."""
        import numpy as np

        kept = self.streams[dtype]
        if not kept:
            return [], None
        by_first = self.by_first[dtype]
        bits = array.view(np.uint32)
        maybe = None  # where an earlier array may begin again (computed at the first miss)
        by_span = {span_id: stream.view(np.uint32) for span_id, stream, _ in kept}
        refs: list[list[Any]] = []
        n, p, probes = len(array), 0, 0
        while p < n - 1 and probes < MAX_PROBES:
            probes += 1
            options = list(by_first.get((int(bits[p]) << 32) | int(bits[p + 1]), ()))
            if after is not None and after[0] in by_span:
                options.append((after[0], by_span[after[0]], after[1]))
            best: tuple[str, int, int] | None = None
            for span_id, stream, start in reversed(options):  # the latest first: it wins ties
                m = min(n - p, len(stream) - start)
                if m < MIN_SHARED or (bits[p : p + MIN_SHARED] != stream[start : start + MIN_SHARED]).any():
                    continue
                same = bits[p : p + m] == stream[start : start + m]
                length = m if same.all() else int(same.argmin())
                if best is None or length > best[2]:
                    best = (span_id, start, length)
                    if length == n - p:
                        break  # all the rest of the array: none can do better
            if best is not None:
                refs.append([best[0], best[1], best[2], p])
                after = (best[0], best[1] + best[2])
                p += best[2]
                continue
            after = None
            if maybe is None:
                maybe = _positions_of(bits, by_first)
            i = int(np.searchsorted(maybe, p + 1))
            if i >= len(maybe):
                break
            p = int(maybe[i])
        return refs, after


def _start_keys(stream: Any, starts: list[int]) -> list[tuple[int, int]]:
    """The ``by_first`` key (bits of its first two values) of each start that has ``MIN_SHARED``
    values after it (a few starts: read one by one, cheaper than numpy's fancy indexing)."""
    import numpy as np

    bits = stream.view(np.uint32)
    n = len(stream)
    keys = []
    for start in starts:
        if n - start >= MIN_SHARED:
            first, second = bits[start : start + 2].tolist()
            keys.append(((first << 32) | second, start))
    return keys


def _positions_of(bits: Any, keys: Any) -> Any:
    """Positions in ``bits`` where a pair of values in ``keys`` begins: first the positions of their
    first values (a few: one comparison pass each, which beats ``np.isin``'s sort), then the pairs."""
    import numpy as np

    firsts = {key >> 32 for key in keys}
    head = bits[:-1]
    if len(firsts) > 16:
        found = np.isin(head, np.fromiter(firsts, dtype=np.uint32, count=len(firsts)))
    else:
        found = np.zeros(len(head), dtype=bool)
        for first in firsts:
            found |= head == first
    at = found.nonzero()[0]
    if len(at) > 64:
        pairs = (bits[at].astype(np.uint64) << np.uint64(32)) | bits[at + 1]
        return at[np.isin(pairs, np.fromiter(keys, dtype=np.uint64, count=len(keys)))]
    # a few candidates (the usual case): a set lookup each, no sort
    seconds = bits[at + 1].tolist()
    return np.array(
        [
            a
            for a, first, second in zip(at.tolist(), bits[at].tolist(), seconds)
            if (first << 32 | second) in keys
        ],
        dtype=np.int64,
    )


def _common(values: list, at: int, other: list, start: int, m: int) -> int:
    """How many of ``values[at:at + m]`` equal ``other[start:start + m]`` from the first on (slices
    compared at C speed; a binary search for where they first differ)."""
    if values[at] != other[start]:
        return 0
    mine = values if not at and m == len(values) else values[at : at + m]  # no copy of a whole list
    theirs = other if not start and m == len(other) else other[start : start + m]
    if mine == theirs:
        return m
    lo, hi = 0, m  # the first lo are equal; the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if values[at + lo : at + mid] == other[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


_NESTED = frozenset((dict, list))


def _wrapped(data: dict[str, Any], kind: Any) -> dict[str, Any] | None:
    """The op's own dict inside an ``{"__type__": "dict", "value": {...}}`` wrapper, else None."""
    if kind != ESCAPED:
        return None
    inner = data.get("value")
    return inner if type(inner) is dict else None


class Restorer:
    """Puts typed arrays back where a span's JSON has placeholders; resolves shared stretches."""

    def __init__(self, resolve: Any) -> None:
        self.resolve = resolve  # (span id, dtype) → that span's full stream (numpy), or None
        self.issues: list[str] = []

    def restore(self, data: Any, columns: dict[str, Any]) -> Any:
        cls = type(data)
        if cls is dict:
            kind = data.get(MARKER)
            if kind == TOKENS and "t" in data:
                return self._placeholder(data, columns)
            inner = _wrapped(data, kind)
            if inner is not None:  # an op's own dict with a "__type__" key: its values only
                return {**data, "value": {k: self.restore(v, columns) for k, v in inner.items()}}
            return {k: self.restore(v, columns) for k, v in data.items()}
        if cls is list:
            if _NESTED.isdisjoint(map(type, data)):  # numbers or strings only: nothing to restore
                return data
            return [self.restore(v, columns) for v in data]
        return data

    def _placeholder(self, placeholder: dict[str, Any], columns: dict[str, Any]) -> Any:
        full = self._array(placeholder, columns)
        return full.tolist() if not isinstance(full, dict) else full

    def _array(self, placeholder: dict[str, Any], columns: dict[str, Any]) -> Any:
        import numpy as np

        try:
            dtype = placeholder["t"]
            values = columns[DTYPE_COLUMNS[dtype]]
            start, n = int(placeholder["o"]), int(placeholder["n"])
            if values is None or start < 0 or start + n > len(values):
                raise ValueError("values out of range")
            stored = values[start : start + n]
            refs = placeholder.get("r")
            if not refs:
                return stored
            if isinstance(refs[0], str):  # early format 2 files: one prefix, [span, start, length]
                refs = [[refs[0], refs[1], refs[2], 0]]
            total = n + sum(int(r[2]) for r in refs)
            out = np.empty(total, dtype=stored.dtype)
            keep = np.ones(total, dtype=bool)
            for span, rstart, length, at in refs:
                rstart, length, at = int(rstart), int(length), int(at)
                stream = self.resolve(span, dtype)
                if stream is None or rstart + length > len(stream) or at + length > total:
                    raise ValueError(f"shared values of span {span} missing")
                out[at : at + length] = stream[rstart : rstart + length]
                keep[at : at + length] = False
            if int(keep.sum()) != n:
                raise ValueError("stored values do not fit")
            out[keep] = stored
            return out
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            why = f"unreadable token array ({exc})"
            self.issues.append(why)
            return {"__type__": "error", "error": why}

    def stream(self, data: Any, columns: dict[str, Any], dtype: str) -> list[tuple[int, Any]]:
        """(stream position, full values) of every ``dtype`` array placeholder in ``data``."""
        out: list[tuple[int, Any]] = []
        self._walk(data, columns, dtype, out)
        return out

    def span_stream(self, inputs: Any, output: Any, columns: dict[str, Any], dtype: str) -> Any:
        """A span's whole ``dtype`` stream (its inputs' and output's arrays in stream order), or
        None when it holds no such array."""
        import numpy as np

        found = self.stream(inputs, columns, dtype) + self.stream(output, columns, dtype)
        found.sort(key=lambda p: p[0])
        return np.concatenate([a for _, a in found]) if found else None

    def _walk(self, data: Any, columns: dict[str, Any], dtype: str, out: list[tuple[int, Any]]) -> None:
        cls = type(data)
        if cls is dict:
            kind = data.get(MARKER)
            if kind == TOKENS:
                if data.get("t") == dtype and "s" in data:
                    full = self._array(data, columns)
                    if not isinstance(full, dict):
                        out.append((int(data["s"]), full))
                return
            inner = _wrapped(data, kind)
            for v in (inner if inner is not None else data).values():
                self._walk(v, columns, dtype, out)
        elif cls is list:
            for v in data:
                self._walk(v, columns, dtype, out)


class IdRestorer(Restorer):
    """A ``Restorer`` for token ids alone: id arrays come back as numpy int32 arrays, placeholders
    of other arrays (masks, log-probs) stay as they are."""

    def _placeholder(self, placeholder: dict[str, Any], columns: dict[str, Any]) -> Any:
        return self._array(placeholder, columns) if placeholder["t"] == _I32 else placeholder
