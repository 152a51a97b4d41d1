"""Keeping secrets out of manifests, span payloads, ledgers and output: redaction by rule.

A *secret name* is an option, argument, variable, header or keyword name whose words (split at
``-``, ``_``, ``.``, ``:`` and camelCase) include ``secret``, ``credential(s)``, or contain
``password``, ``passwd`` or ``passphrase`` (``PGPASSWORD``), or end in ``key``, ``apikey``,
``token``, ``pat``, ``auth``, ``authorization``, ``oauth``, ``pass`` or ``cookie(s)``. A ``key``
that names data (``prompt_key``, ``image_key``: a dataset column) is not a secret, nor is a
keyword argument named just ``key`` (a lookup key; ``--key`` on a command line is a secret,
``key=X`` without dashes is not: ``pytest -o key=value``); ``max_tokens``, ``tokenizer_path``,
``--passes`` and ``bypass`` are not either.

What is hidden (replaced by ``***``), in command lines, messages and log lines
(:func:`redact_argv`, :func:`redact_value`):
- the value of a secret name: ``--key X``, ``--api-key=X``, ``--pass X``, ``wandb_key=X``,
  ``PGPASSWORD=X``, ``KEY:X``, ``Authorization: Bearer X``, ``{"api_key": X}``;
- every cookie of a ``Cookie:`` or ``Set-Cookie:`` header;
- the value of the short option ``-p`` (``-p X``, ``-pX``) in the command lines of programs
  whose ``-p`` is a password (mysql, mariadb, docker, podman, sshpass, the mongo tools); for
  every other program (``pytest -p no:cacheprovider``, ``ssh -p 2222``) it is kept;
- the user and password of a URL (``https://user:pw@host`` → ``https://***@host``) and URL
  query parameters with secret names;
- ``Bearer``/``Basic`` credentials, and values shaped like well-known keys (``sk-…``, ``hf_…``,
  ``ghp_…``, ``github_pat_…``, ``xox…-``, ``AKIA…``, JWTs, a standalone 40-hex string);
- the value of every environment variable with a secret name (6 characters or more), wherever
  it appears in the text.

In payload strings (inputs, outputs, attributes and errors of traced calls, :func:`redact_text`)
the same, but for prose: a bare ``key:`` (``Answer key: B``) and a number after a secret name
(``token: 5``) are kept, ``Bearer`` counts only capitalized and followed by a credential, and
``basic``/``token`` before a word are not credentials (``basic arithmetic``); a 40-hex string
is kept (a commit). Mappings hide the value of a secret-named key whole (numbers excepted).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

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
#: In payloads: shaped keys, not a 40-hex string (a commit in a tool's output).
_PAYLOAD_VALUE = re.compile(_SHAPED_KEY)
_SCHEME_AUTH = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{6,}")
_BEARER = re.compile(r"\b(Bearer)(\s+)[A-Za-z0-9._~+/=-]{8,}")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_QUERY = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
#: A Cookie or Set-Cookie header: every cookie on its line.
_COOKIE = re.compile(r"(?i)\b((?:set-)?cookie)([\"']?\s*[:=]\s*)([^\r\n]+)")
# name=value / name: value inside a longer text (a header, an env assignment, a config line)
_ASSIGNMENT = re.compile(
    r"(?<![\w.-])([\"']?)(-{0,2}[A-Za-z_][\w.-]*)\1(\s*[=:]\s*)(?!//)"
    r"(\"[^\"]*\"|'[^']*'|(?:(?i:bearer|basic|token)\s+)?[^\s\"',;&}\]]+)"
)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
#: No text shorter than this holds a secret by these rules (``pat=XY``; a variable's value has 6).
_SHORTEST = 6
#: The shortest shaped key (``hf_`` and 16 characters).
_SHORTEST_KEY = 19


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
    return _SECRET_VALUE.sub(REDACTED, text)


def _hide_assignment(m: re.Match[str], prose: bool = False) -> str:
    quote, name, sep, value = m.groups()
    if not secret_name(name, bare_key=not prose) or (prose and _NUMBER.fullmatch(value.strip("\"'"))):
        return m.group(0)
    hidden = f"{value[0]}{REDACTED}{value[0]}" if value[0] in "\"'" else REDACTED
    return f"{quote}{name}{quote}{sep}{hidden}"


def _hide_prose_assignment(m: re.Match[str]) -> str:
    return _hide_assignment(m, prose=True)


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
    """``value`` (a payload: mappings, lists, strings, numbers) under the rules of
    :func:`redact_mapping`, at any depth; number lists (token ids, log-probs) are never looked
    into, and what needs no change is returned as it is (the same object)."""
    return _redact_any(value, set())


def redact_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with the value of every secret name hidden (numbers excepted), at any
    depth, and URLs stripped of their user and password (other text is left as it is). Values
    that need no change are kept as they are (same objects, same types); cycles are fine."""
    out = _redact_any(data, set())
    return dict(out) if out is data or not isinstance(out, dict) else out


def hides(key: Any, value: Any) -> bool:
    """Whether a mapping's ``value`` under ``key`` is hidden whole (a secret name, a value to hide)."""
    if value is None or type(value) in _PLAIN or (type(value) is str and not value):
        return False  # nothing to hide, and counts stay readable
    return type(key) is str and secret_name(key, bare_key=False)


_PLAIN = frozenset({bool, int, float})


def redact_text(value: str, env: list[str] | None = None) -> str:
    """A payload string with its secrets hidden by the payload rules (the module docstring);
    ``value`` itself when unchanged. ``env``: :func:`environment_secrets`, when the caller has
    them. It runs on the recorder's writer thread for every string of every span: each rule
    first looks for its mark with C-speed substring searches, and runs only where one is found."""
    if len(value) < _SHORTEST:
        return value
    text = value
    for secret in environment_secrets() if env is None else env:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if text.isidentifier():  # a word or a name (most keys and values): only a shaped key fits
        if len(text) >= _SHORTEST_KEY and _may_hold_shaped_key(text):
            text = _PAYLOAD_VALUE.sub(REDACTED, text)
        return value if text == value else text
    if "://" in text:
        text = redact_url(text)
    if "ookie" in text or "OOKIE" in text:
        text = _hide_cookies(text)
    if ("=" in text or ":" in text) and _secret_name_before_separator(text):
        text = _ASSIGNMENT.sub(_hide_prose_assignment, text)
    if "Bearer" in text:
        text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    if _may_hold_shaped_key(text):
        text = _PAYLOAD_VALUE.sub(REDACTED, text)
    return value if text == value else text


#: The words a secret name holds, and what must follow one for it to be assigned a value.
_SECRET_WORDS = ("pass", "secret", "credential", "key", "token", "pat", "auth", "cookie")
_THEN_SEPARATOR = re.compile(r"[\w.-]*[\"']?[ \t]*[=:]")
#: Each shaped key's fixed start, and what follows it (a substring search finds the start first).
_SHAPED_STARTS = (
    ("sk-", re.compile(r"sk-[A-Za-z0-9_-]{16}")),
    ("hf_", re.compile(r"hf_[A-Za-z0-9]{16}")),
    ("gh", re.compile(r"gh[pousr]_")),
    ("github_pat_", None),
    ("xox", re.compile(r"xox[abprs]-")),
    ("AKIA", re.compile(r"AKIA[0-9A-Z]{16}")),
    ("eyJ", re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.")),
)


def _secret_name_before_separator(text: str) -> bool:
    """Whether one of the secret words stands in a name followed by ``=`` or ``:`` (then the
    full assignment rule runs; prose rarely has one)."""
    lower = text.lower()
    for word in _SECRET_WORDS:
        at = lower.find(word)
        while at != -1:
            if _THEN_SEPARATOR.match(lower, at + len(word)):
                return True
            at = lower.find(word, at + 1)
    return False


def _may_hold_shaped_key(text: str) -> bool:
    for start, rest in _SHAPED_STARTS:
        if start in text and (rest is None or rest.search(text) is not None):
            return True
    return False


def _numbers_only(value: list | tuple) -> bool:
    """Whether every item is a number (summed at C speed: no walk over token ids)."""
    try:
        sum(value)
    except Exception:
        return False
    return True


def _redact_any(value: Any, seen: set[int]) -> Any:
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
            new = REDACTED if hides(k, v) else _redact_any(v, seen)
            key = redact_text(k) if type(k) is str else k
            changed = changed or new is not v or key is not k
            out[key] = new
        return out if changed else value
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        if not value or id(value) in seen or (type(value[0]) in _PLAIN and _numbers_only(value)):
            return value  # token ids, log-probs: no names, no URLs
        seen.add(id(value))
        items = [_redact_any(v, seen) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


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
