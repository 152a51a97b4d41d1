"""``show`` prints kept bytes (an answer as the proxy keeps it: ``wire``) as their text when they
are UTF-8, saying how many bytes they are; other bytes as the run holds them."""

from __future__ import annotations

import base64

from hypothesis import given
from hypothesis import strategies as st

from rlreplay.cli.browse import PREVIEW_CHARS, preview
from rlreplay.format import payload


@given(st.one_of(st.text().map(str.encode), st.binary()))
def test_bytes_show_as_their_text_when_they_are_utf8(raw: bytes) -> None:
    kept = payload.to_jsonable(raw)  # as a span holds them
    assert kept == {"__type__": "bytes", "base64": base64.b64encode(raw).decode()}
    shown = preview(kept)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        assert shown.startswith('{"__type__":"bytes"')  # as the run holds them
        return
    head = f"({len(raw):,} bytes, UTF-8) "
    assert shown.startswith(head)
    rest = shown[len(head) :]
    assert rest == (text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…")
