"""The events of a whole SSE answer: the usual stream (one data line an event) is split at once,
and that gives what reading it event by event gives."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlreplay.format.wire import _event_by_event, stream_datas

PIECES = st.sampled_from(
    [b"data: ", b"data:", b"\n\n", b"\n", b"\r\n", b"\r", b"{}", b"x", b" ", b": c", b"event: e"]
)


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(PIECES, max_size=20), usual=st.lists(st.binary(max_size=6), max_size=5))
@example(pieces=[], usual=[b"a\n", b"b"])  # a data line broken in two
@example(pieces=[], usual=[b"", b""])
def test_a_stream_split_at_once_has_the_events_read_one_by_one(
    pieces: list[bytes], usual: list[bytes]
) -> None:
    odd = b"".join(pieces)
    common = b"".join(b"data: " + d + b"\n\n" for d in usual)
    for raw in (odd, common, common + odd, odd + common):
        assert stream_datas(raw) == _event_by_event(raw)
