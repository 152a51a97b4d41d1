"""Redaction by what a value is, in recorded payloads: credentials are found by their form and
under credential names whatever their type; data is never hidden, however its key is called. Every
entry of the shipped tokenizers' vocabularies survives in every position (as a value under any key,
``token`` included, in lists, in prose, in raw JSON bodies)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import qwen_tokenizer_dir

from rlreplay.format import payload
from rlreplay.format.redact import REDACTED, redact_data, redact_json_bytes, redact_text

ROOT = Path(__file__).resolve().parents[2]
PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n"
    "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n"
    "-----END RSA PRIVATE KEY-----"
)


def _payload(value: Any) -> Any:
    return payload.to_payload(value)[0]


# ---- the reported defects ------------------------------------------------------------------------------


def test_log_prob_token_texts_are_data() -> None:
    logprobs = {
        "content": [
            {"token": "cat", "logprob": -0.25, "top_logprobs": [{"token": "cat", "logprob": -0.25}]},
            {"token": " token", "logprob": -1.5, "top_logprobs": [{"token": "Ġkey", "logprob": -1.5}]},
        ]
    }
    body = {"choices": [{"message": {"content": "the next token: cat"}, "logprobs": logprobs}]}
    assert _payload(body) == body
    assert redact_data(body) is body


def test_prose_about_tokens_and_keys_is_kept() -> None:
    for text in ("the next token: cat", "token: cat, then key: dog", "eos_token: <|im_end|>"):
        assert redact_text(text) == text
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "key": "p0-s0", "token": "Ġthe"}
    assert _payload(config) == config


def test_a_private_key_in_a_tool_output_is_hidden() -> None:
    shown = _payload({"role": "tool", "content": f"$ cat ~/.ssh/id_rsa\n{PEM}\n$ "})["content"]
    assert "MIIE" not in shown and "VTLw" not in shown
    assert shown == (
        f"$ cat ~/.ssh/id_rsa\n-----BEGIN RSA PRIVATE KEY-----{REDACTED}-----END RSA PRIVATE KEY-----\n$ "
    )


@pytest.mark.parametrize(
    "value", [98765432123, 1234.5, ["hunter", 2], {"user": "bob", "pin": 1234}, "hunter2", -7]
)
@pytest.mark.parametrize("name", ["password", "pw", "passwd", "db_password", "api_key", "client_secret"])
def test_a_credential_name_hides_its_value_whatever_its_type(name: str, value: Any) -> None:
    out = _payload({"tool": "login", "arguments": {"user": "bob", name: value}})
    assert out == {"tool": "login", "arguments": {"user": "bob", name: REDACTED}}


def test_credentials_in_tool_argument_text_are_hidden() -> None:
    arguments = json.dumps({"user": "bob", "pw": "hunter2", "password": 98765432123, "n": 3})
    shown = _payload({"name": "login", "arguments": arguments})["arguments"]
    assert json.loads(shown) == {"user": "bob", "pw": REDACTED, "password": REDACTED, "n": 3}


@pytest.mark.parametrize("value", [None, True, False, ""])
def test_a_credential_name_with_nothing_in_it_stays_readable(value: Any) -> None:
    assert _payload({"password": value}) == {"password": value}


# ---- every vocabulary entry survives ----------------------------------------------------------------------


@functools.cache
def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what Qwen3's and SmolLM2's vocabularies are written in), reversed."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@functools.cache
def _vocabulary(name: str) -> list[str]:
    """Every entry of a shipped tokenizer: as the vocabulary writes it, and as text (what a server
    returns as a token's text), with the added tokens."""
    path = (
        qwen_tokenizer_dir() / "tokenizer.json"
        if name == "qwen3"
        else ROOT / f"sample_runs/{name}/tokenizer.json"
    )
    data = json.loads(path.read_text())
    entries = list(data["model"]["vocab"]) + [t["content"] for t in data["added_tokens"]]
    byte_of = _bytes_to_unicode()
    texts = [bytes(byte_of.get(c, 0x3F) for c in e).decode("utf-8", "replace") for e in entries]
    return sorted(set(entries) | set(texts))


VOCABULARIES = ["qwen3", "verl-arith-smollm2"]


@pytest.mark.parametrize("name", VOCABULARIES)
def test_every_vocabulary_entry_survives_alone_and_as_data(name: str) -> None:
    vocab = _vocabulary(name)
    assert len(vocab) > 40_000
    assert [e for e in vocab if redact_text(e) != e] == []
    rows = [{"token": e} for e in vocab]  # other keys and places: the property test below
    assert _payload(rows) == rows
    body = json.dumps({"logprobs": {"content": rows}}).encode()
    assert redact_json_bytes(body) is body
    utf8 = json.dumps({"tokens": vocab}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert redact_json_bytes(utf8) is utf8


_TEMPLATES = [
    "{}",
    "The next token is {} and the one after it is {}.",
    "token: {}\nkey: {}\n",
    "the password is incorrect; {} {}",
    '{{"token": "{}", "key": "{}"}}',
    "Answer key: {} ({})",
    "- {}\n- {}",
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(VOCABULARIES),
    picks=st.tuples(st.integers(0, 10**9), st.integers(0, 10**9)),
    template=st.sampled_from(_TEMPLATES),
    key=st.sampled_from(["token", "key", "text", "content", "secret_word", "max_tokens", "prompt_key", "*"]),
)
def test_vocabulary_entries_survive_in_every_position(
    name: str, picks: tuple[int, int], template: str, key: str
) -> None:
    vocab = _vocabulary(name)
    a, b = (vocab[i % len(vocab)] for i in picks)
    text = template.format(a, b)
    for value in (text, {key: text}, [text, {key: [a, b]}], {"deep": [[{"x": (a, text)}]]}):
        jsonable = payload.to_jsonable(value)
        assert _payload(value) == jsonable, (a, b, text)
        raw = json.dumps(jsonable).encode()
        assert redact_json_bytes(raw) is raw


# ---- credential names hide values of every type, in every position ---------------------------------------

CREDENTIAL_NAMES = [
    "password",
    "pw",
    "passwd",
    "passphrase",
    "db_password",
    "PGPASSWORD",
    "secret",
    "client_secret",
    "api_key",
    "apiKey",
    "X-Api-Key",
    "access_token",
    "refreshToken",
    "hf_token",
    "Authorization",
    "private_key",
    "credentials",
    "Cookie",
    "db_pass",
]
_ANY = st.recursive(
    st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(min_size=1).filter(lambda t: t != REDACTED),
    ),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3), st.dictionaries(st.text(), inner, min_size=1)
    ),
    max_leaves=5,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(CREDENTIAL_NAMES),
    value=_ANY,
    where=st.sampled_from(["value", "nested", "list", "deep", "arguments"]),
)
def test_a_credential_name_hides_any_value_anywhere(name: str, value: Any, where: str) -> None:
    def place(inner: Any) -> Any:
        return {
            "value": inner,
            "nested": {"a": {"b": [1, inner]}},
            "list": [inner, "x"],
            "deep": [[[[{"z": [inner]}]]]],
            "arguments": {"name": "login", "arguments": inner},
        }[where]

    sent = place({name: value, "user": "bob"})
    expected = place({name: REDACTED, "user": "bob"})
    if where == "arguments":  # tool arguments as JSON text, as OpenAI sends them
        sent["arguments"] = json.dumps(sent["arguments"])
        shown = _payload(sent)
        assert json.loads(shown["arguments"]) == expected["arguments"]
        raw = json.dumps(sent).encode()
        assert json.loads(json.loads(redact_json_bytes(raw))["arguments"]) == expected["arguments"]
        return
    assert _payload(sent) == expected
    assert redact_data(sent) == expected
    assert json.loads(redact_json_bytes(json.dumps(sent).encode())) == expected
