"""Token arrays (format 2): number lists as typed columns, stretches shared with earlier spans, restored."""

from __future__ import annotations

import bisect
import struct
from typing import Any

import orjson

from rlreplay.format.payload import ESCAPED, MARKER, MIN_ARRAY, MIN_SHARED, TOKENS

#
# A number list of a span's inputs/output goes to a typed column; the JSON keeps a placeholder
# ``{"__type__": "tokens", "t": dtype, "o": offset, "n": stored count, "s": stream position,
# "r": [[span, start, length, at], ...]}``. ``r`` lists stretches copied from earlier spans of the
# same trajectory (their "stream": all their arrays of that dtype, end to end): ``length`` values
# of span ``span`` from ``start`` go at position ``at``; the stored values fill the rest in order.
#
# The writer shares token ids only where a model call continues the trajectory's latest ids: an
# id array that begins with an array of the latest span that held ids (a prompt = the previous
# prompt + response + an observation: verl's agent loop), or goes on where the span's previous
# array stopped in it (the agent's response ids after its prompt), one comparison of int32 arrays
# each; and log-probs that begin with an earlier call's log-probs and go on with the later calls'
# in order, gaps between them allowed (the agent's response log-probs: every turn's, and the tool
# observations' zeros). Nothing is searched for: a call's own new values cost a lookup of their
# first value. Readers resolve any ``r`` (earlier files share stretches found by a general search).

_I8, _I32, _F32 = "i8", "i32", "f32"
#: Placeholder dtype → typed column (see ``rlreplay.format.schema.TOKEN_COLUMNS``).
DTYPE_COLUMNS = {_I32: "token_ids", _I8: "token_masks", _F32: "token_logprobs"}


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
    third of the instructions numpy's conversion takes; ``pack(*values)`` alone unpacks the list
    once, where ``pack_into(buffer, 0, *values)`` copies it twice)."""
    import numpy as np

    try:
        return np.frombuffer(struct.Struct(f"={len(values)}i").pack(*values), dtype=np.int32)
    except struct.error:
        return np.array(values, dtype=np.int32)  # says why: OverflowError


def _float64(values: list | tuple) -> Any:
    """Numbers as a float64 array (``struct`` again: twice as fast as numpy's conversion);
    OverflowError for an int beyond float64, TypeError for anything that is not a number."""
    import numpy as np

    try:
        return np.frombuffer(struct.Struct(f"={len(values)}d").pack(*values), dtype=np.float64)
    except struct.error as exc:
        raise TypeError(str(exc)) from None


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

    ``shared`` (a ``SharedIndex`` of the trajectory, optional) lets an id list store only what the
    trajectory's latest ids do not already hold.
    """

    def __init__(self, shared: Any = None, kinds: dict[int, Any] | None = None) -> None:
        self.kinds = kinds  # from to_payload: number lists already checked (summed, or by ``ints``)
        self.converted: dict[int, tuple[Any, Any]] = {}  # id → (list, its int32 array): ``ints``
        self.parts: dict[str, list[Any]] = {_I32: [], _I8: [], _F32: []}
        self.sizes = dict.fromkeys(self.parts, 0)
        self.id_arrays: list[Any] = []  # the span's id stream: its full id arrays, in order
        self.id_count = 0
        self.float_arrays: list[Any] = []  # the span's float32 arrays (its log-prob stream), in order
        self.float_count = 0
        self.shared = shared
        self._last: tuple[str, int] | None = None  # where the previous id array ended in a shared stream
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

    def ints(self, values: list | tuple) -> type | None:
        """``int`` when every item of ``values`` is an int (or bool) within int32, their array kept
        for ``extract``: a ``numbers`` check for ``payload.to_payload``, which then need not sum
        them; else None."""
        import numpy as np

        if type(values[0]) is not int:
            return None
        try:
            array = np.frombuffer(struct.Struct(f"={len(values)}i").pack(*values), dtype=np.int32)
        except struct.error:  # not an int, or beyond int32
            return None
        self.converted[id(values)] = (values, array)
        return int

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
        """Ints exactly (bools refused), as int8 (masks) or int32 (shared with the latest ids)."""
        import numpy as np

        known = self.converted.get(id(values))
        converted = known[1] if known is not None and known[0] is values else None
        array = None
        if "mask" in key.lower():
            if converted is not None:
                if len(converted) and (converted.min() < -128 or converted.max() > 127):
                    return None  # beyond int8: JSON keeps them
                array = converted.astype(np.int8)
            else:
                array = _small_ints(values)  # 0..127: bytes() converts 3x faster than numpy
                if array is None:
                    array = np.array(values, dtype=np.int8)  # OverflowError beyond int8: JSON then
        if array is None:
            # a value beyond int32: OverflowError (JSON keeps them)
            array = converted if converted is not None else _int32(values)
        # a bool counts as 0 or 1 to sum(), bytes(), struct and numpy; an object that packs as an
        # int (numpy's) may only be 0 or 1 (numpy's bool): only those positions need a look
        small = (array.view(np.uint32 if array.dtype == np.int32 else np.uint8) < 2).nonzero()[0]
        if len(small) > 256:
            if b"e" in orjson.dumps(values):  # true/false; JSON integers have no "e"
                return None
        elif not _types_at(values, small) <= {int}:
            return None
        if array.dtype == np.int8:
            return self._add(_I8, array)
        return self._ids(array)

    def _floats(self, values: list | tuple) -> dict[str, Any] | None:
        """Floats exact in float32 (bit for bit: -0.0, NaN payloads); else None (JSON keeps them)."""
        import numpy as np

        array = _float64(values)
        single = array.astype(np.float32)
        if not np.array_equal(single.astype(np.float64).view(np.int64), array.view(np.int64)):
            return None
        # ints and bools among the floats have whole values: only those positions need a look
        whole = (array == np.trunc(array)).nonzero()[0]
        types = set(map(type, values)) if len(whole) > 256 else _types_at(values, whole)
        if types - {float} and not all(issubclass(t, float) for t in types):
            return None
        found = self.shared.float_cover(single) if self.shared is not None else []
        placeholder = self._add(_F32, _without(single, found) if found else single)
        placeholder["s"] = self.float_count
        if found:
            placeholder["r"] = found
        self.float_arrays.append(single)
        self.float_count += len(single)
        return placeholder

    def _add(self, dtype: str, array: Any) -> dict[str, Any]:
        placeholder = {"__type__": TOKENS, "t": dtype, "o": self.sizes[dtype], "n": len(array)}
        self.parts[dtype].append(array)
        self.sizes[dtype] += len(array)
        self.bytes += array.nbytes
        return placeholder

    def _ids(self, array: Any) -> dict[str, Any]:
        """Store ids (int32) less the stretch at their start that the trajectory's latest ids hold."""
        found: list[list[Any]] = []
        after = None
        if self.shared is not None and len(array) >= MIN_SHARED:
            found, after = self.shared.id_cover(array, self._last)
        placeholder = self._add(_I32, _without(array, found) if found else array)
        placeholder["s"] = self.id_count
        if found:
            placeholder["r"] = found
        self._last = after
        self.id_arrays.append(array)
        self.id_count += len(array)
        return placeholder

    def columns(self) -> tuple[Any, Any, Any]:
        """The span's values per typed column (token_ids, token_masks, token_logprobs): a numpy
        array, or None."""
        import numpy as np

        return tuple(  # type: ignore[return-value]
            parts if parts is None or not isinstance(parts, list) else np.concatenate(parts)
            for parts in self.column_parts()
        )

    def column_parts(self) -> tuple[Any, Any, Any]:
        """As :meth:`columns`, but a column of several arrays is the list of them, to be taken end to
        end (a batch of rows concatenates them once: ``rows.StepBuffer``)."""
        out = []
        for dtype in (_I32, _I8, _F32):
            parts = self.parts[dtype]
            out.append(None if not parts else parts[0] if len(parts) == 1 else parts)
        return tuple(out)  # type: ignore[return-value]


def _without(array: Any, found: list[list[Any]]) -> Any:
    """``array`` less the stretches ``found`` (``[span, start, length, at]``)."""
    import numpy as np

    if len(found) == 1 and found[0][2] == len(array):
        return array[:0]
    keep = np.ones(len(array), dtype=bool)
    for _, _, length, at in found:
        keep[at : at + length] = False
    return array[keep]


class SharedIndex:
    """What later spans of a trajectory may share: its latest id stream (the last span that held
    ids) and its latest log-prob arrays."""

    __slots__ = ("dropped", "float_bytes", "floats", "latest", "starts")
    #: log-prob arrays kept (a model call's each): the turns an agent span's log-probs may repeat
    KEEP_FLOATS = 32

    def __init__(self) -> None:
        # (span, its id arrays (int32), where each begins in its stream, their first ids): our own
        # copies, which no caller can change
        self.latest: tuple[str, list[Any], list[int], list[Any]] | None = None
        # (span, bits of a float32 array, its position in the span's float stream), oldest first
        self.floats: list[tuple[str, Any, int]] = []
        self.dropped = 0  # log-prob arrays let go from the front of ``floats``
        # bits of an array's first value → its place among all arrays kept so far (less ``dropped``:
        # its place in ``floats``; a negative one was let go)
        self.starts: dict[int, int] = {}
        self.float_bytes = 0

    def add(self, span_id: str, arrays: Arrays) -> None:
        """``arrays`` (a span's) become the latest ids, and its log-probs are kept, when they hold
        enough to share."""
        self._add_floats(span_id, arrays)
        if arrays.id_count < MIN_SHARED:
            return
        parts = arrays.id_arrays
        starts, pos = [], 0
        for part in parts:
            starts.append(pos)
            pos += len(part)
        self.latest = (span_id, parts, starts, [int(part[0]) if len(part) else None for part in parts])

    def id_cover(
        self, array: Any, after: tuple[str, int] | None
    ) -> tuple[list[list[Any]], tuple[str, int] | None]:
        """The stretch ``[[span, start, length, 0]]`` of the latest id stream that ``array`` (int32)
        begins with: from where the span's previous array ended in it (``after``), or from one of
        its arrays' starts, the longest, up to the first value that differs; and where it ended,
        when it covers all of ``array``. A first id that matches none costs a list lookup."""
        if self.latest is None:
            return [], None
        span, parts, starts, firsts = self.latest
        first, n = int(array[0]), len(array)
        # (array, offset in it) to compare from: ``after`` first (it wins ties), then array starts
        options = []
        if after is not None and after[0] == span:
            k = bisect.bisect_right(starts, after[1]) - 1
            offset = after[1] - starts[k]
            if offset < len(parts[k]) and int(parts[k][offset]) == first:
                options.append((k, offset))
        options += [(k, 0) for k, value in enumerate(firsts) if value == first]
        best, best_start = 0, 0
        for k, offset in options:
            length = _common(array, parts, k, offset)
            if length > best:
                best, best_start = length, starts[k] + offset
        if best < MIN_SHARED:
            return [], None
        return [[span, best_start, best, 0]], (span, best_start + best) if best == n else None

    def _add_floats(self, span_id: str, arrays: Arrays) -> None:
        import numpy as np

        pos = 0
        floats, starts = self.floats, self.starts
        for array in arrays.float_arrays:
            if len(array) >= MIN_SHARED:
                bits = array.view(np.uint32)
                starts[int(bits[0])] = self.dropped + len(floats)
                floats.append((span_id, bits, pos))
                self.float_bytes += bits.nbytes
            pos += len(array)
        extra = len(floats) - self.KEEP_FLOATS
        if extra > 0:
            for _, bits, _ in floats[:extra]:
                self.float_bytes -= bits.nbytes
            del floats[:extra]
            self.dropped += extra
            if len(starts) > 2 * self.KEEP_FLOATS:  # forget the starts of arrays let go
                self.starts = {k: i for k, i in starts.items() if i >= self.dropped}

    def float_cover(self, array: Any) -> list[list[Any]]:
        """Stretches ``[span, start, length, at]`` of the kept log-prob arrays that ``array`` (float32)
        is made of: it begins with one of them, bit for bit (``-0.0`` is not ``0.0``), and may go on
        with the ones kept after it, in order, each wherever its first value next appears."""
        import numpy as np

        bits = array.view(np.uint32)
        n = len(bits)
        i = self.starts.get(int(bits[0]), -1) - self.dropped if n >= MIN_SHARED else -1
        refs: list[list[Any]] = []
        p = 0
        while 0 <= i < len(self.floats):
            span, kept, start = self.floats[i]
            m = min(len(kept), n - p)
            same = bits[p : p + m] == kept[:m]
            length = m if same.all() else int(same.argmin())
            if length >= MIN_SHARED:
                refs.append([span, start, length, p])
                p += length
            if length < len(kept) or p >= n or i + 1 >= len(self.floats):
                break
            i += 1  # the next kept array, where its first value next appears
            later = (bits[p:] == self.floats[i][1][0]).nonzero()[0]
            if not len(later):
                break
            p += int(later[0])
        return refs

    @property
    def nbytes(self) -> int:
        """The memory it holds: the latest ids and the kept log-probs."""
        latest = self.latest
        return self.float_bytes + (sum(part.nbytes for part in latest[1]) if latest is not None else 0)


def _common(array: Any, parts: list[Any], k: int, offset: int) -> int:
    """How many values from the start of ``array`` equal those of ``parts`` (arrays end to end) from
    ``parts[k][offset]`` on."""
    n, p = len(array), 0
    while k < len(parts) and p < n:
        part = parts[k][offset:]
        m = min(n - p, len(part))
        same = array[p : p + m] == part[:m]
        if not same.all():
            return p + int(same.argmin())
        p += m
        k, offset = k + 1, 0
    return p


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
