"""``redact_json_bytes``: a body as it went over the wire comes back as the same object when it
holds no credential, else with exactly its credentials replaced by ``***`` and every other byte
kept. Property tests: arbitrary JSON (big ints, NaN, lone surrogates, any escapes, deep nesting)
with secrets embedded anywhere; expected bodies are built beside the real ones, never by
redacting."""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlreplay.format import redact
from rlreplay.format.redact import (
    _BARE_NAMES,
    _FORM_MARKS,
    _NAME_MARKS,
    REDACTED,
    credential_name,
    redact_json_bytes,
)

#: Words and phrases that are data, however much they look like names of secrets.
DATA_WORDS = [
    "token",
    "tokens",
    "key",
    "keys",
    "***",
    "eos_token",
    "max_tokens",
    "token_ids",
    "prompt_token_ids",
    "prompt_key",
    "pass",
    "passed",
    "bypass",
    "secret_word",
    "author",
    "passage",
    "top_logprobs",
    "the next token: cat",
    "token: 5",
    "Answer key: B",
    "key: value",
    "the password is incorrect",
    "basic arithmetic",
    "Basic Instructions",
    "Bearer bonds",
    "sk-learn",
    "hf_hub",
    "AKIA",
    "commit 0123456789abcdef0123456789abcdef01234567 fixed it",
    "f47ac10b-58cc-4372-a567-0e02b2c3d479",
    "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "call_9pw1qnYScqvGrCH58HiCvDXM",
    "toolu_01A09q90qw90lq917835lq9",
    "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
    "Qwen/Qwen3-0.6B",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "https://example.com/docs?page=2&token_type=bearer",
    "user@example.com",
    "ssh -p 2222 gpu-node",
    "x = a == b; y := 3",
    "getUserAccountSettingsHandler",
    "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600",
    "\ud83d",
    "C:\\Users\\bob\\key.txt",
    'line\none\ttab "quoted" back\\slash',
]
_SAFE_TEXT = st.one_of(
    st.sampled_from(DATA_WORDS),
    st.lists(st.sampled_from(DATA_WORDS), min_size=1, max_size=4).map(" ".join),
    st.text(st.characters(categories=["Lo", "Ll", "Nd", "Zs"]), max_size=12),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=False),
    _SAFE_TEXT,
)
#: JSON without a credential (keys are data words too).
SAFE_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(DATA_WORDS), inner, max_size=4)
    ),
    max_leaves=12,
)

#: A secret's own characters.
_RANDOM = st.text(string.ascii_letters + string.digits, min_size=12, max_size=24).map(
    lambda s: "Zq9" + s + "x7K"
)
_CLASSES = (string.ascii_uppercase, string.ascii_lowercase, string.digits)


@st.composite
def _random_token(draw: st.DrawFn) -> str:
    """A token as key generators make them: uppercase, lowercase and digits in short runs (one or
    two characters of a class, then another class), 24 to 100 characters."""
    out: list[str] = []
    kind = draw(st.integers(0, 2))
    while len(out) < draw(st.integers(24, 100)):
        kind = (kind + draw(st.integers(1, 2))) % 3
        out += draw(st.lists(st.sampled_from(_CLASSES[kind]), min_size=1, max_size=2))
    return "".join(out)


def _forms(s: str, token: str = "Zq9aB3cD4eF5gH6iJ7kL8mN9") -> list[tuple[str, str]]:
    """(text holding a credential, the same text as it must come back)."""
    pem_body = "\n".join(["MIIEow" + s * 3, s[::-1] * 2 + "AB/+="])
    return [
        ("ghp_" + s.rjust(36, "x"), REDACTED),
        ("github_pat_" + s.rjust(30, "x"), REDACTED),
        ("AKIA" + s.upper().rjust(16, "X")[-16:], REDACTED),
        ("sk-" + s.rjust(40, "x"), REDACTED),
        ("sk-proj-" + s.rjust(40, "x"), REDACTED),
        ("hf_" + s.rjust(34, "x"), REDACTED),
        ("glpat-" + s.rjust(20, "x"), REDACTED),
        ("xoxb-1234567890-" + s, REDACTED),
        ("AIza" + s.rjust(35, "x")[-35:], REDACTED),
        (f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOi{s[::-1]}.{s}", REDACTED),
        (token, REDACTED),  # a random token, no prefix
        (f"the output was {token}.", f"the output was {REDACTED}."),
        (f"my key is {'sk-' + s.rjust(40, 'x')}, keep it", f"my key is {REDACTED}, keep it"),
        (f"password: {s}", f"password: {REDACTED}"),
        (f"export PGPASSWORD={s}", f"export PGPASSWORD={REDACTED}"),
        (f"the api key is '{s}'", f"the api key is '{REDACTED}'"),
        (f'db = connect(password="{s}")', f'db = connect(password="{REDACTED}")'),
        (f"Authorization: Bearer {s}", f"Authorization: {REDACTED}"),
        (f"curl -H 'Authorization: Basic {s}'", f"curl -H 'Authorization: {REDACTED}'"),
        (f"cloned https://bob:{s}@git.example/repo.git", f"cloned https://{REDACTED}@git.example/repo.git"),
        (
            f"see https://api.example/v1?x=1&access_token={s}",
            f"see https://api.example/v1?x=1&access_token={REDACTED}",
        ),
        (f"Cookie: session={s}; theme=dark", f"Cookie: {REDACTED}"),
        (
            f"-----BEGIN RSA PRIVATE KEY-----\n{pem_body}\n-----END RSA PRIVATE KEY-----\n",
            f"-----BEGIN RSA PRIVATE KEY-----{REDACTED}-----END RSA PRIVATE KEY-----\n",
        ),
        (
            f"-----BEGIN OPENSSH PRIVATE KEY-----\n{pem_body}\n-----END OPENSSH PRIVATE KEY-----",
            f"-----BEGIN OPENSSH PRIVATE KEY-----{REDACTED}-----END OPENSSH PRIVATE KEY-----",
        ),
    ]


N_FORMS = len(_forms("x" * 15))
CREDENTIAL_NAMES = [
    "password",
    "pw",
    "passwd",
    "db_password",
    "PGPASSWORD",
    "api_key",
    "apiKey",
    "X-Api-Key",
    "secret",
    "client_secret",
    "access_token",
    "accessToken",
    "refresh_token",
    "hf_token",
    "Authorization",
    "private_key",
    "credentials",
    "Cookie",
]
#: Values a credential name hides whatever their type; null, booleans and "" hold nothing.
_ANY_VALUE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    _SAFE_TEXT.filter(lambda text: text not in ("", REDACTED)),
    st.lists(_SCALARS, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(DATA_WORDS), _SCALARS, min_size=1, max_size=3),
)


class Secret:
    """A place in a generated value where a credential stands: rendered as sent or as expected."""

    def __init__(self, sent: Any, shown: Any) -> None:
        self.sent, self.shown = sent, shown

    def __repr__(self) -> str:
        return f"Secret({self.sent!r}, {self.shown!r})"


def _render(value: Any, sent: bool) -> Any:
    if isinstance(value, Secret):
        return value.sent if sent else value.shown
    if isinstance(value, list):
        return [_render(v, sent) for v in value]
    if isinstance(value, dict):
        return {k: _render(v, sent) for k, v in value.items()}
    if isinstance(value, Tool):
        return json.dumps(_render(value.arguments, sent))
    return value


class Tool:
    """Tool-call arguments: JSON text inside a JSON string (as OpenAI sends them)."""

    def __init__(self, arguments: Any) -> None:
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"Tool({self.arguments!r})"


@st.composite
def _secret(draw: st.DrawFn) -> Any:
    s = draw(_RANDOM)
    kind = draw(st.sampled_from(["form", "named", "prose"]))
    if kind == "named":
        name = draw(st.sampled_from(CREDENTIAL_NAMES))
        return {name: Secret(draw(_ANY_VALUE), REDACTED)}
    sent, shown = _forms(s, draw(_random_token()))[draw(st.integers(0, N_FORMS - 1))]
    if kind == "prose":
        before, after = draw(_SAFE_TEXT), draw(_SAFE_TEXT)
        return Secret(f"{before}\n{sent}\n{after}", f"{before}\n{shown}\n{after}")
    return Secret(sent, shown)


@st.composite
def _with_secrets(draw: st.DrawFn) -> Any:
    """A JSON value with one to three secrets at random places: a dict value under any key, a list
    item, inside prose, under a credential name, inside tool arguments, deep."""
    value = draw(SAFE_JSON)
    for _ in range(draw(st.integers(1, 3))):
        secret = draw(_secret())
        where = draw(st.sampled_from(["value", "item", "tool", "deep"]))
        if where == "value":
            secret = {draw(st.sampled_from(DATA_WORDS)): secret}
        elif where == "item":
            secret = [draw(_SCALARS), secret]
        elif where == "tool":
            secret = {"function": {"name": "run", "arguments": Tool({"cmd": "ls", "x": secret})}}
        else:
            for _ in range(draw(st.integers(5, 40))):
                secret = [secret] if draw(st.booleans()) else {"a": secret}
        value = {"payload": value, "more": secret}
    return value


def _dumps(value: Any, style: int) -> bytes:
    """The wire form of ``value`` in one of several encodings: compact or spaced, ASCII-escaped or
    UTF-8 (lone surrogates passed through as their bytes), slashes escaped (PHP), a letter escaped
    as ``\\u006b`` everywhere in strings (so ``sk-`` is spelt ``s\\u006b-``)."""
    ascii_only = style % 2 == 0
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if style % 3 else (", ", ": "))
    if style == 4:
        text = text.replace("/", "\\/")
    if style == 6:
        text = text.replace("k", "\\u006b")  # no JSON literal has a k
    return text.encode("utf-8", "surrogatepass")


_STYLES = st.integers(0, 7)
_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _padded(value: Any, long: bool) -> Any:
    """``value``, or ``value`` beside prose long enough that its marks are looked for in one pass."""
    return {"notes": " ".join(["the tokens of a long answer"] * 120), "value": value} if long else value


@_SETTINGS
@given(value=SAFE_JSON, style=_STYLES, long=st.booleans())
def test_a_body_without_credentials_comes_back_as_it_is(value: Any, style: int, long: bool) -> None:
    raw = _dumps(_padded(value, long), style)
    assert redact_json_bytes(raw) is raw


@_SETTINGS
@given(value=_with_secrets(), style=_STYLES, long=st.booleans())
def test_exactly_the_credentials_are_replaced(value: Any, style: int, long: bool) -> None:
    value = _padded(value, long)
    sent, expected = _dumps(_render(value, True), style), _dumps(_render(value, False), style)
    assert sent != expected
    assert redact_json_bytes(sent) == expected


_PIECES = st.sampled_from(
    [
        *_NAME_MARKS,
        *_FORM_MARKS,
        *(bare for bare, _ in _BARE_NAMES),
        *("secretoken", "basicookie", "passecret"),  # marks that share letters
        *("password=hunter2x ", "pw: s3cr3t-v4lue ", '"api_key": "k3y-v4lu3-000111" ', "is "),
        *("auth_token: t0k3n-v4lue ", "client_secret = zzz999aaa ", "Cookie: sid=abc123 ", "cred="),
        *("Bearer abcdefghijk123 ", "Basic dXNlcjpwYXNz ", "https://user:pw@host/x?token=abc "),
        "-----BEGIN PRIVATE KEY-----\nMIIBVQIBADANBg\n-----END PRIVATE KEY-----\n",
        *("AKIAIOSFODNN7EXAMPLE ", "x", " ", "\n", '"', ":", "=", "é", "\ud83d", "\u4e00"),
    ]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_PIECES, max_size=40), filler=st.integers(2048, 2600))
@example(pieces=["secretoken", "=", "x"], filler=2048)  # "token" shares the "t" of "secret"
def test_a_long_text_is_redacted_as_mark_by_mark_searches_would(pieces: list[str], filler: int) -> None:
    """Past the length from which a text's marks are found in one pass, its credentials are what
    one search per mark finds: the same edits, whatever the marks beside each other."""
    text = "".join(pieces) + "." * filler + "".join(reversed(pieces))
    one_pass = redact._text_edits(text, [])
    saved = redact._MARKS_IN_ONE_PASS
    redact._MARKS_IN_ONE_PASS = len(text) + 1  # each mark searched for on its own
    try:
        assert one_pass == redact._text_edits(text, [])
    finally:
        redact._MARKS_IN_ONE_PASS = saved


@settings(max_examples=10, deadline=None)
@given(secret=_RANDOM, form=st.integers(0, N_FORMS - 1), depth=st.integers(1_000, 5_000))
def test_very_deep_nesting_is_fine(secret: str, form: int, depth: int) -> None:
    sent, shown = _forms(secret)[form]
    opened, closed = '{"a":[' * depth, "]}" * depth
    raw = f'{opened}{json.dumps(sent)},{{"pw":{"[" * depth}1{"]" * depth}}}{closed}'.encode()
    expected = f'{opened}{json.dumps(shown)},{{"pw":"{REDACTED}"}}{closed}'.encode()
    assert redact_json_bytes(raw) == expected


def test_reported_bodies() -> None:
    """The forms issue reports name: a PEM key in a tool message, a number under ``password``, ``pw`` in
    tool arguments; log-prob token texts and ``the next token: cat`` are data."""
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
    tool = {"role": "tool", "content": f"cat id_rsa\n{pem}"}
    raw = json.dumps({"messages": [tool]}).encode()
    shown = json.loads(redact_json_bytes(raw))["messages"][0]["content"]
    assert shown == f"cat id_rsa\n-----BEGIN PRIVATE KEY-----{REDACTED}-----END PRIVATE KEY-----"

    raw = b'{"name":"login","arguments":"{\\"user\\": \\"bob\\", \\"password\\": 98765432123, \\"pw\\": \\"hunter2\\"}"}'  # noqa: E501
    expected = b'{"name":"login","arguments":"{\\"user\\": \\"bob\\", \\"password\\": \\"***\\", \\"pw\\": \\"***\\"}"}'  # noqa: E501
    assert redact_json_bytes(raw) == expected
    assert redact_json_bytes(b'{"password": 98765432123}') == b'{"password": "***"}'

    logprobs = {
        "content": [{"token": "cat", "logprob": -0.1, "top_logprobs": [{"token": "token", "logprob": -2.5}]}],
    }
    for body in (
        {"choices": [{"message": {"content": "the next token: cat"}, "logprobs": logprobs}]},
        {"meta_info": {"output_token_logprobs": [[-0.1, 42, "token"]], "id": "7f3a"}, "text": "key: value"},
        {"seed": 123456789012345678901234567890, "x": float("nan"), "s": "\ud83d"},
    ):
        raw = json.dumps(body).encode()
        assert redact_json_bytes(raw) is raw


def test_not_json_and_server_sent_events() -> None:
    assert redact_json_bytes(b"user=bob&password=hunter2&x=1") == b"user=bob&password=***&x=1"
    raw = (
        b'data: {"choices":[{"delta":{"content":"Authorization: Bearer abcDEF123456"}}]}\n\ndata: [DONE]\n\n'
    )
    expected = b'data: {"choices":[{"delta":{"content":"Authorization: ***"}}]}\n\ndata: [DONE]\n\n'
    assert redact_json_bytes(raw) == expected
    binary = bytes(range(256)) * 4
    assert redact_json_bytes(binary) is binary


def test_the_keys_a_scan_skips_are_no_credential_names() -> None:
    """The scan reads the JSON keys that name data blank; none names a credential (quoted, no word
    before it pairs with it: "API token")."""
    for bare, blank in _BARE_NAMES:
        assert not credential_name(bare.strip('"'))
        assert len(blank) == len(bare) and blank.strip('"_') == ""
