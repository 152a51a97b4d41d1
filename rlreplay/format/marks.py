"""Which of a few substrings (marks) some bytes hold, in one Aho-Corasick pass over them
(ahocorasick-rs): the cheap test that redaction and the tool-call count run before reading a
value closely. Marks are plain substrings; the bytes may be any buffer (an Arrow column's, in
place: :func:`holds_any`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


@functools.cache
def _automata(marks: tuple[str, ...]) -> tuple[Any, Any]:
    import ahocorasick_rs

    patterns = [mark.encode() for mark in marks]
    first = ahocorasick_rs.BytesAhoCorasick(patterns, matchkind=ahocorasick_rs.MatchKind.LeftmostFirst)
    every = ahocorasick_rs.BytesAhoCorasick(patterns)
    return first.find_matches_as_indexes, every.find_matches_as_indexes


@functools.cache
def _leftmost_longest(patterns: tuple[str, ...]) -> Any:
    import ahocorasick_rs

    found = [pattern.encode() for pattern in patterns]
    return ahocorasick_rs.BytesAhoCorasick(found, matchkind=ahocorasick_rs.MatchKind.LeftmostLongest)


def any_outside(marks: tuple[str, ...], members: tuple[str, ...]) -> Callable[[Any], bool]:
    """A test of some bytes: whether they hold any of ``marks`` outside ``members`` (longer
    strings that may hold marks; in one pass, a member that begins before a mark, or with it and
    longer, is found instead of it)."""
    find = _leftmost_longest(marks + members).find_matches_as_indexes
    count = len(marks)
    return lambda data: any(i < count for i, _, _ in find(data))


def any_finder(marks: tuple[str, ...]) -> Callable[[Any], bool]:
    """A test of some bytes: whether they hold any of ``marks``."""
    first, _ = _automata(marks)
    return lambda data: bool(first(data))


def held(data: Any, marks: tuple[str, ...]) -> set[str]:
    """The marks that ``data`` holds, each wherever it is (marks that overlap too)."""
    first, every = _automata(marks)
    if not first(data):  # the common case, at the pass's fastest
        return set()
    return {marks[i] for i in {i for i, _, _ in every(data, overlapping=True)}}


def holds_any(strings: Any, marks: tuple[str, ...]) -> Any:
    """A numpy bool per string (of a string, large string or binary array, chunked or not): whether
    it holds any of ``marks`` (plain substrings; false where null). One Aho-Corasick pass over each
    value's bytes in place, no copy: for a few marks it outruns a regular expression of them."""
    import numpy as np
    import pyarrow as pa

    find = any_finder(tuple(marks))
    chunks = strings.chunks if isinstance(strings, pa.ChunkedArray) else [strings]
    out = np.zeros(len(strings), dtype=bool)
    row = 0
    for chunk in chunks:
        if not len(chunk):
            continue
        _, offsets, data = chunk.buffers()
        wide = pa.types.is_large_string(chunk.type) or pa.types.is_large_binary(chunk.type)
        bounds = np.frombuffer(offsets, np.int64 if wide else np.int32)[
            chunk.offset : chunk.offset + len(chunk) + 1
        ]
        values = memoryview(data).cast("B") if data is not None else memoryview(b"")
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        for i, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            out[row + i] = bool(valid[i]) and find(values[start:end])
        row += len(chunk)
    return out
