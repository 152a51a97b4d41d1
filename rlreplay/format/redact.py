"""Keeping secrets out of manifests, span payloads, ledgers and output: redaction by rule.

Two rule sets. Command lines, environment variables, manifests and log lines go by *secret
names*; payloads (what traced calls take and return, proxy bodies) go by what a value *is*.

**Secret names** (:func:`secret_name`): an option, argument, variable, header or keyword name
whose words (split at ``-``, ``_``, ``.``, ``:`` and camelCase) include ``secret``,
``credential(s)``, or contain ``password``, ``passwd`` or ``passphrase`` (``PGPASSWORD``), or end
in ``key``, ``apikey``, ``token``, ``pat``, ``auth``, ``authorization``, ``oauth``, ``pass`` or
``cookie(s)``. A ``key`` that names data (``prompt_key``, ``image_key``: a dataset column) is not
a secret, nor is a keyword argument named just ``key`` (``--key`` on a command line is a secret,
``key=X`` without dashes is not: ``pytest -o key=value``); ``max_tokens``, ``tokenizer_path``,
``--passes`` and ``bypass`` are not either. In command lines, messages and log lines
(:func:`redact_argv`, :func:`redact_value`) ``***`` replaces: the value of a secret name
(``--key X``, ``--api-key=X``, ``PGPASSWORD=X``, ``KEY:X``, ``Authorization: Bearer X``); every
cookie of a ``Cookie:``/``Set-Cookie:`` header; ``-p X``/``-pX`` for programs whose ``-p`` is a
password (mysql, mariadb, docker, podman, sshpass, the mongo tools; elsewhere it is a port, a
plugin); a URL's user and password and secret query parameters; ``Bearer``/``Basic``
credentials, values shaped like known keys (below), a standalone 40-hex string, private key
bodies; the value of every environment variable with a secret name (6 characters or more).
:func:`redact_mapping` (manifests) hides the value of a secret name (numbers excepted) and of a
credential name (below, any type).

**Payloads** (:func:`redact_text`, :func:`redact_data`, ``payload.to_payload``,
:func:`redact_json_bytes`): credentials and only credentials are hidden; data never is, whatever
its key is called (OpenAI log-prob ``token``s, SGLang ``meta_info``, ``eos_token``, every entry
of a tokenizer's vocabulary):
- *by form*: private keys in PEM/OpenSSH/PGP armour (the body between the lines; certificates
  and public keys are kept); values with the prefix of a known key and a random part that is not
  a lowercase word (``sk-``, ``sk-proj-``, ``sk-ant-``, ``sk_live_``, ``hf_``, ``ghp_``/``gho_``…,
  ``github_pat_``, ``glpat-``, ``xox?-``, ``npm_``, ``pypi-``, ``gsk_``, ``AKIA``/``ASIA``,
  ``AIza``, ``ya29.``, ``SG.``, JWTs …); random tokens: 24 to 128 base64-like characters with
  capitals, small letters and digits whose class changes at 4 of 10 neighbours or more (not an
  id with a lowercase prefix such as ``chatcmpl-``, ``call_``, ``toolu_``; not a hex digest, a
  UUID, a number, a word, a path, a data: URL, an SSH public key); a URL's user and password and
  credential query parameters; ``Bearer``/``Basic`` followed by a value that is not a word;
  every cookie of a cookie header; environment variables' values as above;
- *by name* (:func:`credential_name`): a key named ``password``, ``passwd``, ``passphrase``,
  ``pw``, ``secret``, ``credentials``, ``authorization``, ``auth``, ``cookie``, ``apikey``, or
  ``<qualifier>_key``/``_token`` with a credential qualifier (``api_key``, ``access_token``,
  ``refresh_token``, ``client_secret``, ``private_key``, ``hf_token``, ``X-Api-Key``), or
  ``db_pass``-like names (``pass`` after db, user, admin, root, login, ...), hides its whole
  value whatever its JSON type (a number, a list, an object; ``None``, booleans and ``""`` hold
  nothing). Bare ``token`` and ``key`` are not credential names, nor are ``eos_token``,
  ``prompt_key``, ``max_tokens``, ``pass`` and ``test_pass`` (test results) or ``secret_word``;
- *by prose cue*: such a name assigned in text (``password: X``, ``pw=X``, ``"api_key": 7``,
  ``connect(password="X")``, ``API key: X``), and after ``is``/``was`` a quoted value or one that
  is not a word (``the password is hunter2``; ``the password is incorrect`` stays). JSON text
  inside strings (tool arguments) is read as JSON.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import os
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from rlreplay.format.marks import held

REDACTED = "***"

_ANYWHERE = frozenset({"secret", "secrets", "credential", "credentials"})
#: Inside any word (``PGPASSWORD``, ``dbpassword``).
_INSIDE = ("password", "passwd", "passphrase")
_LAST = frozenset(
    {"key", "apikey", "token", "pat", "auth", "authorization", "oauth", "pass", "cookie", "cookies"}
)
#: ``<word>_key`` names a column or an entry, not a secret, after one of these words.
_DATA_KEY = frozenset(
    {
        "prompt",
        "response",
        "image",
        "video",
        "audio",
        "data",
        "label",
        "answer",
        "text",
        "message",
        "messages",
        "input",
        "output",
        "column",
        "field",
        "sort",
        "cache",
        "group",
        "fn",
        "teacher",
        "reward",
        "tool",
        "sample",
        "partition",
        "primary",
        "foreign",
    }
)
_NAME = re.compile(r"[-+~]*[A-Za-z_][\w.@/-]*")  # an option or config key, before ``=``
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_SHORT_PASSWORD = "-p"
#: Programs whose ``-p`` takes a password (elsewhere it is a port, a plugin, a path...).
_PASSWORD_P = frozenset(
    {
        "mysql",
        "mysqldump",
        "mysqladmin",
        "mysqlimport",
        "mysqlshow",
        "mysqlcheck",
        "mariadb",
        "mariadb-dump",
        "mariadb-admin",
        "docker",
        "podman",
        "nerdctl",
        "sshpass",
        "mongo",
        "mongosh",
        "mongodump",
        "mongorestore",
        "mongoexport",
        "mongoimport",
    }
)

_SHAPED_KEY = (
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})\b"
)
_SECRET_VALUE = re.compile(_SHAPED_KEY + r"|(?<![/\w@.-])[0-9a-f]{40}(?![/\w])")
_SCHEME_AUTH = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{6,}")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_QUERY = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
#: A Cookie or Set-Cookie header: every cookie on its line.
_COOKIE = re.compile(r"(?i)\b((?:set-)?cookie)([\"']?\s*[:=]\s*)([^\r\n]+)")
# name=value / name: value inside a longer text (a header, an env assignment, a config line)
_ASSIGNMENT = re.compile(
    r"(?<![\w.-])([\"']?)(-{0,2}[A-Za-z_][\w.-]*)\1(\s*[=:]\s*)(?!//)"
    r"(\"[^\"]*\"|'[^']*'|(?:(?i:bearer|basic|token)\s+)?[^\s\"',;&}\]]+)"
)
#: No text shorter than this holds a secret by these rules (``pat=XY``; a variable's value has 6).
_SHORTEST = 6


@functools.lru_cache(maxsize=4096)
def secret_name(name: str, bare_key: bool = True) -> bool:
    """Whether ``name`` (an option, variable, header or keyword name) names a secret.

    ``bare_key``: whether ``key`` alone counts (``--key X`` on a command line does; a Python
    keyword argument ``key=`` is a lookup key, so ``redact_mapping`` passes False)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if not words:
        return False
    if any(w in _ANYWHERE or any(part in w for part in _INSIDE) for w in words):
        return True
    last = words[-1]
    if last not in _LAST:
        return False
    if last == "key" and len(words) == 1:
        return bare_key
    return not (last == "key" and words[-2] in _DATA_KEY)


_env_seen: dict[str, Any] = {"size": -1, "names": (), "values": (), "secrets": []}


def environment_secrets() -> list[str]:
    """The values of the environment's secret variables (longest first), looked up again only
    when a variable was added or removed, or one of them changed (cheap to call often)."""
    seen = _env_seen
    names = seen["names"]
    if len(os.environ) == seen["size"] and (not names or tuple(map(os.environ.get, names)) == seen["values"]):
        return seen["secrets"]
    names = tuple(k for k, v in os.environ.items() if len(v) >= 6 and secret_name(k))
    values = tuple(map(os.environ.get, names))
    secrets = sorted({v for v in values if v}, key=len, reverse=True)
    seen.update(size=len(os.environ), names=names, values=values, secrets=secrets)
    return secrets


def redact_url(url: str) -> str:
    """``url`` without its user and password and with secret query parameters hidden."""
    out = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", url)
    if "?" in out:
        out = _QUERY.sub(
            lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if secret_name(m.group(2)) else m.group(0), out
        )
    return out


def _hide_cookies(text: str) -> str:
    if "ookie" not in text and "OOKIE" not in text:
        return text
    return _COOKIE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_value(text: str) -> str:
    """``text`` (a command-line argument, a message, a log line) with every secret the rules
    recognize hidden (see the module docstring)."""
    for secret in environment_secrets():
        text = text.replace(secret, REDACTED)
    text = redact_url(text)
    text = _hide_cookies(text)
    text = _ASSIGNMENT.sub(_hide_assignment, text)
    text = _SCHEME_AUTH.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _SECRET_VALUE.sub(REDACTED, text)
    shaped = [(m.start(2), m.end(2), REDACTED) for m in _PEM.finditer(text)] if "-----BEGIN " in text else []
    for start, end in _runs(text) if len(text) >= _RUN_SHORTEST else ():
        shaped += _run_edits(text, start, end, random=False)
    return _apply(text, shaped) if shaped else text


def _hide_assignment(m: re.Match[str]) -> str:
    quote, name, sep, value = m.groups()
    if not secret_name(name):
        return m.group(0)
    hidden = f"{value[0]}{REDACTED}{value[0]}" if value[0] in "\"'" else REDACTED
    return f"{quote}{name}{quote}{sep}{hidden}"


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret options and arguments hidden."""
    out: list[str] = []
    hide_next = False
    password_p = False  # whether ``-p`` takes a password in the program run so far
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if password_p and arg == _SHORT_PASSWORD:
            out.append(arg)
            hide_next = True
            continue
        if password_p and arg.startswith(_SHORT_PASSWORD) and not arg.startswith("--") and len(arg) > 2:
            out.append(_SHORT_PASSWORD + REDACTED)
            continue
        if not arg.startswith("-") and arg.rsplit("/", 1)[-1] in _PASSWORD_P:
            password_p = True
        name, eq, value = arg.partition("=")
        option = arg.startswith("-")
        named = _NAME.fullmatch(name) is not None  # not a URL or a sentence (``https://u:p@h/?key=``)
        if option and not eq and named and secret_name(name):
            out.append(arg)
            hide_next = True
            continue
        if eq and named and secret_name(name, bare_key=option):
            out.append(f"{name}={REDACTED}")
            continue
        out.append(f"{name}={redact_value(value)}" if eq and named else redact_value(arg))
    return out


def redact_data(value: Any) -> Any:
    """``value`` (a payload: mappings, lists, strings, numbers) with its credentials hidden, at any
    depth: credential-named keys hide their value whatever its type (:func:`hides`), strings go
    through :func:`redact_text`; number lists (token ids, log-probs) are never looked into, and
    what needs no change is returned as it is (the same object)."""
    return _redact_any(value, set(), hides)


def redact_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` (a manifest's fields, a configuration) with its credentials hidden as in
    :func:`redact_data`, and besides the value of every secret name (numbers excepted: counts stay
    readable), at any depth. Values that need no change are kept as they are (same objects, same
    types); cycles are fine."""
    out = _redact_any(data, set(), _hides_in_config)
    return dict(out) if out is data or not isinstance(out, dict) else out


def hides(key: Any, value: Any) -> bool:
    """Whether a payload mapping's ``value`` under ``key`` is hidden whole: ``key`` is a credential
    name (:func:`credential_name`), whatever the value's type; ``None``, booleans and ``""`` hold
    nothing and stay."""
    if value is None or value is True or value is False or (type(value) is str and not value):
        return False
    return type(key) is str and credential_name(key)


def _hides_in_config(key: Any, value: Any) -> bool:
    """:func:`hides`, and the broader secret names of command lines and configurations (numbers
    excepted)."""
    if hides(key, value):
        return True
    if value is None or type(value) in _PLAIN or (type(value) is str and not value):
        return False
    return type(key) is str and secret_name(key, bare_key=False)


_PLAIN = frozenset({bool, int, float})


def redact_text(value: str, env: list[str] | None = None) -> str:
    """A payload string with its credentials hidden (the module docstring); ``value`` itself when
    unchanged. ``env``: :func:`environment_secrets`, when the caller has them. JSON text (tool
    arguments) is read as JSON too: a credential name hides its value whatever its type. It runs on
    the recorder's writer thread for every string of every span: each rule first looks for its
    mark with C-speed substring searches, and runs only where one is found."""
    if len(value) < _SHORTEST:
        return value
    env = environment_secrets() if env is None else env
    if _SEPARATOR.search(value) is None:  # one word, an id, a path: a key, a token, a variable's value
        edits = _word_edits(value, env) if env or len(value) >= _RUN_SHORTEST else []
    else:
        edits = _credential_edits(value, env)
    return _apply(value, edits) if edits else value


def _numbers_only(value: list | tuple) -> bool:
    """Whether every item is a number (summed at C speed: no walk over token ids)."""
    try:
        sum(value)
    except Exception:
        return False
    return True


def _redact_any(value: Any, seen: set[int], hidden: Callable[[Any, Any], bool]) -> Any:
    kind = type(value)
    if kind in _PLAIN or value is None:
        return value
    if kind is str:
        return redact_text(value)
    if kind is dict or isinstance(value, Mapping):
        if id(value) in seen:
            return value
        seen.add(id(value))
        changed = False
        out = {}
        for k, v in value.items():
            new = REDACTED if hidden(k, v) else _redact_any(v, seen, hidden)
            key = redact_text(k) if type(k) is str else k
            changed = changed or new is not v or key is not k
            out[key] = new
        return out if changed else value
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        if not value or id(value) in seen or (type(value[0]) in _PLAIN and _numbers_only(value)):
            return value  # token ids, log-probs: no names, no URLs
        seen.add(id(value))
        items = [_redact_any(v, seen, hidden) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


# ---- credentials by what a value is: payload text and raw bodies ---------------------------------

#: Words that name a credential when they end a name (``db_password``, ``client_secret``).
_CREDENTIAL_LAST = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "passcode",
        "pw",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "creds",
        "apikey",
        "authorization",
        "auth",
        "cookie",
        "cookies",
        "accesstoken",
        "authtoken",
        "secretkey",
        "privatekey",
        "accesskey",
    }
)
#: ``<word>_key`` / ``<word>_token`` names a credential after one of these words
#: (``api_key``, ``access_token``, ``hf_token``); after any other (``eos_token``, ``sort_key``) it is data.
_CREDENTIAL_QUALIFIER = frozenset(
    {
        "api",
        "access",
        "secret",
        "private",
        "client",
        "auth",
        "session",
        "refresh",
        "bearer",
        "id",
        "app",
        "application",
        "account",
        "service",
        "master",
        "signing",
        "encryption",
        "oauth",
        "personal",
        "deploy",
        "webhook",
        "security",
        "admin",
        "login",
        "registry",
        "subscription",
        "license",
        "csrf",
        "xsrf",
        "jwt",
        "ssh",
        "gpg",
        "hf",
        "huggingface",
        "hub",
        "github",
        "gh",
        "gitlab",
        "openai",
        "anthropic",
        "wandb",
        "slack",
        "bot",
        "npm",
        "pypi",
        "aws",
        "azure",
        "gcp",
        "google",
        "stripe",
        "twilio",
        "sendgrid",
        "discord",
        "telegram",
    }
)
_CREDENTIAL_TAIL = frozenset({"key", "keys", "token", "tokens"})  # each holds one of _NAME_MARKS
#: ``<word>_pass`` is a password after these (``db_pass``); ``num_pass``, ``test_pass`` count tests.
_PASS_QUALIFIER = frozenset(
    {
        "db",
        "user",
        "admin",
        "root",
        "login",
        "sudo",
        "ftp",
        "smtp",
        "mail",
        "email",
        "wifi",
        "vnc",
        "ldap",
        "proxy",
    }
)


@functools.lru_cache(maxsize=4096)
def credential_name(name: str) -> bool:
    """Whether a payload key or an assigned name (``password``, ``pw``, ``api_key``,
    ``access_token``, ``X-Api-Key``, ``Authorization``, ``client_secret``, ``db_pass``) names a
    credential. Bare ``token`` and ``key`` do not (OpenAI log-prob ``token``s, lookup keys), nor do
    ``eos_token``, ``prompt_key``, ``max_tokens``, ``pass`` (a test result) or ``secret_word``."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if not words:
        return False
    last = words[-1]
    if last in _CREDENTIAL_LAST or any(part in last for part in _INSIDE):
        return True
    if len(words) < 2:
        return False
    if last == "pass":
        return words[-2] in _PASS_QUALIFIER or words[-2] in _CREDENTIAL_QUALIFIER
    return last in _CREDENTIAL_TAIL and words[-2] in _CREDENTIAL_QUALIFIER


#: Private keys in PEM (and OpenSSH, PGP) armour: the body between the lines is hidden.
_PEM = re.compile(
    r"-----BEGIN ((?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?)-----"
    r"([\sA-Za-z0-9+/=:,.\\-]*?)(?=-----END |[^\sA-Za-z0-9+/=:,.\\-]|\Z)"
)
#: Values shaped like well-known credentials (their own prefixes). The group that matched is the
#: random part, which must not be plain lowercase words (``sk-learn-tutorial-notebook`` is kept).
_KEY_SHAPE = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"(?:sk-(?:proj-|ant-|or-|svcacct-|admin-)?|(?:sk|rk)_(?:live|test)_|whsec_|hf_|api_org_|gh[pousr]_"
    r"|github_pat_|glpat-|xox[abposre]-|xapp-|npm_|pypi-|gsk_|r8_|dop_v1_|xai-|pplx-|nvapi-"
    r"|lsv2_(?:pt|sk)_|tvly-|ya29\.)([A-Za-z0-9_-]{16,})"
    r"|(?:AKIA|ASIA)([0-9A-Z]{16})"
    r"|AIza([0-9A-Za-z_-]{35})"
    r"|SG\.([A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,})"
    r"|eyJ([A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
    r")"
)
#: Every key shape starts with one of these.
_SHAPE_PREFIXES = (
    "sk-", "sk_", "rk_", "whsec_", "hf_", "api_org_", "gh", "github_pat_", "glpat-", "xox", "xapp-", "npm_",
    "pypi-", "gsk_", "r8_", "dop_v1_", "xai-", "pplx-", "nvapi-", "lsv2_", "tvly-", "ya29.", "AKIA", "ASIA",
    "AIza", "SG.", "eyJ",
)  # fmt: skip
_PLAIN_WORDS = re.compile(r"[a-z_-]+")
#: What a random-looking run that is data follows: a data: URL's ``base64,``, an SSH key type.
_PUBLIC_BEFORE = re.compile(r"(?:base64,|(?:ssh-(?:rsa|dss|ed25519)|ecdsa-sha2-nistp\d+|@openssh\.com) )\Z")
#: Armour of what is public: certificates, public keys (their lines look random).
_PUBLIC_PEM = re.compile(
    r"-----BEGIN ((?:[A-Z0-9]+ )*(?:CERTIFICATE(?: REQUEST)?|PUBLIC KEY(?: BLOCK)?|X509 CRL))-----.*?"
    r"(?:-----END \1-----|\Z)",
    re.S,
)
_RUN_PLAIN = re.compile(r"[a-z_+/-]*")
#: Characters of random tokens and key shapes (base64, base64url, hex); a run of 19 or more
#: (the shortest key shape) is looked at closer, 24 or more may be a random token.
_RUN_CHARS = frozenset(string.ascii_letters + string.digits + "+/_-")
_RUN_TABLE = bytes(0x61 if chr(i) in _RUN_CHARS else 0x20 for i in range(256))
_RUN_SHORTEST = 19
_RUN_NEEDLE = b"a" * _RUN_SHORTEST
#: A text holds a name's value, a URL's user, a header or armour only with one of these.
_SEPARATOR = re.compile(r"[:=\s]")
_RANDOM_SHORTEST, _RANDOM_LONGEST = 24, 128  # longer runs are data (images, embeddings, ciphertext)
_JSON_ESCAPE_START = re.compile(r"\\(?:u[0-9a-fA-F]{4}|[nrtbf\"\\/])")
#: An identifier with a lowercase prefix (``chatcmpl-…``, ``call_…``, ``toolu_…``, ``sha384-…``): an id.
_PREFIXED_ID = re.compile(r"[a-z]{2,}[0-9]*[_-]")
_DIGIT = re.compile(r"[0-9]")
_CLASS_RUNS = re.compile(r"[A-Z]+|[a-z]+|[0-9]+|[^A-Za-z0-9]+")
_BEARER_VALUE = re.compile(r"(Bearer|Basic)(?:\s|\\[nrt])+([A-Za-z0-9._~+/-]{7,}[A-Za-z0-9_~+/-]=*)")
_WORD = re.compile(r"[A-Za-z][a-z]*")
#: Every credential name holds one of these (lowercase); ``"token"`` and ``"key"`` alone are data.
_NAME_MARKS = ("pass", "secret", "cred", "auth", "cookie", "pw", "key", "token")
_IS_MARKS = ("pass", "secret", "key", "token")  # of the names a prose "is" assigns to
#: JSON keys that name data (log-prob ``token``s, lookup keys, vLLM's token ids), each with what a
#: scan reads in its place: no mark in them is looked at, at C speed.
_BARE_NAMES = tuple(
    (f'"{name}"', '"' + "_" * len(name) + '"') for name in ("token", "key", "token_ids", "prompt_token_ids")
)
#: Names that are credentials after a word and a space (``API key``, ``access token``).
_PAIRED = frozenset({"key", "keys", "token", "tokens"})
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
#: What follows an unquoted assigned name: ``=``, ``:`` or ``is``, on its line (group 1: no quote).
_AFTER_NAME = re.compile(r"()([ \t]*(?<![=!<>])[=:](?![=:/])[ \t]*|[ \t]+(?:is|was)[ \t]+)")
#: A quoted name (a JSON key in text) may have its value on the next line.
_AFTER_QUOTED_NAME = re.compile(r"(\\*[\"'])(\s*[=:](?![=:/])\s*)")
_NAME_REST = re.compile(r"[A-Za-z0-9_.-]*(?=(?:\\*[\"'])?(?:\s*(?<![=!<>])[=:](?![=:/])|\s+(?:is|was)\s))")
_QUOTED = re.compile(r"(\\*)([\"'])(.*?)\1\2")
_BARE_VALUE = re.compile(r"(?:(?:Bearer|Basic|Token|bearer|basic|token)[ \t]+)?[^\s\"',;&}\])\\]+")
#: What follows ``scheme://``: the user and password before ``@``, then the rest of the URL.
_URL = re.compile(r"([^/\\\s@?#\"'<>]+@)?[^\s\"'<>\\]*")
_QUERY_SPAN = re.compile(r"([?&])([^=&#\s\"']+)=([^&#\s\"'<>\\]+)")
#: A cookie header's value: every cookie on its line.
_COOKIES = re.compile(r"[^\r\n\"\\]+")

Edit = tuple[int, int, str]
#: Values that hold no credential, under any name.
_NOTHING = frozenset({"null", "true", "false", "None", "True", "False", '""', "''"})


def _looks_random(run: str) -> bool:
    """Whether a run of base64-like characters is a random token: 24 to 128 characters with
    uppercase, lowercase and digits mixed (the character class changes at 4 of 10 neighbours or
    more), not an id with a lowercase prefix. Words, numbers, hex digests, paths and ids are kept."""
    n = len(run)
    if n < _RANDOM_SHORTEST or n > _RANDOM_LONGEST or run.islower() or run.isupper():
        return False  # hex digests, words, UUIDs, numbers: one case or none
    if _PREFIXED_ID.match(run) or _DIGIT.search(run) is None:
        return False  # a lowercase prefix: an id; no digit: a name
    return len(_CLASS_RUNS.findall(run)) - 1 >= 0.4 * (n - 1)  # class changes between neighbours


def _run_edits(text: str, start: int, end: int, random: bool = True) -> list[Edit]:
    """Credentials in the run ``text[start:end]`` of :data:`_RUN_CHARS`: a key shape (with the
    dots of a JWT around it), else (``random``) a random token."""
    if start and text[start - 1] == "\\":  # after an escape (JSON text): its letters are not the run's
        m = _JSON_ESCAPE_START.match(text, start - 1)
        start = m.end() if m else start
    if _RUN_PLAIN.fullmatch(text, start, end):
        return []  # no digit, no capital: neither a key nor a random token
    lo, hi = start, end
    while lo > 1 and text[lo - 1] == "." and text[lo - 2] in _RUN_CHARS:
        lo -= 2
        while lo and text[lo - 1] in _RUN_CHARS:
            lo -= 1
    while hi + 1 < len(text) and text[hi] == "." and text[hi + 1] in _RUN_CHARS:
        hi += 1
        while hi < len(text) and text[hi] in _RUN_CHARS:
            hi += 1
    chunk = text[lo:hi]
    shaped = [
        (m.start() + lo, m.end() + lo, REDACTED)
        for m in (_KEY_SHAPE.finditer(chunk) if _may_be_shaped(chunk) else ())
        if not _PLAIN_WORDS.fullmatch(next(g for g in m.groups() if g is not None))
    ]
    if shaped:
        return shaped
    stop = end
    while stop < len(text) and stop < end + 2 and text[stop] == "=":
        stop += 1  # base64 padding
    if (
        not random
        or not _looks_random(text[start:end])
        or _PUBLIC_BEFORE.search(text, max(0, start - 24), start)
    ):
        return []  # not random, or a data: URL's content, an SSH public key
    if "-----BEGIN " in text and any(m.start() < start < m.end() for m in _PUBLIC_PEM.finditer(text)):
        return []  # a line of a certificate or a public key
    return [(start, stop, REDACTED)]


def _may_be_shaped(chunk: str) -> bool:
    """Whether a key shape's prefix starts ``chunk`` or follows a separator in it (where a shape
    may begin): a few C-speed searches, where the shapes' expression would try every position."""
    if chunk.startswith(_SHAPE_PREFIXES):
        return True
    for separator in "-_+/.":
        at = chunk.find(separator)
        while at != -1:
            if chunk.startswith(_SHAPE_PREFIXES, at + 1):
                return True
            at = chunk.find(separator, at + 1)
    return False


def _runs(text: str) -> list[tuple[int, int]]:
    """The runs of :data:`_RUN_CHARS` at least :data:`_RUN_SHORTEST` long (found at C speed)."""
    mapped = text.encode("ascii", "replace").translate(_RUN_TABLE)  # one byte per character
    out = []
    at = mapped.find(_RUN_NEEDLE)
    while at != -1:
        end = mapped.find(b" ", at)
        end = len(mapped) if end == -1 else end
        out.append((at, end))
        at = mapped.find(_RUN_NEEDLE, end)
    return out


def _word_edits(text: str, env: list[str]) -> list[Edit]:
    """The credentials of a word or a name: an environment variable's value, a key, a token."""
    edits: list[Edit] = []
    for secret in env:
        at = text.find(secret)
        while at != -1:
            edits.append((at, at + len(secret), REDACTED))
            at = text.find(secret, at + len(secret))
    if len(text) >= _RUN_SHORTEST:
        for start, end in _runs(text):
            edits += _run_edits(text, start, end)
    return edits


def _text_edits(text: str, env: list[str] | None = None, scan: bool = False) -> list[Edit]:
    """The credentials of ``text`` (prose, code, a config, a header; JSON text is read as text),
    as edits ``(start, end, replacement)``. Each rule runs only where a substring search finds its
    mark. ``scan``: only whether there may be one (any value of a credential name counts)."""
    edits: list[Edit] = []
    for secret in environment_secrets() if env is None else env:
        at = text.find(secret)
        while at != -1:
            edits.append((at, at + len(secret), REDACTED))
            at = text.find(secret, at + len(secret))
    colon = ":" in text
    # without = or :, only "is"/"was" can assign, and only to a password, a secret, a key or a token
    marks = _NAME_MARKS if colon or "=" in text else _IS_MARKS
    low = _without_data_names(text, text.lower())
    schemes = pem = True  # in a short text, each search below decides
    if len(low) >= _MARKS_IN_ONE_PASS:  # a long one: every mark looked for in one pass first
        present = held(low.encode("utf-8", "surrogatepass"), marks + _FORM_MARKS)
        marks = tuple(mark for mark in marks if mark in present)
        colon = colon and ("://" in present or ":\\/\\/" in present)
        schemes, pem = "bearer" in present or "basic" in present, "-----begin " in present
    if colon and ("://" in text or ":\\/\\/" in text):
        edits += _url_edits(text)
    edits += _assignment_edits(text, low, scan, marks)
    for scheme in ("Bearer", "Basic") if schemes else ():
        at = text.find(scheme)
        while at != -1:
            m = _BEARER_VALUE.match(text, at)
            if m is not None and not _WORD.fullmatch(m.group(2)):  # "Basic Instructions" is prose
                edits.append((m.start(2), m.end(2), REDACTED))
            at = text.find(scheme, at + len(scheme))
    if pem and "-----BEGIN " in text:
        edits += [(m.start(2), m.end(2), REDACTED) for m in _PEM.finditer(text) if m.group(2).strip()]
    if len(text) >= _RUN_SHORTEST:
        for start, end in _runs(text):
            edits += _run_edits(text, start, end)
    return edits


def _url_edits(text: str) -> list[Edit]:
    """The user and password of every URL (``https://user:pw@host`` → ``https://***@host``) and
    its query parameters with credential names."""
    edits: list[Edit] = []
    for slashes in ("://", ":\\/\\/"):
        at = text.find(slashes)
        while at != -1:
            m = _URL.match(text, at + len(slashes))
            if at and text[at - 1].isalnum() and m is not None:  # after a scheme
                if m.group(1):
                    edits.append((m.start(1), m.end(1) - 1, REDACTED))
                if "?" in m.group():
                    edits += [
                        (q.start(3) + m.start(), q.end(3) + m.start(), REDACTED)
                        for q in _QUERY_SPAN.finditer(m.group())
                        if credential_name(q.group(2))
                    ]
            at = text.find(slashes, at + len(slashes))
    return edits


def _without_data_names(text: str, low: str) -> str:
    """``low`` (``text`` lowercased) with the JSON keys that name data blanked: no mark in them is
    looked at."""
    if '"' in text:
        for bare, blank in _BARE_NAMES:
            if bare in low:
                low = low.replace(bare, blank)
    return low


#: Marks of a credential's form besides the names': a URL, an auth scheme, armour (lowercase).
_FORM_MARKS = ("://", ":\\/\\/", "bearer", "basic", "-----begin ")
#: From this length on, a text's marks are looked for in one pass rather than one search each.
_MARKS_IN_ONE_PASS = 2048


def _assignment_edits(
    text: str, low: str, scan: bool = False, marks: tuple[str, ...] = _NAME_MARKS
) -> list[Edit]:
    """The values of credential names assigned in ``text``: ``password: X``, ``pw=X``,
    ``"api_key": "X"``, ``API key is X`` (after ``is``, a quoted value or one that is not a word).
    ``low``: ``text`` lowercased, :func:`_without_data_names`; ``marks``: those it holds."""
    edits: list[Edit] = []
    for mark in marks:
        at = low.find(mark)
        while at != -1:
            rest = _NAME_REST.match(text, at + len(mark))  # only a name followed by = : or "is"
            if rest is None:
                at = low.find(mark, at + len(mark))
                continue
            start, end = at, rest.end()
            while start and text[start - 1] in _NAME_CHARS:
                start -= 1
            at = low.find(mark, end)
            edit = _assigned(text, start, end, scan)
            if edit is not None:
                edits.append(edit)
    return edits


def _assigned(text: str, start: int, end: int, scan: bool) -> Edit | None:
    name = text[start:end]
    if not credential_name(name):
        if name.lower() not in _PAIRED:
            return None
        before = text[max(0, start - 16) : start]
        prev = before[:-1].rsplit(None, 1)[-1] if before.endswith(" ") and before.strip() else ""
        if not prev or not prev.isalpha() or not credential_name(f"{prev}_{name}"):  # "API key: X"
            return None
    after = _AFTER_QUOTED_NAME.match(text, end) or _AFTER_NAME.match(text, end)
    if after is None:
        return None
    closing, separator = after.groups()
    is_prose = separator.strip() in ("is", "was")
    at = after.end()
    quoted = _QUOTED.match(text, at)
    if quoted is not None and "\n" not in quoted.group(3):
        if not quoted.group(3) or quoted.group(3) in _NOTHING:
            return None
        return (quoted.start(3), quoted.end(3), REDACTED)
    if name[-6:].lower() in ("cookie", "ookies") and not is_prose:  # a header: every cookie
        cookies = _COOKIES.match(text, at)
        return None if cookies is None else (at, cookies.end(), REDACTED)
    if scan and at < len(text) and text[at] == "\\":
        return (at, at + 1, REDACTED)  # a value in escaped JSON text: read it decoded
    if at < len(text) and text[at] in "[{(":
        return (at, at + 1, REDACTED) if scan and not is_prose else None  # JSON: the key rule's
    bare = _BARE_VALUE.match(text, at)
    if bare is None:
        return None
    value = bare.group()
    if is_prose:
        value = value.rstrip(".!?")
        if value.isalpha():  # "the password is incorrect": a word after "is" is prose
            return None
    if (
        not value
        or value in _NOTHING
        or value == REDACTED
        or (separator.strip() == ":" and value.startswith("//"))
    ):
        return None
    if value[0] in "$%<{" or "(" in value or "[" in value:
        return None  # code or a placeholder: os.environ["PW"], get_pw(), $DB_PASS, <your-key>, ${PW}
    # an unquoted value after a quoted name (JSON text) stays a JSON string
    return (at, at + len(value), f"{closing}{REDACTED}{closing}" if closing else REDACTED)


#: A JSON string (its body in group 1); any text between strings is prose or JSON syntax.
_STRING = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"', re.S)
_KEY_SEPARATOR = re.compile(r"\s*:")
_SPACES = re.compile(r"\s*")
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|(.?))", re.S)
_ESCAPED = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_VALUE_SCALAR = re.compile(r"[^,}\]\s]*")
_BRACKETS = re.compile(r'[\[\]{}"]')
#: A name assigned by the text before a JSON string: ``password="x"``, ``secret: "x"``.
_ASSIGNED_BEFORE = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)['\"]?(?:\s*[=:]\s*|\s+(?:is|was)\s+)$")


class _Decoded:
    """A JSON string's body decoded, with where each decoded character came from."""

    def __init__(self, body: str) -> None:
        pieces: list[str] = []
        self.starts: list[int] = []  # decoded offset of each piece
        self.raw: list[tuple[int, int]] = []  # raw span of each piece; a literal run maps 1:1
        self.literal: list[bool] = []
        self.valid = True  # every backslash starts a JSON escape
        at = done = 0
        for m in _ESCAPE.finditer(body):
            if m.start() > done:
                self._piece(pieces, body[done : m.start()], at, done, m.start(), True)
                at += m.start() - done
            code, simple = m.groups()
            if not code and simple not in _ESCAPED:
                self.valid = False
                return
            self._piece(
                pieces, chr(int(code, 16)) if code else _ESCAPED[simple], at, m.start(), m.end(), False
            )
            at += 1
            done = m.end()
        if done < len(body):
            self._piece(pieces, body[done:], at, done, len(body), True)
        self.text = "".join(pieces)

    def _piece(self, pieces: list[str], text: str, at: int, start: int, end: int, literal: bool) -> None:
        pieces.append(text)
        self.starts.append(at)
        self.raw.append((start, end))
        self.literal.append(literal)

    def raw_span(self, start: int, end: int) -> tuple[int, int]:
        """The raw span holding decoded characters ``start`` to ``end`` (end exclusive, > start)."""
        i = bisect.bisect_right(self.starts, start) - 1
        j = bisect.bisect_right(self.starts, end - 1) - 1
        first = self.raw[i][0] + (start - self.starts[i] if self.literal[i] else 0)
        last = (
            self.raw[j][0] + (end - self.starts[j] if self.literal[j] else 0)
            if self.literal[j]
            else self.raw[j][1]
        )
        return first, last


def _string_edits(body: str, offset: int, env: list[str] | None) -> list[Edit]:
    """Edits of a JSON string's body found by reading it decoded (its text may be JSON too)."""
    decoded = _Decoded(body) if "\\" in body else None
    if decoded is None or not decoded.valid:  # read as it is
        return [(a + offset, b + offset, r) for a, b, r in _edits(body, env)]
    out = []
    for a, b, replacement in _edits(decoded.text, env):
        start, end = decoded.raw_span(a, b)
        out.append((start + offset, end + offset, json.dumps(replacement)[1:-1]))
    return out


def _value_end(text: str, at: int) -> int:
    """Where the JSON value starting at ``at`` ends (a string, an object or array at any depth, a
    scalar); text that is not JSON ends where it stops making sense."""
    if at >= len(text):
        return at
    first = text[at]
    if first == '"':
        m = _STRING.match(text, at)
        return m.end() if m else at
    if first not in "[{":
        return _VALUE_SCALAR.match(text, at).end()  # type: ignore[union-attr]
    depth = 0
    pos = at
    while True:
        m = _BRACKETS.search(text, pos)
        if m is None:
            return len(text)
        c = m.group()
        if c == '"':
            s = _STRING.match(text, m.start())
            pos = s.end() if s else m.end()
            continue
        depth += 1 if c in "[{" else -1
        pos = m.end()
        if depth == 0:
            return pos


class _Hits:
    """Where a scan of the raw text found marks: which spans of it need a closer look (all, when None)."""

    def __init__(self, found: list[Edit] | None) -> None:
        self.spans = sorted((a, b) for a, b, _ in found) if found is not None else None
        self.next = 0

    def touch(self, start: int, end: int) -> bool:
        """Whether ``text[start:end]`` holds or meets a mark (asked with ``start`` never decreasing)."""
        spans = self.spans
        if spans is None:
            return True
        while self.next < len(spans) and spans[self.next][1] < start:
            self.next += 1
        return self.next < len(spans) and spans[self.next][0] <= end


def _edits(text: str, env: list[str] | None = None, hits: _Hits | None = None) -> list[Edit]:
    """The credentials of ``text`` (JSON, JSON inside JSON strings, prose, or a mix: server-sent
    events, a tool's output), as edits: by form in strings and prose, and the whole value of every
    credential-named key, whatever its type (then ``"***"``, a string). ``hits``: the spans a scan
    found marks in; other strings are not looked into (keys are always read)."""
    if '"' not in text:
        return _text_edits(text, env)
    near = (hits or _Hits(None)).touch
    edits: list[Edit] = []
    pos = 0
    while True:
        m = _STRING.search(text, pos)
        gap_end = m.start() if m else len(text)
        if gap_end - pos >= _SHORTEST and near(pos, gap_end):
            edits += [(a + pos, b + pos, r) for a, b, r in _text_edits(text[pos:gap_end], env)]
        if m is None:
            return edits
        body = m.group(1)
        start, end = m.span()
        sep = _KEY_SEPARATOR.match(text, end)
        if sep is not None:  # a key
            if len(body) >= 2 and near(start, end):
                edits += _string_edits(body, start + 1, env)
            name = _Decoded(body).text if "\\" in body else body
            if credential_name(name):
                value_start = _SPACES.match(text, sep.end()).end()  # type: ignore[union-attr]
                value_end = _value_end(text, value_start)
                if text[value_start:value_end] not in _NOTHING and value_end > value_start:
                    edits.append((value_start, value_end, f'"{REDACTED}"'))
                pos = max(value_end, sep.end())
                continue
            pos = end
            continue
        if body and near(start, end):
            before = _ASSIGNED_BEFORE.search(text, max(0, start - 64), start)
            if before is not None and credential_name(before.group(1)):
                edits.append((start + 1, end - 1, REDACTED))
            elif len(body) >= _SHORTEST:
                edits += _string_edits(body, start + 1, env)
        pos = end


def _apply(text: str, edits: list[Edit]) -> str:
    """``text`` with ``edits`` made (overlapping ones joined into one)."""
    out = []
    done = 0
    for start, end, replacement in sorted(edits, key=lambda e: (e[0], -e[1])):
        if start < done:  # inside (or across) the last edit: widen it
            if end > done:
                done = end
            continue
        out.append(text[done:start])
        out.append(replacement)
        done = end
    out.append(text[done:])
    return "".join(out)


#: Escapes that can spell a character of a credential form (``\u0073k-``, ``https:\/\/``): the
#: strings holding one are read decoded.
_ESCAPED_MARK = re.compile(
    r"\\(?:u00(?:2[bdefBDEF]|3[0-9aAdD]|4[0-9a-fA-F]|5[0-9aAfF]|6[1-9a-fA-F]|7[0-9aA])|/)"
)


def _escaped_marks(text: str) -> list[Edit]:
    """Where an escape could spell a mark (a backslash that is itself escaped does not)."""
    out = []
    for m in _ESCAPED_MARK.finditer(text):
        at = m.start()
        while at and text[at - 1] == "\\":
            at -= 1
        if (m.start() - at) % 2 == 0:
            out.append((m.start(), m.end(), ""))
    return out


def _credential_edits(text: str, env: list[str]) -> list[Edit]:
    """The credentials of ``text`` (prose, JSON, JSON in JSON strings, a mix): a scan of the text
    as it is finds the marks of every form; only the JSON strings holding one (or an escape that
    could spell one) are then read decoded, and every key's name."""
    found = _text_edits(text, env, scan=True)
    if "\\" in text:
        found += _escaped_marks(text)
    return _edits(text, env, _Hits(found)) if found else []


def redact_json_bytes(raw: bytes) -> bytes:
    """A request or response body as it went over the wire (JSON or not, with any escapes, huge
    numbers, lone surrogates, NaN, any depth) with its credentials hidden: every credential found
    by its form, and the value of every credential-named key whatever its type, becomes ``***``
    (a JSON string where a value was); every other byte is kept. ``raw`` itself when it holds no
    credential: a scan of the bytes decides that in the common case."""
    text = raw.decode("latin-1")  # one character per byte: positions are byte offsets
    edits = _credential_edits(text, [secret.encode().decode("latin-1") for secret in environment_secrets()])
    if not edits:
        return raw
    return _apply(text, edits).encode("latin-1")


class _HiddenInLog(logging.Filter):
    """Log lines of rlreplay's logger with their secrets hidden (:func:`redact_value`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
            hidden = redact_value(message)
        except Exception:  # a log line that cannot be formatted is the logging module's to report
            return True
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


def hide_secrets_in_log(name: str = "rlreplay") -> None:
    """Hide secrets in every line logged through the logger ``name`` (once per logger)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _HiddenInLog) for f in logger.filters):
        logger.addFilter(_HiddenInLog())


hide_secrets_in_log()  # every module logs through "rlreplay", and each imports this one first
