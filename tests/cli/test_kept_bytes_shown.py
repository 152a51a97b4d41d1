"""``show`` and the UI print kept bytes (an answer as the proxy keeps it: ``wire``) as their text
when they are UTF-8, saying how many bytes they are; other bytes as the run holds them."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from rlreplay.cli.browse import PREVIEW_CHARS, preview
from rlreplay.format import payload
from rlreplay.ui.views import pretty

RAW = st.one_of(st.text().map(str.encode), st.binary())


def utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@given(RAW)
def test_show_prints_bytes_as_their_text_when_they_are_utf8(raw: bytes) -> None:
    kept = payload.to_jsonable(raw)  # as a span holds them
    assert kept == {"__type__": "bytes", "base64": base64.b64encode(raw).decode()}
    shown, text = preview(kept), utf8(raw)
    if text is None:
        assert shown.startswith('{"__type__":"bytes"')  # as the run holds them
        return
    cut = text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"
    assert shown == f"({len(raw):,} bytes, UTF-8) {cut}"


@given(RAW)
def test_the_ui_prints_bytes_as_their_text_when_they_are_utf8(raw: bytes) -> None:
    output = {"status": 200, "wire": payload.to_jsonable(raw)}
    shown, text = json.loads(pretty(output, limit=10**9)), utf8(raw)
    assert shown["status"] == 200
    if text is None:
        assert shown["wire"] == output["wire"]
    else:
        assert shown["wire"] == f"({len(raw):,} bytes, UTF-8) {text}"


@given(st.binary(), st.binary())
def test_an_ops_own_bytes_shaped_dict_is_shown_and_uploaded_as_the_dict_it_is(
    own_raw: bytes, raw: bytes
) -> None:
    """A tool's own ``{"__type__": "bytes", ...}`` is data (wrapped when recorded), never kept bytes;
    real bytes beside it still read as their text."""
    own = {"__type__": "bytes", "base64": base64.b64encode(own_raw).decode()}
    kept = payload.to_jsonable({"reply": own, "blob": raw})
    assert kept["reply"] == {"__type__": "dict", "value": own}
    text = utf8(raw)
    blob = kept["blob"] if text is None else f"({len(raw):,} bytes, UTF-8) {text}"
    expected = {"reply": kept["reply"], "blob": blob}
    assert payload.readable(kept) == expected  # what upload sends
    assert json.loads(pretty(kept, limit=10**9)) == expected  # what the UI shows
