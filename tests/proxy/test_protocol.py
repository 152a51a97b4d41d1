"""What the proxy reads out of an answer: token ids and log-probs, whatever the upstream put there."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.proxy.protocol import CHAT, COMPLETIONS, GENERATE, answer_of, generated, stream_chunks

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=3),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
IDS = st.one_of(
    st.lists(st.integers(min_value=0, max_value=2**31), max_size=40),
    st.lists(st.one_of(st.integers(min_value=0, max_value=2**31), JSON_VALUES), max_size=40),
    JSON_VALUES,
)


def as_ids(value: Any) -> list | None:
    """What counts as a token id list, said plainly: a list of whole numbers (true/false pass as 1/0)."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


@settings(max_examples=300, deadline=None)
@given(
    prompt=IDS,
    ids=IDS,
    entries=st.lists(st.one_of(JSON_VALUES, st.builds(lambda lp: {"logprob": lp}, JSON_VALUES)), max_size=20),
)
def test_ids_and_log_probs_are_taken_as_they_are_or_not_at_all(
    prompt: Any, ids: Any, entries: list[Any]
) -> None:
    chat = {
        "prompt_token_ids": prompt,
        "choices": [
            {"index": 0, "message": {"role": "assistant"}, "token_ids": ids, "logprobs": {"content": entries}}
        ],
    }
    found = generated(CHAT, {}, chat)
    assert found.prompt_ids == as_ids(prompt)
    assert found.choices[0]["token_ids"] == as_ids(ids)
    assert found.choices[0]["log_probs"] == [e.get("logprob") for e in entries if isinstance(e, dict)]
    completion = {"choices": [{"index": 0, "text": "", "token_ids": ids, "prompt_token_ids": prompt}]}
    found = generated(COMPLETIONS, {}, completion)
    assert (found.prompt_ids, found.choices[0]["token_ids"]) == (as_ids(prompt), as_ids(ids))
    found = generated(GENERATE, {"input_ids": prompt}, {"output_ids": ids, "meta_info": {}})
    assert (found.prompt_ids, found.choices[0]["token_ids"]) == (as_ids(prompt), as_ids(ids))


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.text(max_size=5), max_size=8), whole=st.booleans())
def test_a_streamed_answer_read_on_the_way_says_what_its_bytes_say(pieces: list[str], whole: bool) -> None:
    """The answer a continuing call's prompt is matched against is the same whether the proxy
    hands over the chunks it read on the way or the recorded bytes are read again."""
    if whole:  # an answer that is one JSON object, whatever the chunks handed over say
        message = {"role": "assistant", "content": "".join(pieces)}
        wire = orjson.dumps({"choices": [{"index": 0, "message": message}]})
    else:
        chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
        wire = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    expected = {"role": "assistant", "content": "".join(pieces)}
    record = {"status": 200, "wire": wire}
    assert answer_of(CHAT, record) == expected
    assert answer_of(CHAT, record, stream_chunks(wire)) == expected


def _one_by_one(data: bytes) -> Any:
    """One event's data read on its own: its JSON value, else its text."""
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


_FRAGMENT = st.sampled_from([b"{", b"}", b"[", b"]", b",", b'"a":', b"1", b"{}", b'"x"', b'"},{"'])


@settings(max_examples=300, deadline=None)
@given(
    datas=st.lists(
        st.one_of(
            st.builds(lambda v: json.dumps(v).encode(), st.dictionaries(st.text(max_size=3), st.integers())),
            st.builds(lambda parts: b"{" + b"".join(parts) + b"}", st.lists(_FRAGMENT, max_size=6)),
        ),
        min_size=1,
        max_size=5,
    ),
    done=st.booleans(),
)
def test_a_streams_chunks_are_its_events_each_read_on_its_own(datas: list[bytes], done: bool) -> None:
    """Events that are no JSON value alone stay text, whatever they make when put together (a
    stream of ``{"a":1},{"b":2}``, ``{"c":[{}``, ``{}]}`` is three texts, not three chunks)."""
    events = [*datas, b"[DONE]"] if done else datas
    wire = b"".join(b"data: " + d + b"\n\n" for d in events)
    assert stream_chunks(wire) == [_one_by_one(d) for d in events]


def test_events_that_join_into_json_stay_text() -> None:
    datas = [b'{"a":1},{"b":2}', b'{"c":[{}', b"{}]}"]
    wire = b"".join(b"data: " + d + b"\n\n" for d in datas)
    assert stream_chunks(wire) == [d.decode() for d in datas]
