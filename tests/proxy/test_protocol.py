"""What the proxy reads out of an answer: token ids and log-probs, whatever the upstream put there."""

from __future__ import annotations

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
