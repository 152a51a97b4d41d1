"""Turn arbitrary call inputs and outputs into compact JSON, and snapshot them on the hot path.

Encoding runs on the writer thread and never raises. Conventions in the JSON:
token-id lists, numpy arrays and tensors become plain integer (or float) arrays;
values JSON cannot hold become objects with a ``__type__`` key
(``bytes``, ``float`` for NaN/inf, ``set``, ``repr``, ``cycle``, ``truncated``, ``error``).
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from rlreplay.format import redact as redaction

_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
_SCALARS = (str, int, bool, type(None))
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1  # orjson writes integers in [-2**63, 2**64)
MAX_DEPTH = 24
REPR_CHARS = 2000
PREVIEW_BYTES = 1024


def snapshot(value: Any) -> Any:
    """Copy what the caller may mutate after the call: lists, and lists inside dicts (one level);
    a pydantic model with its list, dict and model fields (verl changes its ``AgentLoopOutput`` in
    place once the agent loop has returned it)."""
    cls = type(value)
    if cls is list:
        return value.copy()
    if cls is dict:
        return {k: v.copy() if type(v) is list else v for k, v in value.items()}
    return _snapshot_model(value) if _is_model(cls) else value


_model_types: dict[type, bool] = {}


def _is_model(cls: type) -> bool:
    """A pydantic (v2) model class, told by its public API without importing pydantic."""
    known = _model_types.get(cls)
    if known is None:
        fields, copy = getattr(cls, "model_fields", None), getattr(cls, "model_copy", None)
        known = _model_types[cls] = isinstance(fields, dict) and callable(copy)
    return known


def _snapshot_model(value: Any) -> Any:
    update = {}
    for name in type(value).model_fields:
        field = getattr(value, name, None)
        cls = type(field)
        if cls is list or cls is dict:
            update[name] = snapshot(field)
        elif _is_model(cls):
            update[name] = field.model_copy()
    return value.model_copy(update=update)


def snapshot_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(map(snapshot, args)), {k: snapshot(v) for k, v in kwargs.items()}


def _type_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_tensor(value: Any) -> bool:
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "tolist")


def _repr_marker(value: Any) -> dict[str, str]:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not stop the recorder
        text = f"<repr failed: {type(exc).__name__}>"
    return {"__type__": "repr", "class": _type_name(value), "repr": text[:REPR_CHARS]}


def _plain_key(key: Any) -> bool:
    """A key orjson writes as a distinct JSON string."""
    cls = type(key)
    if cls is str or cls is bool:
        return True
    if cls is int:
        return _INT_MIN <= key <= _INT_MAX
    return cls is float and math.isfinite(key)


def _plain_numbers(value: list | tuple) -> type | None:
    """``int`` or ``float`` (the type of their sum) when every item is an int, or a finite float,
    that orjson writes exactly (C-speed check); else None."""
    try:
        total = sum(value)
    except Exception:  # strings, None, objects
        return None
    cls = type(total)
    return cls if cls is int or (cls is float and math.isfinite(total)) else None


class _Simplifier:
    """Walks containers once, making everything orjson can take; number lists pass through whole.

    ``strict`` also walks number lists item by item, catching integers orjson cannot write.
    ``redact`` applies the payload rules of ``redact_data`` in the same walk and counts, in
    ``token_ids``, the items of the result's lists under keys ending in ``ids`` (``prompt_ids``,
    ``token_ids``) reached through mappings alone.
    """

    def __init__(
        self,
        strict: bool = False,
        issues: list[str] | None = None,
        kinds: dict[int, Any] | None = None,
        redact: bool = False,
        numbers: Any = None,
    ) -> None:
        self.active: set[int] = set()
        self.strict = strict
        self.issues = issues if issues is not None else []
        self.kinds = kinds
        self.numbers = numbers
        self.redact = redact
        self.token_ids = 0
        self.in_items = 0  # how many lists (or sets) the walk is inside: ids count outside any

    def __call__(self, value: Any, depth: int = 0) -> Any:
        counted = self.token_ids
        try:
            return self._simplify(value, depth)
        except Exception as exc:  # a hostile value costs only itself
            self.token_ids = counted  # its marker holds no ids
            return self._failed(value, exc)

    def _failed(self, value: Any, exc: Exception) -> dict[str, str]:
        try:
            name = _type_name(value)
        except Exception:
            name = "?"
        message = f"{name}: {type(exc).__name__}: {_str(exc)}"[:REPR_CHARS]
        self.issues.append(message)
        return self._marker({"__type__": "error", "class": name, "error": message})

    def _marker(self, marker: dict[str, str]) -> Any:
        return redaction.redact_data(marker) if self.redact else marker

    def _items(self, value: Any, depth: int) -> list[Any]:
        self.in_items += 1
        try:
            return [self(v, depth + 1) for v in value]
        finally:
            self.in_items -= 1

    def _simplify(self, value: Any, depth: int) -> Any:
        cls = type(value)
        if cls is str:
            text = value if not self.strict else self._text(value)
            return redaction.redact_text(text) if self.redact else text
        if cls is bool or value is None:
            return value
        if cls is int:
            return value if not self.strict or _INT_MIN <= value <= _INT_MAX else _repr_marker(value)
        if cls is float:
            return value if math.isfinite(value) else {"__type__": "float", "value": repr(value)}
        if depth > MAX_DEPTH:
            return {"__type__": "repr", "class": _type_name(value), "repr": "<too deep>"}
        if cls is list or cls is tuple:
            if not value:
                return value
            if not self.strict:
                kind = None
                if self.numbers is not None and len(value) >= MIN_ARRAY:
                    kind = self.numbers(value)  # the caller's typed arrays, converted as they are checked
                if kind is None:
                    kind = _plain_numbers(value)
                if kind is not None:
                    if self.kinds is not None and len(value) >= MIN_ARRAY:
                        self.kinds[id(value)] = (value, kind)  # spares Arrays a second sum()
                    return value  # token ids, logprobs: orjson writes them in C
            return self._container(value, lambda: self._items(value, depth))
        if cls is dict:
            return self._container(value, lambda: self._dict(value, depth))
        if cls is bytes or cls is bytearray or cls is memoryview:
            return {"__type__": "bytes", "base64": base64.b64encode(bytes(value)).decode()}
        if cls is set or cls is frozenset:
            return self._container(value, lambda: self._set(value, depth))
        return self._object(value, depth)

    def _set(self, value: Any, depth: int) -> dict[str, Any]:
        items = self._items(value, depth)
        try:
            items.sort()
        except TypeError:
            items.sort(key=lambda v: orjson.dumps(v, default=str, option=orjson.OPT_NON_STR_KEYS))
        return {"__type__": "set", "items": items}

    def _text(self, value: str) -> str:
        safe = safe_text(value)
        if safe is not value:
            self.issues.append(f"a string that is not valid Unicode: {safe[:80]}")
        return safe

    def _dict(self, value: Mapping, depth: int) -> dict:
        out = {}
        for k, v in value.items():
            key = k if _plain_key(k) else "None" if k is None else _safe_repr(k)
            if self.strict and type(key) is str:
                key = self._text(key)
            counted = self.token_ids
            new = self(v, depth + 1)
            if self.redact:
                if redaction.hides(key, new):
                    new, self.token_ids = redaction.REDACTED, counted
                elif not self.in_items and type(new) is list and type(key) is str and key.endswith("ids"):
                    self.token_ids += len(new)
            out[key] = new
        return out

    def _container(self, value: Any, build: Any) -> Any:
        ident = id(value)
        if ident in self.active:
            return {"__type__": "cycle", "class": _type_name(value)}
        self.active.add(ident)
        try:
            return build()
        finally:
            self.active.discard(ident)

    def _object(self, value: Any, depth: int) -> Any:
        module = type(value).__module__
        if module.startswith("numpy") and hasattr(value, "tolist"):
            return self(value.tolist(), depth + 1)  # arrays and numpy scalars; NaN still marked
        if _is_tensor(value):
            data = value.detach().cpu().tolist() if hasattr(value, "detach") else value.tolist()
            return self(data, depth + 1)
        if isinstance(value, type):
            return self._marker(_repr_marker(value))
        if hasattr(value, "model_dump") and callable(value.model_dump):
            return self._container(value, lambda: self(_model_dump(value), depth + 1))
        if dataclasses.is_dataclass(value):
            fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
            return self._container(value, lambda: self._dict(fields, depth))
        if isinstance(value, Mapping):
            return self._container(value, lambda: self._dict(value, depth))
        if isinstance(value, tuple) and hasattr(value, "_asdict"):  # namedtuple
            return self._container(value, lambda: self._dict(value._asdict(), depth))
        if isinstance(value, (list, tuple, deque)):
            return self._container(value, lambda: self._items(value, depth))
        if isinstance(value, (bytes, bytearray)):
            return {"__type__": "bytes", "base64": base64.b64encode(bytes(value)).decode()}
        # subclasses of plain scalars (IntEnum, str subclasses): their plain value
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, int):
            return self(int(value), depth + 1)
        if isinstance(value, float):
            return self(float(value), depth + 1)
        if isinstance(value, str):
            text = str.__str__(value)
            return self(self._text(text) if self.strict else text, depth + 1)
        return self._marker(_repr_marker(value))


def _model_dump(value: Any) -> Any:
    try:
        return value.model_dump()
    except Exception:
        try:
            return dict(vars(value))
        except TypeError:
            return _repr_marker(value)


def _fallback(value: Any) -> Any:
    if _is_tensor(value):
        return value.tolist()
    return _repr_marker(value)


def _str(value: Any) -> str:
    try:
        return safe_text(str(value))
    except Exception:
        return "<str() failed>"


def _safe_repr(value: Any) -> str:
    try:
        return safe_text(repr(value))
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}>"


def safe_text(text: str) -> str:
    """``text`` itself when it is valid Unicode, else with lone surrogates written as ``\\udcff``."""
    if text.isascii():
        return text
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()


def to_jsonable(
    value: Any, strict: bool = False, issues: list[str] | None = None, kinds: dict[int, Any] | None = None
) -> Any:
    """The JSON-compatible form of ``value`` (never raises).

    A value that cannot be converted (its ``__iter__`` raises, a tensor without data) becomes an
    ``error`` marker, alone; each is described in ``issues``. ``strict`` also checks every string
    and integer (lone surrogates are written escaped). ``kinds`` (for ``Arrays``) collects the
    number lists kept as they are, with the type of their sum.
    """
    return _Simplifier(strict, issues, kinds)(value)


def to_payload(
    value: Any,
    issues: list[str] | None = None,
    kinds: dict[int, Any] | None = None,
    numbers: Callable[[list | tuple], type | None] | None = None,
) -> tuple[Any, int]:
    """``redact_data(to_jsonable(value))`` in one walk, and its token id count (the items of its
    lists under keys ending in ``ids``, reached through mappings alone).

    ``numbers`` (optional) is asked first about each list of at least ``MIN_ARRAY`` items: ``int``
    when it found every item an int (ints and bools, as the ``sum()`` check would), None to have
    the list checked as usual. It lets a caller convert an id list in the one pass that checks it."""
    walk = _Simplifier(False, issues, kinds, redact=True, numbers=numbers)
    data = walk(value)
    return data, walk.token_ids


def encode(value: Any, max_field_bytes: int | None = None) -> str:
    """JSON text for ``value``; top-level fields over ``max_field_bytes`` become a visible marker."""
    return dumps(to_jsonable(value), max_field_bytes)


def _dumps_bytes(data: Any, issues: list[str] | None = None) -> bytes:
    try:
        return orjson.dumps(data, default=_fallback, option=_ORJSON_OPTS)
    except Exception:
        # a lone surrogate, an integer beyond 64 bits: walk everything, fixing only those values
        return orjson.dumps(
            to_jsonable(data, strict=True, issues=issues), default=_fallback, option=_ORJSON_OPTS
        )


def dumps(data: Any, max_field_bytes: int | None = None, issues: list[str] | None = None) -> str:
    """JSON text for data already made JSON-compatible by ``to_jsonable`` (never raises).

    With ``max_field_bytes``, a top-level field (or the whole value, if it is not an object)
    whose JSON is larger becomes a ``truncated`` marker carrying its size and a preview.
    """
    try:
        text = _dumps_bytes(data, issues)
        if max_field_bytes is not None and len(text) > max_field_bytes:
            if isinstance(data, dict):
                text = _dumps_bytes({k: cap_field(v, max_field_bytes) for k, v in data.items()}, issues)
            else:
                text = _dumps_bytes(_truncated(text, max_field_bytes))
        return text.decode()
    except Exception as exc:
        message = f"{type(exc).__name__}: {_str(exc)}"[:REPR_CHARS]
        if issues is not None:
            issues.append(message)
        return orjson.dumps({"__type__": "error", "error": message}).decode()


def _truncated(text: bytes, max_bytes: int) -> dict[str, Any]:
    preview = text[: max(0, min(max_bytes, PREVIEW_BYTES) - 1)].decode(errors="ignore")
    return {"__type__": "truncated", "bytes": len(text), "preview": preview}


def cap_field(value: Any, max_bytes: int) -> Any:
    """``value`` unchanged if its JSON fits in ``max_bytes``, else a ``truncated`` marker with a preview."""
    try:
        text = _dumps_bytes(value)
    except Exception:
        return value
    return value if len(text) <= max_bytes else _truncated(text, max_bytes)


def decode(text: str | bytes | None) -> Any:
    if text is None:
        return None
    return orjson.loads(text)


def decode_safe(text: str | bytes | None) -> tuple[Any, str | None]:
    """(decoded value, None), or (an ``error`` marker, why) when the text is not JSON."""
    try:
        return decode(text), None
    except (orjson.JSONDecodeError, TypeError) as exc:
        why = f"unreadable payload ({_str(exc)[:120]})"
        return {"__type__": "error", "error": why}, why


TOKENS = "tokens"
#: Number lists shorter than this stay in the JSON text.
MIN_ARRAY = 64
#: A stretch shorter than this is stored rather than referenced.
MIN_SHARED = 64
