"""Every form of secret is hidden, wherever it stands in a command line, a payload string or a
mapping; harmless look-alikes stay readable. Property tests: any secret value, in any form, at
any place in any text."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlreplay.format import payload
from rlreplay.format.redact import REDACTED, redact_argv, redact_data, redact_text, redact_value

#: A secret's characters (no separators: a form decides where it ends).
_SECRET = st.text(string.ascii_letters + string.digits, min_size=12, max_size=28).map(lambda s: "Zq9" + s)
#: Values shaped like well-known keys, made from a secret (each ends in 12 characters of it).
_SHAPES = [
    lambda s: "ghp_" + s.rjust(36, "x"),
    lambda s: "github_pat_" + s.rjust(30, "x"),
    lambda s: "AKIA" + s.upper().rjust(16, "X")[-16:],
    lambda s: "sk-" + s.rjust(40, "x"),
    lambda s: "sk-proj-" + s.rjust(40, "x"),
    lambda s: "hf_" + s.rjust(34, "x"),
    lambda s: "xoxb-1234567890-" + s,
    lambda s: f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOi{s[::-1]}.{s}",
    lambda s: "glpat-" + s.rjust(20, "x"),
    lambda s: "AIza" + s.rjust(35, "x")[-35:],
    lambda s: "ASIA" + s.upper().rjust(16, "X")[-16:],
    lambda s: "sk_live_" + s.rjust(24, "x"),
    lambda s: "sk-ant-api03-" + s.rjust(40, "x"),
]
#: Forms found only in payloads (command lines keep their own rules).
_PAYLOAD_SHAPES = [lambda s: _random(s)]  # no prefix: a random token


def _random(s: str) -> str:
    """A random-looking token made from ``s``: each of its characters followed by a capital, a digit
    and a small letter, so that the character class changes at every second character or more."""
    return "".join(f"{c}Q7z" for c in s)[:100]


_TEXT = st.text(string.ascii_letters + " .,\n", max_size=40)


def _needles(value: str) -> list[str]:
    """What must not survive of a secret: its last 12 characters (a shaped key's own part)."""
    return [value[-12:]]


# ---- command lines -------------------------------------------------------------------------------


ARGV_FORMS = [
    lambda s: (["curl", f"https://user:{s}@host.example/x?api_key=q{s[::-1]}"], [s, s[::-1]]),
    lambda s: (["git", "clone", f"https://oauth2:{s}@gitlab.example/org/repo.git"], [s]),
    lambda s: (["env", f"PGPASSWORD={s}", "psql", "-h", "db"], [s]),
    lambda s: (["env", f"MYSQL_ROOT_PASSWORD={s}"], [s]),
    lambda s: (["tool", "--oauth", s], [s]),
    lambda s: (["tool", f"--oauth={s}"], [s]),
    lambda s: (["tool", "--pass", s], [s]),
    lambda s: (["tool", "--db-pass", s], [s]),
    lambda s: (["tool", f"--db-pass={s}"], [s]),
    lambda s: (["curl", "-H", f"Cookie: session={s}; theme=dark"], [s]),
    lambda s: (["curl", "-H", f"Cookie: theme=dark; session={s}"], [s]),
    lambda s: (["curl", "--cookie", f"session={s}"], [s]),
    lambda s: (["curl", "-H", f"Authorization: Bearer {s}"], [s]),
    *(lambda s, f=f: (["run", "--opt", f(s)], _needles(f(s))) for f in _SHAPES),
    *(lambda s, f=f: (["run", f"--opt={f(s)}"], _needles(f(s))) for f in _SHAPES),
]


@settings(max_examples=60, deadline=None)
@given(secret=_SECRET, form=st.integers(0, len(ARGV_FORMS) - 1))
def test_every_form_is_hidden_in_a_command_line(secret: str, form: int) -> None:
    argv, needles = ARGV_FORMS[form](secret)
    shown = " ".join(redact_argv(argv))
    assert not [n for n in needles if n in shown], (argv, shown)
    assert REDACTED in shown


@pytest.mark.parametrize(
    "argv",
    [
        ["ssh", "-p", "2222", "gpu-node"],
        ["python", "train.py", "monkey=3", "--monkey", "banana"],
        ["python", "train.py", "max_tokens=512", "--max-tokens", "512"],
        ["python", "train.py", "--passes", "3", "--bypass-cache", "--compass", "north"],
        ["python", "train.py", "data.prompt_key=prompt", "--tokenizer-path", "/models/qwen"],
        ["python", "train.py", "--cookie-cutter", "yes", "--passthrough", "x"],
        ["curl", "https://example.com/search?q=tokens&page=2"],
    ],
)
def test_harmless_look_alikes_stay_readable_in_command_lines(argv: list[str]) -> None:
    assert redact_argv(argv) == argv


# ---- payload strings: inputs, outputs, attributes, errors -------------------------------------------


PAYLOAD_FORMS = [
    lambda s: (f"export PGPASSWORD={s}", [s]),
    lambda s: (f"password: {s}", [s]),
    lambda s: (f'{{"api_key": "{s}"}}', [s]),
    lambda s: (f"db_pass={s}", [s]),
    lambda s: (f"Authorization: Bearer {s}", [s]),
    lambda s: (f"Authorization: Basic {s}", [s]),
    lambda s: (f"Cookie: session={s}; theme=dark", [s]),
    lambda s: (f"Set-Cookie: sid={s}; Path=/; HttpOnly", [s]),
    lambda s: (f"cloned https://bob:{s}@git.example/repo.git", [s]),
    lambda s: (f"see https://api.example/v1?x=1&access_token={s}", [s]),
    lambda s: (f"curl -H 'X-Api-Key: {s}' https://api.example", [s]),
    lambda s: (f"pw={s}", [s]),
    lambda s: (f'{{"pw": "{s}", "n": 1}}', [s]),
    lambda s: (f'{{"password": {_number(s)}}}', [str(_number(s))]),
    lambda s: (f'{{"client_secret": ["{s}", 7]}}', [s]),
    lambda s: (f"the api key is '{s}'", [s]),
    lambda s: (f"API key: {s}", [s]),
    lambda s: (f"conn = connect(user='bob', password=\"{s}\")", [s]),
    lambda s: (f"-----BEGIN PRIVATE KEY-----\n{_random(s)}\n{s}\n-----END PRIVATE KEY-----", [s]),
    lambda s: (f"-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn{s}\n", [s]),
    *(lambda s, f=f: (f"the key is {f(s)}, keep it safe", _needles(f(s))) for f in _SHAPES + _PAYLOAD_SHAPES),
    *(lambda s, f=f: (f(s), _needles(f(s))) for f in _SHAPES + _PAYLOAD_SHAPES),
]


def _number(s: str) -> int:
    """A number made from a secret (a PIN, a numeric password)."""
    return int.from_bytes(s.encode()[-7:], "big")


@settings(max_examples=100, deadline=None)
@given(secret=_SECRET, form=st.integers(0, len(PAYLOAD_FORMS) - 1), before=_TEXT, after=_TEXT)
def test_every_form_is_hidden_in_payload_text(secret: str, form: int, before: str, after: str) -> None:
    form_text, needles = PAYLOAD_FORMS[form](secret)
    text = before + " " + form_text + "\n" + after
    shown = redact_text(text)
    around = before + " " + after  # the text around may hold a needle's letters by chance
    assert not [n for n in needles if shown.count(n) > around.count(n)], (text, shown)
    assert REDACTED in shown


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    secret=_SECRET,
    form=st.integers(0, len(PAYLOAD_FORMS) - 1),
    where=st.sampled_from(["value", "nested", "list", "tuple", "key", "deep"]),
)
def test_every_form_is_hidden_anywhere_in_a_payload(secret: str, form: int, where: str) -> None:
    text, needles = PAYLOAD_FORMS[form](secret)
    value = {
        "value": {"out": text},
        "nested": {"a": {"b": [1, {"c": text}]}},
        "list": [text, "x"],
        "tuple": (1.5, text),
        "key": {text: 1},
        "deep": [[[[{"z": [text]}]]]],
    }[where]
    data, _ = payload.to_payload(value)
    for dumped in (json.dumps(data), json.dumps(redact_data(value if where != "tuple" else list(value)))):
        assert not [n for n in needles if n in dumped], (value, dumped)


@settings(max_examples=30, deadline=None)
@given(secret=_SECRET)
def test_values_of_secret_environment_variables_are_hidden(secret: str) -> None:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MY_SERVICE_PASSWORD", secret)
        assert secret not in redact_text(f"the tool printed: {secret} and more")
        assert secret not in redact_value(f"echo {secret}")
        data, _ = payload.to_payload({"stdout": f"DB={secret}\n", "args": [f"x{secret}y"]})
        assert secret not in json.dumps(data)


@pytest.mark.parametrize(
    "text",
    [
        "The monkey ate 3 bananas.",
        "max_tokens: 512, temperature: 0.7",
        "ssh -p 2222 gpu-node",
        "Solve this basic arithmetic problem: 2 + 2.",
        "The token budget is 4096 tokens; each token costs a bit.",
        "Answer key: B",
        "key: value pairs are fine",
        "commit 0123456789abcdef0123456789abcdef01234567 fixed the parser",
        "passed 12 of 12 tests; bypass the cache; compass: north",
        "the sk-learn library, hf_hub and AKIA are words here",
        "see https://example.com/docs?page=2#tokens",
        "cookie recipes: flour, sugar",
        "the next token: cat",
        "token: cat, key: dog, eos_token: </s>",
        "the password is incorrect; the password was wrong",
        "Basic Instructions: read the Bearer bonds chapter",
        "id chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT, call call_9pw1qnYScqvGrCH58HiCvDXM",
        "request f47ac10b-58cc-4372-a567-0e02b2c3d479 and toolu_01A09q90qw90lq917835lq9",
        "<img src='data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAC"
        "hwGA60e6kgAAAABJRU5ErkJggg=='>",
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl bob@host",
        "integrity=sha384-oqVuAfXRKap7fdgcCY5uykM6+R9GqQ8K/uxy9rx7HNQlGYl1kPzQho1wx4JwY8wC",
        "/usr/lib/x86_64-linux-gnu/libstdc++.so.6 and getUserAccountSettingsHandler2",
        "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUbW9yZSBjZXJ0aWZpY2F0ZQ\n-----END CERTIFICATE-----",
        "if password == expected: ok = True",
        'password = os.environ["DB_PASSWORD"]; api_key=get_api_key(); token=tokens[3]',
        "PGPASSWORD=$DB_PASS psql -h db; password: ${DB_PASSWORD}; api_key: <your-api-key>",
        "x = {'token': 5, 'key': 'k1', 'eos_token': '</s>'}",
        '{"token": "cat", "logprob": -0.5, "top_logprobs": [{"token": "Ġdog"}]}',
    ],
)
def test_harmless_look_alikes_stay_readable_in_payload_text(text: str) -> None:
    assert redact_text(text) == text
