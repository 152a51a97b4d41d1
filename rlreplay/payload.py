"""Turn arbitrary call inputs and outputs into compact JSON, and snapshot them on the hot path.

Encoding runs on the writer thread and never raises. Conventions in the JSON:
token-id lists, numpy arrays and tensors become plain integer (or float) arrays;
values JSON cannot hold become objects with a ``__type__`` key
(``bytes``, ``float`` for NaN/inf, ``set``, ``repr``, ``cycle``, ``truncated``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import math
from typing import Any

import orjson

_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
_SCALARS = (str, int, bool, type(None))
MAX_DEPTH = 24
REPR_CHARS = 2000


def snapshot(value: Any) -> Any:
    """Copy what the caller may mutate after the call: lists, and lists inside dicts (one level)."""
    cls = type(value)
    if cls is list:
        return value.copy()
    if cls is dict:
        return {k: v.copy() if type(v) is list else v for k, v in value.items()}
    return value


def snapshot_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(map(snapshot, args)), {k: snapshot(v) for k, v in kwargs.items()}


def _type_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_tensor(value: Any) -> bool:
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "tolist")


class _Simplifier:
    """Walks containers once, making everything orjson can take; lists of scalars pass through."""

    def __init__(self) -> None:
        self.active: set[int] = set()

    def __call__(self, value: Any, depth: int = 0) -> Any:
        cls = type(value)
        if cls in _SCALARS:
            return value
        if cls is float:
            return value if math.isfinite(value) else {"__type__": "float", "value": repr(value)}
        if depth > MAX_DEPTH:
            return {"__type__": "repr", "class": _type_name(value), "repr": "<too deep>"}
        if cls is list or cls is tuple:
            if not value or (type(value[0]) in (int, str) and type(value[-1]) in (int, str)):
                return value  # token ids and strings: orjson handles them in C
            return self._container(value, depth, lambda: [self(v, depth + 1) for v in value])
        if cls is dict:
            return self._container(value, depth, lambda: self._dict(value, depth))
        if cls is bytes or cls is bytearray:
            return {"__type__": "bytes", "base64": base64.b64encode(value).decode()}
        if cls is set or cls is frozenset:
            items = [self(v, depth + 1) for v in value]
            with contextlib.suppress(TypeError):
                items.sort()
            return {"__type__": "set", "items": items}
        return self._object(value, depth)

    def _dict(self, value: dict, depth: int) -> dict:
        out = {}
        for k, v in value.items():
            key = k if type(k) in _SCALARS or type(k) is float else repr(k)
            out[key] = self(v, depth + 1)
        return out

    def _container(self, value: Any, depth: int, build: Any) -> Any:
        ident = id(value)
        if ident in self.active:
            return {"__type__": "cycle", "class": _type_name(value)}
        self.active.add(ident)
        try:
            return build()
        finally:
            self.active.discard(ident)

    def _object(self, value: Any, depth: int) -> Any:
        if hasattr(value, "__array__") and type(value).__module__.startswith("numpy"):
            return value.tolist()
        if _is_tensor(value):
            return value.detach().cpu().tolist() if hasattr(value, "detach") else value.tolist()
        if hasattr(value, "model_dump") and callable(value.model_dump):
            return self._container(value, depth, lambda: self(_model_dump(value), depth + 1))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return self._container(value, depth, lambda: self._dict(fields, depth))
        if isinstance(value, (int, float, str)):  # subclasses such as IntEnum, numpy scalars
            return self(value.item() if hasattr(value, "item") else value, depth)
        try:
            text = repr(value)
        except Exception as exc:  # a broken __repr__ must not stop the recorder
            text = f"<repr failed: {type(exc).__name__}>"
        return {"__type__": "repr", "class": _type_name(value), "repr": text[:REPR_CHARS]}


def _model_dump(value: Any) -> Any:
    try:
        return value.model_dump()
    except Exception:
        return dict(vars(value)) if hasattr(value, "__dict__") else repr(value)


def _fallback(value: Any) -> Any:
    if _is_tensor(value):
        return value.tolist()
    return {"__type__": "repr", "class": _type_name(value), "repr": repr(value)[:REPR_CHARS]}


def to_jsonable(value: Any) -> Any:
    """The JSON-compatible form of ``value`` (never raises)."""
    try:
        return _Simplifier()(value)
    except Exception as exc:
        return {"__type__": "error", "error": f"{type(exc).__name__}: {exc}"[:REPR_CHARS]}


def encode(value: Any, max_field_bytes: int | None = None) -> str:
    """JSON text for ``value``; top-level fields over ``max_field_bytes`` become a visible marker."""
    return dumps(to_jsonable(value), max_field_bytes)


def dumps(data: Any, max_field_bytes: int | None = None) -> str:
    """JSON text for data already made JSON-compatible by ``to_jsonable``."""
    if max_field_bytes is not None and isinstance(data, dict):
        data = {k: cap_field(v, max_field_bytes) for k, v in data.items()}
    try:
        return orjson.dumps(data, default=_fallback, option=_ORJSON_OPTS).decode()
    except Exception as exc:
        return orjson.dumps({"__type__": "error", "error": f"{type(exc).__name__}: {exc}"}).decode()


def cap_field(value: Any, max_bytes: int) -> Any:
    """``value`` unchanged if its JSON fits in ``max_bytes``, else a ``truncated`` marker with a preview."""
    try:
        text = orjson.dumps(value, default=_fallback, option=_ORJSON_OPTS)
    except Exception:
        return value
    if len(text) <= max_bytes:
        return value
    preview = text[: max(0, min(max_bytes, 1024) - 1)].decode(errors="ignore")
    return {"__type__": "truncated", "bytes": len(text), "preview": preview}


def decode(text: str | bytes | None) -> Any:
    if text is None:
        return None
    return orjson.loads(text)


def count_token_ids(value: Any) -> int:
    """Integer ids in top-level token-looking lists of an encoded payload (``*_ids``, ``token_ids``)."""
    total = 0
    if isinstance(value, dict):
        for key, v in value.items():
            if isinstance(key, str) and key.endswith("ids") and isinstance(v, list):
                total += len(v)
            elif isinstance(v, dict):
                total += count_token_ids(v)
    return total
