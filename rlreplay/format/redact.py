"""Keeping secrets out of manifests, span payloads, ledgers and output: redaction by rule.

A *secret name* is an option, argument, variable, header or keyword name whose words (split at
``-``, ``_``, ``.``, ``:`` and camelCase) include ``secret``, ``password``, ``passwd``,
``passphrase`` or ``credential(s)``, or end in ``key``, ``apikey``, ``token``, ``pat``, ``auth``
or ``authorization``. A ``key`` that names data (``prompt_key``, ``image_key``: a dataset
column) is not a secret, nor is a keyword argument named just ``key`` (a lookup key; ``--key``
on a command line is a secret, ``key=X`` without dashes is not: ``pytest -o key=value``);
``max_tokens`` and ``tokenizer_path`` are not either.

What is hidden (replaced by ``***``):
- the value of a secret name: ``--key X``, ``--api-key=X``, ``wandb_key=X``, ``KEY:X``,
  ``Authorization: Bearer X``, ``{"api_key": X}``;
- the value of the short option ``-p`` (``-p X``, ``-pX``) in the command lines of programs
  whose ``-p`` is a password (mysql, mariadb, docker, podman, sshpass, the mongo tools); for
  every other program (``pytest -p no:cacheprovider``, ``ssh -p 2222``) it is kept;
- the user and password of a URL (``https://user:pw@host`` → ``https://***@host``) and URL
  query parameters with secret names;
- ``Bearer``/``Basic`` credentials, and values shaped like well-known keys (``sk-…``, ``hf_…``,
  ``ghp_…``, ``github_pat_…``, ``xox…-``, ``AKIA…``, JWTs, a standalone 40-hex string);
- the value of every environment variable with a secret name (6 characters or more), wherever
  it appears in the text.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_ANYWHERE = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials"})
_LAST = frozenset({"key", "apikey", "token", "pat", "auth", "authorization"})
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

_SECRET_VALUE = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})\b"
    r"|(?<![/\w@.-])[0-9a-f]{40}(?![/\w])"
)
_SCHEME_AUTH = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{6,}")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_QUERY = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
# name=value / name: value inside a longer text (a header, an env assignment, a config line)
_ASSIGNMENT = re.compile(
    r"(?<![\w.-])([\"']?)([A-Za-z_][\w.-]*)\1(\s*[=:]\s*)(?!//)"
    r"(\"[^\"]*\"|'[^']*'|(?:(?i:bearer|basic|token)\s+)?[^\s\"',;&}\]]+)"
)


@functools.lru_cache(maxsize=4096)
def secret_name(name: str, bare_key: bool = True) -> bool:
    """Whether ``name`` (an option, variable, header or keyword name) names a secret.

    ``bare_key``: whether ``key`` alone counts (``--key X`` on a command line does; a Python
    keyword argument ``key=`` is a lookup key, so ``redact_mapping`` passes False)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if not words:
        return False
    if any(w in _ANYWHERE for w in words):
        return True
    last = words[-1]
    if last not in _LAST:
        return False
    if last == "key" and len(words) == 1:
        return bare_key
    return not (last == "key" and words[-2] in _DATA_KEY)


def _env_secrets() -> list[str]:
    values = {v for k, v in os.environ.items() if len(v) >= 6 and secret_name(k)}
    return sorted(values, key=len, reverse=True)


def redact_url(url: str) -> str:
    """``url`` without its user and password and with secret query parameters hidden."""
    out = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", url)
    if "?" in out:
        out = _QUERY.sub(
            lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if secret_name(m.group(2)) else m.group(0), out
        )
    return out


def redact_value(text: str) -> str:
    """``text`` with every secret the rules recognize hidden (see the module docstring)."""
    for secret in _env_secrets():
        text = text.replace(secret, REDACTED)
    text = redact_url(text)
    text = _ASSIGNMENT.sub(_hide_assignment, text)
    text = _SCHEME_AUTH.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return _SECRET_VALUE.sub(REDACTED, text)


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
        if option and not eq and secret_name(name):
            out.append(arg)
            hide_next = True
            continue
        if eq and secret_name(name, bare_key=option):
            out.append(f"{name}={REDACTED}")
            continue
        out.append(f"{name}={redact_value(value)}" if eq and _NAME.fullmatch(name) else redact_value(arg))
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


def redact_text(value: str) -> str:
    """A payload string with a URL's user and password hidden; ``value`` itself when unchanged."""
    if "://" not in value or "@" not in value:
        return value
    new = redact_url(value)
    return value if new == value else new


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
            changed = changed or new is not v
            out[k] = new
        return out if changed else value
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        if not value or type(value[0]) in _PLAIN or id(value) in seen:
            return value  # token ids, log-probs: no names, no URLs
        seen.add(id(value))
        items = [_redact_any(v, seen) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value
