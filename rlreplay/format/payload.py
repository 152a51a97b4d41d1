"""Turn arbitrary call inputs and outputs into compact JSON, snapshot them on the hot path, and
turn the JSON back into the values.

Encoding runs on the writer thread and never raises. Conventions in the JSON (the *JSON form*):
token-id lists, numpy arrays and tensors become plain integer (or float) arrays; values JSON
cannot hold become *markers*, objects with a ``__type__`` key: ``float`` (NaN and ±inf; a NaN
other than the usual one also keeps its ``bits``), ``int`` (beyond 64 bits, as text), ``bytes``
(base64), ``set``, and, for what is not kept as it was, ``repr``, ``cycle``, ``truncated`` (a field
over the size limit), ``error``, ``exception`` (what a failed call raised). An object with a
``__type__`` key is always a marker: the op's own dict that has one is written wrapped,
``{"__type__": "dict", "value": {...}}``, so that no data is mistaken for a marker.

What the JSON form does not say, the *type record* of an output does (:func:`to_payload`'s
``types``): JSON pointer → the qualified class of the value there (tuples, frozensets, a framework's
models, numpy arrays, ...), or a loss (``~redacted``, ``~keys``, ``~text``, ``~reduced``); the output
itself (``""``) is always there. :func:`from_json` gives the value back from both, exactly, or
raises :class:`NotExact` saying what was not kept.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson
import pybase64

from rlreplay.errors import NotExact
from rlreplay.format import redact as redaction

_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
_SCALARS = (str, int, bool, type(None))
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1  # orjson writes integers in [-2**63, 2**64)
MAX_DEPTH = 24
REPR_CHARS = 2000
PREVIEW_BYTES = 1024

#: The key that makes an object a marker.
MARKER = "__type__"
#: The marker that wraps an op's own dict holding a ``__type__`` key.
ESCAPED = "dict"
#: The span attribute holding an output's type record.
OUTPUT_TYPE = "output_type"
#: Losses a type record names (not classes): a value hidden by redaction, dict keys that were not
#: strings, a string that was not valid Unicode, an output recorded through ``reduce_output``.
REDACTED, KEYS_LOST, TEXT_ESCAPED, REDUCED = "~redacted", "~keys", "~text", "~reduced"
_CANONICAL_NAN = struct.unpack("<Q", struct.pack("<d", math.nan))[0]
#: Integers of more bits are written in hex: Python limits decimal conversions to 4,300 digits.
_DECIMAL_BITS = 13000


def unwrapped(value: Any) -> Any:
    """An op's own dict inside its ``{"__type__": "dict", "value": {...}}`` wrapper; any other
    value as it is (for readers that look up the op's own fields)."""
    if type(value) is dict and value.get(MARKER) == ESCAPED and type(value.get("value")) is dict:
        return value["value"]
    return value


class Marker(dict):
    """A marker rlreplay makes (``{"__type__": ...}``): written as it is, never wrapped as data."""

    __slots__ = ()


def float_marker(value: float) -> Marker:
    """The ``float`` marker of a NaN or an infinity (a NaN other than the usual one keeps its bits)."""
    marker = Marker(__type__="float", value=repr(value))
    if value != value:
        bits = struct.unpack("<Q", struct.pack("<d", value))[0]
        if bits != _CANONICAL_NAN:
            marker["bits"] = f"{bits:016x}"
    return marker


def _int_marker(value: int) -> Marker:
    return Marker(__type__="int", value=str(value) if value.bit_length() <= _DECIMAL_BITS else hex(value))


def _bytes_marker(value: Any) -> Marker:
    return Marker(__type__="bytes", base64=pybase64.b64encode_as_string(bytes(value)))


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


def _repr_marker(value: Any) -> Marker:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not stop the recorder
        text = f"<repr failed: {type(exc).__name__}>"
    return Marker(__type__="repr", **{"class": _type_name(value), "repr": text[:REPR_CHARS]})


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


#: Mapping keys found holding no secret (by the rules that need no environment variable).
_CLEAN_KEYS: set[str] = set()
_CLEAN_KEYS_MAX = 4096


class _Simplifier:
    """Walks containers once, making everything orjson can take; number lists pass through whole.

    ``strict`` also walks number lists item by item, catching integers orjson cannot write.
    ``redact`` applies the payload rules of ``redact_data`` in the same walk and counts, in
    ``token_ids``, the items of the result's lists under keys ending in ``ids`` (``prompt_ids``,
    ``token_ids``) reached through mappings alone. ``escape`` wraps the value's own dicts that hold
    a ``__type__`` key (off for data that is already a JSON form). ``types`` (a list) collects the
    type record's entries, ``[path reversed, type]``, the path filled in as the walk unwinds.
    """

    def __init__(
        self,
        strict: bool = False,
        issues: list[str] | None = None,
        kinds: dict[int, Any] | None = None,
        redact: bool = False,
        numbers: Any = None,
        escape: bool = True,
        types: list[list[Any]] | None = None,
    ) -> None:
        self.active: set[int] = set()
        self.strict = strict
        self.issues = issues if issues is not None else []
        self.kinds = kinds
        self.numbers = numbers
        self.redact = redact
        self.env = redaction.environment_secrets() if redact else []  # looked up once per walk
        self.escape = escape
        self.types = types
        self.token_ids = 0
        self.in_items = 0  # how many lists (or sets) the walk is inside: ids count outside any

    def __call__(self, value: Any, depth: int = 0) -> Any:
        counted = self.token_ids
        try:
            return self._simplify(value, depth)
        except Exception as exc:  # a hostile value costs only itself
            self.token_ids = counted  # its marker holds no ids
            # type entries it left lie at or under its error marker, which from_json refuses first
            return self._failed(value, exc)

    def _note(self, kind: str) -> None:
        """The value being walked is not what its JSON form says: record ``kind`` at its path."""
        if self.types is not None:
            self.types.append([[], kind])

    def _under(self, noted: int, *keys: Any) -> None:
        """Entries noted since ``noted`` lie under ``keys`` (outermost last)."""
        for entry in self.types[noted:]:  # type: ignore[index]
            entry[0].extend(keys)

    def _failed(self, value: Any, exc: Exception) -> dict[str, str]:
        try:
            name = _type_name(value)
        except Exception:
            name = "?"
        message = f"{name}: {type(exc).__name__}: {_str(exc)}"[:REPR_CHARS]
        self.issues.append(message)
        return self._marker(Marker(__type__="error", **{"class": name, "error": message}))

    def _marker(self, marker: Marker) -> Any:
        if not self.redact:
            return marker
        out = redaction.redact_data(marker)
        return out if type(out) is Marker else Marker(out)

    def _items(self, value: Any, depth: int) -> list[Any]:
        self.in_items += 1
        try:
            if self.types is None:
                return [self(v, depth + 1) for v in value]
            out = []
            for i, v in enumerate(value):
                noted = len(self.types)
                out.append(self(v, depth + 1))
                if len(self.types) > noted:
                    self._under(noted, i)
            return out
        finally:
            self.in_items -= 1

    def _simplify(self, value: Any, depth: int) -> Any:
        cls = type(value)
        if cls is str:
            text = value if not self.strict else self._text(value)
            if self.types is not None and not text.isascii() and safe_text(text) is not text:
                self._note(TEXT_ESCAPED)
            if not self.redact or len(text) < 6:  # no secret by the rules is shorter
                return text
            shown = redaction.redact_text(text, self.env)
            if shown is not text and self.types is not None:
                self._note(REDACTED)
            return shown
        if cls is bool or value is None:
            return value
        if cls is int:
            return value if not self.strict or _INT_MIN <= value <= _INT_MAX else _int_marker(value)
        if cls is float:
            return value if math.isfinite(value) else float_marker(value)
        if depth > MAX_DEPTH:
            return Marker(__type__="repr", **{"class": _type_name(value), "repr": "<too deep>"})
        if cls is list or cls is tuple:
            if cls is tuple:
                self._note("builtins.tuple")
            if not value:
                return [] if cls is tuple else value
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
            if self.escape and MARKER in value:
                return self._escaped(value, depth)
            return self._container(value, lambda: self._dict(value, depth))
        if cls is Marker:  # made by rlreplay: kept a marker, its values walked
            return self._container(value, lambda: Marker(self._dict(value, depth)))
        if cls is bytes:
            return _bytes_marker(value)
        if cls is bytearray or cls is memoryview:
            self._note(_type_name(value))
            return _bytes_marker(value)
        if cls is set or cls is frozenset:
            if cls is frozenset:
                self._note("builtins.frozenset")
            return self._container(value, lambda: self._set(value, depth))
        return self._object(value, depth)

    def _escaped(self, value: Any, depth: int) -> Marker:
        """An op's own mapping with a ``__type__`` key, wrapped so that no reader takes it for a marker."""
        noted = len(self.types) if self.types is not None else 0
        inner = self._container(value, lambda: self._dict(value, depth))
        if self.types is not None and len(self.types) > noted:
            self._under(noted, "value")
        return Marker(__type__=ESCAPED, value=inner)

    def _set(self, value: Any, depth: int) -> Marker:
        noted = len(self.types) if self.types is not None else 0
        self.in_items += 1
        try:
            pairs = []  # (item, its type entries): sorted together
            for v in value:
                before = len(self.types) if self.types is not None else 0
                item = self(v, depth + 1)
                entries = self.types[before:] if self.types is not None else []
                pairs.append((item, entries))
        finally:
            self.in_items -= 1
        try:
            pairs.sort(key=lambda p: p[0])
        except TypeError:
            pairs.sort(key=lambda p: orjson.dumps(p[0], default=str, option=orjson.OPT_NON_STR_KEYS))
        if self.types is not None:
            del self.types[noted:]
            for i, (_, entries) in enumerate(pairs):
                for entry in entries:
                    entry[0].extend((i, "items"))
                    self.types.append(entry)
        return Marker(__type__="set", items=[item for item, _ in pairs])

    def _text(self, value: str) -> str:
        safe = safe_text(value)
        if safe is not value:
            self.issues.append(f"a string that is not valid Unicode: {safe[:80]}")
        return safe

    def _dict(self, value: Mapping, depth: int) -> dict:
        out = {}
        types, redact = self.types, self.redact
        for k, v in value.items():
            if type(k) is str:
                key = k
            else:
                key = k if _plain_key(k) else "None" if k is None else _safe_repr(k)
                self._note(KEYS_LOST)
            if self.strict and type(key) is str:
                key = self._text(key)
            if redact and type(key) is str and (self.env or key not in _CLEAN_KEYS):
                hidden = redaction.redact_text(key, self.env)
                if hidden is key and not self.env and len(_CLEAN_KEYS) < _CLEAN_KEYS_MAX:
                    _CLEAN_KEYS.add(key)  # keys recur in every span: each is looked at once
                elif hidden is not key and types is not None:
                    self._note(REDACTED)
                key = hidden
            if not redact and types is None:
                out[key] = self(v, depth + 1)
                continue
            counted = self.token_ids
            noted = len(types) if types is not None else 0
            new = self(v, depth + 1)
            if redact:
                if redaction.hides(key, new):
                    new, self.token_ids = redaction.REDACTED, counted
                    if types is not None:
                        del types[noted:]
                        self._note(REDACTED)
                elif not self.in_items and type(new) is list and type(key) is str and key.endswith("ids"):
                    self.token_ids += len(new)
            if types is not None and len(types) > noted:
                self._under(noted, key if type(key) is str else orjson.dumps(key).decode())
            out[key] = new
        return out

    def _container(self, value: Any, build: Any) -> Any:
        ident = id(value)
        if ident in self.active:
            return Marker(__type__="cycle", **{"class": _type_name(value)})
        self.active.add(ident)
        try:
            return build()
        finally:
            self.active.discard(ident)

    def _object(self, value: Any, depth: int) -> Any:
        module = type(value).__module__
        self._note(_type_name(value))
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
            if self.escape and MARKER in value:
                return self._escaped(value, depth)
            return self._container(value, lambda: self._dict(value, depth))
        if isinstance(value, tuple) and hasattr(value, "_asdict"):  # namedtuple
            return self._container(value, lambda: self._dict(value._asdict(), depth))
        if isinstance(value, (list, tuple, deque)):
            return self._container(value, lambda: self._items(value, depth))
        if isinstance(value, (bytes, bytearray)):
            return _bytes_marker(value)
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
    value: Any,
    strict: bool = False,
    issues: list[str] | None = None,
    kinds: dict[int, Any] | None = None,
    escape: bool = True,
) -> Any:
    """The JSON form of ``value`` (never raises).

    A value that cannot be converted (its ``__iter__`` raises, a tensor without data) becomes an
    ``error`` marker, alone; each is described in ``issues``. ``strict`` also checks every string
    and integer (lone surrogates are written escaped). ``kinds`` (for ``Arrays``) collects the
    number lists kept as they are, with the type of their sum. ``escape=False`` for data that is
    a JSON form already (its markers and wrapped dicts are kept as they are).
    """
    return _Simplifier(strict, issues, kinds, escape=escape)(value)


def to_payload(
    value: Any,
    issues: list[str] | None = None,
    kinds: dict[int, Any] | None = None,
    numbers: Callable[[list | tuple], type | None] | None = None,
    types: dict[str, str] | None = None,
) -> tuple[Any, int]:
    """``redact_data(to_jsonable(value))`` in one walk, and its token id count (the items of its
    lists under keys ending in ``ids``, reached through mappings alone).

    ``numbers`` (optional) is asked first about each list of at least ``MIN_ARRAY`` items: ``int``
    when it found every item an int (ints and bools, as the ``sum()`` check would), None to have
    the list checked as usual. It lets a caller convert an id list in the one pass that checks it.
    ``types`` (a dict) is filled with the value's type record (see :func:`from_json`)."""
    entries: list[list[Any]] | None = [] if types is not None else None
    walk = _Simplifier(False, issues, kinds, redact=True, numbers=numbers, types=entries)
    data = walk(value)
    if types is not None:
        types.update(type_record(value, entries or ()))
    return data, walk.token_ids


def type_record(value: Any, entries: Iterable[list[Any]] = ()) -> dict[str, str]:
    """``{JSON pointer: type}``: ``value``'s qualified class at ``""``, then the walk's entries
    (``[path reversed, type]``), the outermost of equal paths first."""
    record = {"": _type_name(value)}
    for path, kind in entries:
        pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in reversed(path))
        if pointer:
            record.setdefault(pointer, kind)
        elif kind.startswith("~"):
            record[""] = kind  # a loss of the value itself (its keys, its text) outranks its class
    return record


def encode(value: Any, max_field_bytes: int | None = None) -> str:
    """JSON text for ``value``; top-level fields over ``max_field_bytes`` become a visible marker."""
    return dumps(to_jsonable(value), max_field_bytes)


def _dumps_bytes(data: Any, issues: list[str] | None = None) -> bytes:
    try:
        return orjson.dumps(data, default=_fallback, option=_ORJSON_OPTS)
    except Exception:
        # a lone surrogate, an integer beyond 64 bits: walk everything, fixing only those values
        return orjson.dumps(
            to_jsonable(data, strict=True, issues=issues, escape=False),
            default=_fallback,
            option=_ORJSON_OPTS,
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


def _truncated(text: bytes, max_bytes: int) -> Marker:
    """A field's JSON over the limit: its size, a preview and the SHA-256 of the whole (what tells
    two truncated values apart, :func:`same`)."""
    import hashlib

    preview = text[: max(0, min(max_bytes, PREVIEW_BYTES) - 1)].decode(errors="ignore")
    return Marker(
        __type__="truncated", bytes=len(text), preview=preview, sha256=hashlib.sha256(text).hexdigest()
    )


def same(a: Any, b: Any) -> bool:
    """Whether two JSON forms hold the same value bit for bit: of one type at every place (``1``,
    ``1.0`` and ``true`` differ), floats by their bits (``-0.0`` is not ``0.0``; a NaN is itself),
    dicts by their keys and values; a ``truncated`` marker is the same only as one whose whole
    value had the same SHA-256 (one recorded without it never is: its value is not known)."""
    cls = type(a)
    if cls is not type(b):
        return False
    if cls is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if cls is list:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if cls is dict:
        if a.get(MARKER) == "truncated" and "sha256" not in a:
            return False
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    return a == b


def pointer_keys(pointer: str) -> list[str]:
    """A type record's JSON pointer as its keys: ``/a~1b/0`` is ``["a/b", "0"]``."""
    return [key.replace("~1", "/").replace("~0", "~") for key in pointer.split("/")[1:]]


def first_type_difference(
    a: Mapping[str, str] | None, b: Mapping[str, str] | None, ignored: frozenset[str] = frozenset()
) -> str | None:
    """Where two values of the same JSON form were of other types (a tuple and a list), by their
    type records (:func:`type_record`): the first pointer whose types differ, pointers through an
    ``ignored`` key aside; None when they agree, or when a value was recorded without a record
    (its types are not known)."""
    if a is None or b is None or a == b:
        return None
    for pointer in [*a, *(p for p in b if p not in a)]:
        if a.get(pointer) != b.get(pointer) and not ignored.intersection(pointer_keys(pointer)):
            return pointer
    return None


def cap_field(value: Any, max_bytes: int) -> Any:
    """``value`` unchanged if its JSON fits in ``max_bytes``, else a ``truncated`` marker with a preview."""
    try:
        text = _dumps_bytes(value)
    except Exception:
        return value
    return value if len(text) <= max_bytes else _truncated(text, max_bytes)


def kept_text(value: Any, limit: int | None = None) -> str | None:
    """Kept bytes (a ``bytes`` marker) that are UTF-8, as readers show them: ``(N bytes, UTF-8)``
    and their text (cut at ``limit`` characters); None for anything else."""
    if not (
        isinstance(value, dict) and value.get(MARKER) == "bytes" and isinstance(value.get("base64"), str)
    ):
        return None
    try:
        raw = pybase64.b64decode(value["base64"], validate=True)
        text = raw.decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return f"({len(raw):,} bytes, UTF-8) {text}"


def readable(value: Any) -> Any:
    """``value`` with its kept bytes that are UTF-8 as their text (:func:`kept_text`), for backends
    that show payloads to people; ``value`` itself when it holds none."""
    if isinstance(value, dict):
        own = value.get("value")
        if value.get(MARKER) == ESCAPED and isinstance(own, dict):  # an op's own dict, no marker
            return {**value, "value": {k: readable(v) for k, v in own.items()}}
        text = kept_text(value)
        if text is not None:
            return text
        if not any(isinstance(v, (dict, list)) for v in value.values()):
            return value
        return {k: readable(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return [readable(v) for v in value]
    return value


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
        return Marker(__type__="error", error=why), why


#: Types of JSON scalars: a list of only these holds no marker.
_JSON_SCALARS = frozenset({int, float, str, bool, type(None)})
_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
_LOSSES = {
    REDACTED: "a value hidden by redaction",
    KEYS_LOST: "a dict whose keys were not all strings (recorded as strings)",
    TEXT_ESCAPED: "a string that was not valid Unicode (recorded escaped)",
    REDUCED: "an output recorded through reduce_output, not as the op returned it",
}


def _as(cls: type, build: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    def rebuild(value: Any) -> Any:
        if type(value) is not cls:
            raise NotExact(f"recorded as {_JSON_KINDS.get(type(value), type(value).__name__)}")
        return build(value) if build is not None else value

    return rebuild


#: The types :func:`from_json` rebuilds without help: qualified class -> from the decoded JSON value.
BUILTIN_TYPES: dict[str, Callable[[Any], Any]] = {
    "builtins.dict": _as(dict),
    "builtins.list": _as(list),
    "builtins.str": _as(str),
    "builtins.int": _as(int),
    "builtins.float": _as(float),
    "builtins.bool": _as(bool),
    "builtins.NoneType": lambda value: value if value is None else _as(type(None))(value),
    "builtins.bytes": _as(bytes),
    "builtins.set": _as(set),
    "builtins.tuple": _as(list, tuple),
    "builtins.frozenset": _as(set, frozenset),
    "builtins.bytearray": _as(bytes, bytearray),
}


def from_json(
    data: Any,
    types: Mapping[str, str] | None = None,
    builders: Mapping[str, Callable[[Any], Any]] | None = None,
) -> Any:
    """The value whose JSON form is ``data`` and whose type record is ``types`` (None: a record
    made before outputs had one; their JSON values are taken as they are), made anew.

    Markers become their values (NaN with its bits, big ints, bytes, sets); the types the record
    names are rebuilt bottom-up by ``builders`` (qualified class -> from the decoded value) or
    :data:`BUILTIN_TYPES`. Raises :class:`NotExact` saying what was not kept (a truncated field, a
    repr, a value hidden by redaction, a type nobody rebuilds); a builder's own error is raised as
    it is.
    """
    rebuild = _Rebuild(types or {}, builders or {})
    try:
        return rebuild.walk(data, "")
    except NotExact:
        if not rebuild.unplaced:
            raise
    rebuild.everywhere = True  # again, following every path, to say where
    return rebuild.walk(data, "")


def _pointer_step(at: str, key: Any) -> str:
    return f"{at}/{str(key).replace('~', '~0').replace('/', '~1')}"


class _Rebuild:
    def __init__(self, types: Mapping[str, str], builders: Mapping[str, Callable[[Any], Any]]) -> None:
        self.types = types
        self.builders = builders
        self.everywhere = False  # follow every path (else only those to record entries)
        self.unplaced = False  # a value not kept was met where no path was followed
        # pointers with record entries below them (where the walk must follow paths)
        self.inside: set[str] = set()
        for pointer in types:
            while pointer:
                pointer = pointer.rsplit("/", 1)[0]
                self.inside.add(pointer)

    def child(self, at: str | None, key: Any) -> str | None:
        if at is None or (at not in self.inside and not self.everywhere):
            return None
        return _pointer_step(at, key)

    def walk(self, data: Any, at: str | None) -> Any:
        cls = type(data)
        if cls is list or cls is tuple:
            if (at is None or at not in self.inside) and _JSON_SCALARS.issuperset(map(type, data)):
                value: Any = list(data)
            else:
                value = [self.walk(v, self.child(at, i)) for i, v in enumerate(data)]
        elif cls is dict or cls is Marker:
            if MARKER in data:
                value = self.marker(data, at)
            else:
                value = {k: self.walk(v, self.child(at, k)) for k, v in data.items()}
        else:
            value = data
        if at is not None and at in self.types:
            value = self.build(self.types[at], value, at)
        return value

    def build(self, kind: str, value: Any, at: str) -> Any:
        build = self.builders.get(kind) or BUILTIN_TYPES.get(kind)
        where = at or "the output"
        if build is None:
            if kind in _LOSSES:
                raise NotExact(f"{_LOSSES[kind]} at {where}")
            shown = _JSON_KINDS.get(type(value), type(value).__name__)
            raise NotExact(f"a {kind} at {where} was recorded as {shown}, and is not rebuilt")
        try:
            return build(value)
        except NotExact as exc:
            raise NotExact(f"a {kind} at {where} was {exc}") from None

    def marker(self, data: dict[str, Any], at: str | None) -> Any:
        kind = data[MARKER]
        where = at or "the output"
        if at is None:
            self.unplaced = True
        try:
            if kind == ESCAPED and type(data.get("value")) is dict:
                inner = self.child(at, "value")
                return {k: self.walk(v, self.child(inner, k)) for k, v in data["value"].items()}
            if kind == "float":
                bits = data.get("bits")
                if bits is not None:
                    return struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0]
                value = float(data["value"])
                if math.isfinite(value):
                    raise ValueError(data["value"])
                return value
            if kind == "int":
                return int(data["value"], 0)
            if kind == "bytes":
                return pybase64.b64decode(data["base64"], validate=True)
            if kind == "set" and type(data.get("items")) is list:
                inner = self.child(at, "items")
                return {self.walk(v, self.child(inner, i)) for i, v in enumerate(data["items"])}
            if (
                kind == "repr"
                and data.get("class") == "builtins.int"
                and len(data.get("repr", "")) < REPR_CHARS
            ):
                return int(data["repr"])  # a big int, as rlreplay recorded them before the int marker
        except (KeyError, TypeError, ValueError, struct.error) as exc:
            raise NotExact(f"a malformed {kind!r} marker at {where} ({type(exc).__name__})") from None
        name = data.get("class")
        if kind == "truncated":
            raise NotExact(f"a value at {where} was recorded truncated ({data.get('bytes')} bytes)")
        if kind == "repr":
            raise NotExact(f"a {name} at {where} was recorded as its repr")
        if kind == "cycle":
            raise NotExact(f"a {name} at {where} holds itself (a reference cycle, not recorded)")
        if kind == "error":
            raise NotExact(f"a value at {where} could not be recorded ({data.get('error')})")
        raise NotExact(f"a {kind!r} marker at {where} stands for what was not recorded")


TOKENS = "tokens"
#: Number lists shorter than this stay in the JSON text.
MIN_ARRAY = 64
#: A stretch shorter than this is stored rather than referenced.
MIN_SHARED = 64
