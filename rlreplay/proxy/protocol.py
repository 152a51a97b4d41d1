"""The inference servers' request and response shapes the proxy reads: which routes generate, what to
ask the server for so that token ids and log-probs are recorded, and how to give the client exactly
what it would have got without the proxy.

Routes: vLLM's (and SGLang's) OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions``
(``return_token_ids`` gives ``prompt_token_ids`` and per-choice ``token_ids``; ``logprobs`` the
sampled tokens' log-probs; streamed as SSE, ``prompt_token_ids`` in the first chunk and the delta's
``token_ids`` in each), and SGLang's native ``/generate`` (``input_ids`` or ``text``,
``sampling_params``, ``return_logprob``; ``output_ids`` and ``meta_info`` with ``finish_reason``,
token counts, ``cached_tokens``, ``e2e_latency``, ``weight_version`` and
``output_token_logprobs`` as ``[logprob, token id, text]``), and OpenAI's ``/v1/responses``
(recorded as answered: no field of it asks for token ids; streamed as typed SSE events, the last
of which carries the whole response). Asking for ids and log-probs changes no
sampling; what the proxy asked for is taken out of the answer before the client sees it (set to
null in a whole answer, as the servers write fields nobody asked for; in a streamed chunk ids left
out and log-probs null, as they write them there; a chunk's other members keep their bytes). Pure
functions over JSON values and bytes: no HTTP here.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlreplay.format.wire import (  # noqa: F401  (the proxy's names for them)
    NOT_JSON,
    long_number,
    read_chunk,
    read_json,
    read_plain_json,
    sse_data,
    sse_events,
    stream_chunks,
    stream_datas,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
RESPONSES = "/v1/responses"  # OpenAI's Responses API (openai-agents' default model)
#: The generating routes and the name their spans get.
GENERATING = {
    CHAT: "chat.completions",
    COMPLETIONS: "completions",
    GENERATE: "generate",
    RESPONSES: "responses",
}

#: Weight updates, after which the next generation belongs to a new step: vLLM's weight-transfer
#: routes and SGLang's ``/update_weights_from_*``.
WEIGHT_UPDATES = frozenset({"/update_weights", "/start_weight_update", "/finish_weight_update"})
WEIGHT_UPDATE_PREFIX = "/update_weights_from_"

# What the proxy may add to a request: asked-for token ids, log-probs
ADDED_IDS = "ids"
ADDED_LOGPROBS = "logprobs"

_SGLANG_LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def is_weight_update(path: str) -> bool:
    return path in WEIGHT_UPDATES or path.startswith(WEIGHT_UPDATE_PREFIX)


def is_streamed(body: dict[str, Any]) -> bool:
    return bool(body.get("stream"))


def ask_for_tokens(route: str, body: dict[str, Any]) -> tuple[bytes, frozenset[str]]:
    """What to add to the client's request so that the upstream gives token ids and log-probs: JSON
    members (``"return_token_ids":true,``) and what they ask for. Only fields the request does not
    hold are added: a client's own value, even ``false``, is the client's to choose."""
    members: list[bytes] = []
    added = set()
    if route == RESPONSES:  # no field of that API asks for token ids: recorded as answered
        return b"", frozenset()
    if route == GENERATE:
        if "return_logprob" not in body:
            members.append(b'"return_logprob":true')
            added.add(ADDED_LOGPROBS)
        return b",".join(members), frozenset(added)
    if "return_token_ids" not in body:
        members.append(b'"return_token_ids":true')
        added.add(ADDED_IDS)
    if "logprobs" not in body:
        # chat: the sampled token's log-prob; completions: 0 top entries, the sampled token alone
        members.append(b'"logprobs":true' if route == CHAT else b'"logprobs":0')
        added.add(ADDED_LOGPROBS)
    return b",".join(members), frozenset(added)


_JSON_SPACE = b" \t\r\n"


def with_members(raw: bytes, members: bytes, empty: bool) -> bytes | None:
    """``raw`` (a JSON object's bytes, as the client sent them) with ``members`` put first in the
    object, every other byte as it was; None when ``raw`` does not start with ``{``. ``empty``: the
    object has no member (no comma follows what is added)."""
    start = len(raw) - len(raw.lstrip(_JSON_SPACE))
    if not members:
        return raw
    if raw[start : start + 1] != b"{":
        return None
    return raw[: start + 1] + members + (b"" if empty else b",") + raw[start + 1 :]


def _drop(obj: dict[str, Any], key: str, streamed: bool) -> None:
    if key in obj:
        if streamed:
            del obj[key]
        else:
            obj[key] = None


def as_client_sees(route: str, obj: Any, added: frozenset[str], streamed: bool = False) -> Any:
    """``obj`` (a whole answer or one streamed chunk) without what the proxy asked for: a copy where
    it differs (``obj`` itself is left as it is), ``obj`` where nothing was added."""
    if not added or not isinstance(obj, dict):
        return obj
    if route == GENERATE:
        meta = obj.get("meta_info")
        if (
            ADDED_LOGPROBS in added
            and isinstance(meta, dict)
            and any(k in meta for k in _SGLANG_LOGPROB_KEYS)
        ):
            return {**obj, "meta_info": {k: v for k, v in meta.items() if k not in _SGLANG_LOGPROB_KEYS}}
        return obj
    choices = obj.get("choices")
    copy = dict(obj)
    if isinstance(choices, list):
        copy["choices"] = [dict(c) if isinstance(c, dict) else c for c in choices]
    return copy if take_out(copy, added, streamed) else obj


def take_out(obj: dict[str, Any], added: frozenset[str], streamed: bool) -> bool:
    """Take what the proxy asked for out of an OpenAI-shaped answer or chunk ``obj``, in place
    (left out of a streamed chunk, set to null in a whole answer); whether anything was."""
    ids = ADDED_IDS in added
    logprobs = ADDED_LOGPROBS in added
    changed = False
    if ids and obj.get("prompt_token_ids") is not None:
        _drop(obj, "prompt_token_ids", streamed)
        changed = True
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if ids and (choice.get("token_ids") is not None or choice.get("prompt_token_ids") is not None):
                _drop(choice, "token_ids", streamed)
                _drop(choice, "prompt_token_ids", streamed)
                changed = True
            if logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None
                changed = True
    return changed


@functools.cache
def _member_codec() -> tuple[Any, Any, Any]:
    raw = msgspec.Raw
    return (
        msgspec.json.Decoder(dict[str, raw]).decode,
        msgspec.json.Decoder(list[dict[str, raw]]).decode,
        msgspec.json.Encoder().encode,
    )


#: What msgspec raises for bytes that are not of the shape it reads them against.
SHAPE_REFUSED = (msgspec.ValidationError, msgspec.DecodeError)
_NULL = msgspec.Raw(b"null")


def _given(member: Any) -> bool:
    return member is not None and member != _NULL


def taken_out(data: bytes, added: frozenset[str]) -> bytes | None:
    """An OpenAI-shaped streamed chunk's bytes after :func:`take_out`: its members in order, each
    value's bytes as they were, but what the proxy asked for; None where nothing was asked for.
    Raises :data:`SHAPE_REFUSED` where ``data`` is no such chunk (``choices`` no list of objects,
    or no JSON that msgspec reads: NaN, a lone surrogate)."""
    members_of, choices_of, encode = _member_codec()
    obj = members_of(data)
    ids = ADDED_IDS in added
    changed = False
    if ids and _given(obj.get("prompt_token_ids")):
        del obj["prompt_token_ids"]
        changed = True
    listed = obj.get("choices")
    if _given(listed):
        choices = choices_of(listed)
        changed_choices = False
        for choice in choices:
            if ids and (_given(choice.get("token_ids")) or _given(choice.get("prompt_token_ids"))):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
                changed_choices = True
            if ADDED_LOGPROBS in added and _given(choice.get("logprobs")):
                choice["logprobs"] = _NULL
                changed_choices = True
        if changed_choices:
            obj["choices"] = choices
            changed = True
    return encode(obj) if changed else None


# ---- what a generation says about itself ---------------------------------------------------------


@dataclass
class Generated:
    """What the proxy records of one generation besides the answer itself."""

    prompt_ids: list[int] | None = None
    choices: list[dict[str, Any]] = field(default_factory=list)  # token_ids, log_probs, finish_reason
    usage: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # cached tokens, latency, weight version

    def record(self) -> dict[str, Any]:
        """The span output's fields (besides the answer): the first choice's ids and log-probs at
        the top, as every reader looks for them; the others under ``choices``."""
        out: dict[str, Any] = {}
        first = self.choices[0] if self.choices else {}
        for key in ("token_ids", "log_probs", "finish_reason"):
            if first.get(key) is not None:
                out[key] = first[key]
        if len(self.choices) > 1:
            out["choices"] = self.choices
        if self.usage is not None:
            out["usage"] = self.usage
        if self.engine:
            out["engine"] = self.engine
        return out


def _ids(value: Any) -> list[int] | None:
    """``value`` when it is a list of token ids, else None. ``sum`` tells ints (and bools, which
    the recorder then keeps as JSON) from anything else at C speed: ids lists are long, and this
    runs on every answer."""
    if not isinstance(value, list):
        return None
    try:
        return value if type(sum(value)) is int else None
    except TypeError:
        return None


_LOGPROB = operator.itemgetter("logprob")


def _chat_logprobs(logprobs: Any) -> list[float] | None:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    try:
        return list(map(_LOGPROB, content))  # every entry a dict with its log-prob: in C
    except (KeyError, TypeError):
        return [c.get("logprob") for c in content if isinstance(c, dict)]


def _completion_logprobs(logprobs: Any) -> list[float] | None:
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    return list(values) if isinstance(values, list) else None


def _engine_openai(obj: dict[str, Any], engine: dict[str, Any]) -> None:
    _engine_values(
        engine, obj.get("usage"), obj.get("model"), obj.get("system_fingerprint"), obj.get("weight_version")
    )


def _engine_values(engine: dict[str, Any], usage: Any, *named: Any) -> None:
    """``engine`` with the cached tokens of ``usage`` and the model, system fingerprint and weight
    version ``named``, where they are given."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        engine["cached_tokens"] = details["cached_tokens"]
    for key, value in zip(_ENGINE_NAMES, named):
        if value is not None:
            engine[key] = value


_ENGINE_NAMES = ("model", "system_fingerprint", "weight_version")


def _sglang_logprobs(meta: dict[str, Any]) -> tuple[list[float] | None, list[int] | None]:
    rows = meta.get("output_token_logprobs")
    if not isinstance(rows, list):
        return None, None
    values, ids = [], []
    for row in rows:
        if isinstance(row, (list, tuple)) and len(row) >= 2:
            values.append(row[0])
            ids.append(row[1])
        elif isinstance(row, dict):
            values.append(row.get("logprob"))
            ids.append(row.get("token_id", row.get("id")))
    return values, ids


def _finish(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else value


_SGLANG_ENGINE = ("id", "cached_tokens", "e2e_latency", "weight_version", "spec_verify_ct")


def generated(route: str, body: dict[str, Any], obj: Any) -> Generated:
    """What a whole answer ``obj`` says (before ``as_client_sees``)."""
    found = Generated()
    if not isinstance(obj, dict):
        return found
    if route == RESPONSES:
        response = obj.get("response") if isinstance(obj.get("response"), dict) else obj  # a streamed event
        found.choices = [{"finish_reason": response.get("status")}]
        found.usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
        _engine_openai(response, found.engine)
        return found
    if route == GENERATE:
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        found.prompt_ids = _ids(body.get("input_ids"))
        log_probs, lp_ids = _sglang_logprobs(meta)
        ids = _ids(obj.get("output_ids"))
        if ids is None:
            ids = _ids(lp_ids)
        found.choices = [
            {"token_ids": ids, "log_probs": log_probs, "finish_reason": _finish(meta.get("finish_reason"))}
        ]
        usage = {k: meta[k] for k in ("prompt_tokens", "completion_tokens") if k in meta}
        found.usage = usage or None
        found.engine = {k: meta[k] for k in _SGLANG_ENGINE if meta.get(k) is not None}
        return found
    found.prompt_ids = _ids(obj.get("prompt_token_ids"))
    for choice in _list(obj.get("choices")):
        if not isinstance(choice, dict):
            continue
        if found.prompt_ids is None:
            found.prompt_ids = _ids(choice.get("prompt_token_ids"))
        if route == CHAT:
            log_probs = _chat_logprobs(choice.get("logprobs"))
        else:
            log_probs = _completion_logprobs(choice.get("logprobs"))
        found.choices.append(
            {
                "token_ids": _ids(choice.get("token_ids")),
                "log_probs": log_probs,
                "finish_reason": choice.get("finish_reason"),
            }
        )
    if isinstance(obj.get("usage"), dict):
        found.usage = obj["usage"]
    _engine_openai(obj, found.engine)
    return found


def _list(value: Any) -> list[Any]:
    """``value`` when it is a list, else none: what a server wrote where a list belongs."""
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def whole_index(item: dict[str, Any]) -> int | None:
    """The ``index`` of a streamed choice or tool call (0 when it has none), None when it is no
    whole number (a server's ``"x"``, a list): what names no choice joins none."""
    return _whole(item.get("index") or 0)


def _usual_run(chunks: list[Any], start: int) -> int:
    """Where the run of usual chunks from ``start`` ends: read against their shape, with no prompt
    ids, usage, fingerprint or weight version, and one choice, the first (index 0 or none), itself
    without prompt ids."""
    shapes = _SHAPES
    stop = start
    for chunk in itertools.islice(chunks, start, None):
        if (
            type(chunk) not in shapes
            or chunk.prompt_token_ids is not None
            or chunk.usage is not None
            or chunk.system_fingerprint is not None
            or chunk.weight_version is not None
        ):
            break
        choices = chunk.choices
        if choices is None or len(choices) != 1:
            break
        choice = choices[0]
        index = choice.index
        if (index is not None and (type(index) is not int or index)) or choice.prompt_token_ids is not None:
            break
        stop += 1
    return stop


def _whole(index: Any) -> int | None:
    if type(index) is int:
        return index
    try:
        return int(index)
    except (TypeError, ValueError, OverflowError):
        return None


class StreamedAnswer:
    """A streamed answer put back together from its chunks (JSON values, in order): what
    :func:`generated` says of a whole one, and the text of each choice. An OpenAI-shaped chunk is
    read as it is added (its ids and log-probs are not looked for again)."""

    def __init__(self, route: str, body: dict[str, Any]) -> None:
        self.route = route
        self.body = body
        self.chunks: list[dict[str, Any]] = []
        self._openai = route in (CHAT, COMPLETIONS)
        self._logprobs = _chat_logprobs if route == CHAT else _completion_logprobs
        self._found = Generated()
        self._by_index: dict[int, dict[str, Any]] = {}

    def add(self, chunk: Any) -> None:
        if isinstance(chunk, dict):
            self.chunks.append(chunk)
            if self._openai:
                self._read(chunk)
        elif isinstance(chunk, _Chunk):
            self.chunks.append(chunk)
            self._read_shaped(chunk)

    def add_all(self, chunks: list[Any]) -> None:
        """:meth:`add` each of ``chunks``, in order: a run of the usual chunks (read against their
        shape, one choice, the first, nothing besides its ids, log-probs, text and finish reason)
        folded at once."""
        start = 0
        while start < len(chunks):
            stop = _usual_run(chunks, start) if self._openai else start
            if stop > start:
                self.chunks.extend(chunks[start:stop])
                if not self._fold_run(chunks[start:stop]):
                    for chunk in chunks[start:stop]:
                        self._read_shaped(chunk)
                start = stop
            else:
                self.add(chunks[start])
                start += 1

    def _fold_run(self, run: list[Any]) -> bool:
        """:meth:`_read_shaped` of each chunk of a :func:`_usual_run`, at once; False where one
        holds what only that reads (ids that are no list of ints, log-probs of another form)."""
        ones = [chunk.choices[0] for chunk in run]
        lists = [one.token_ids for one in ones if one.token_ids is not None]
        if not set(map(type, lists)) <= {list}:
            return False
        ids = list(itertools.chain.from_iterable(lists))
        try:
            if type(sum(ids)) is not int:  # as _ids tells them
                return False
        except TypeError:
            return False
        values: list[Any] = []
        if self.route == CHAT:
            for entries in [one.logprobs.content for one in ones if one.logprobs is not None]:
                if entries is not None:
                    values += [entry.logprob for entry in entries]
        else:
            for logprobs in [one.logprobs.token_logprobs for one in ones if one.logprobs is not None]:
                if isinstance(logprobs, list):
                    values += logprobs
        one = self._by_index.get(0)
        if one is None:
            one = self._by_index[0] = {"token_ids": [], "log_probs": []}
        one["token_ids"] += ids
        one["log_probs"] += values
        ends = [choice.finish_reason for choice in ones if choice.finish_reason is not None]
        if ends:
            one["finish_reason"] = ends[-1]
        models = [chunk.model for chunk in run if chunk.model is not None]
        if models:
            self._found.engine["model"] = models[-1]
        return True

    def take(self, chunk: Any, added: frozenset[str]) -> Any:
        """Add ``chunk``; it as the client sees it (:func:`as_client_sees`) where that differs,
        else None. An OpenAI-shaped chunk is changed in place: what the answer keeps of it is
        the client's."""
        self.add(chunk)
        if not added or not isinstance(chunk, dict):
            return None
        if self._openai:
            return chunk if take_out(chunk, added, streamed=True) else None
        seen = as_client_sees(self.route, chunk, added, streamed=True)
        return seen if seen is not chunk else None

    def _read(self, chunk: dict[str, Any]) -> None:
        found = self._found
        if found.prompt_ids is None:
            found.prompt_ids = _ids(chunk.get("prompt_token_ids"))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            found.usage = usage
        _engine_openai(chunk, found.engine)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index") or 0
            if type(index) is not int:
                index = whole_index(choice)
                if index is None:  # a choice the answer cannot place: its bytes alone keep it
                    continue
            one = self._by_index.get(index)
            if one is None:
                one = self._by_index[index] = {"token_ids": [], "log_probs": []}
            if found.prompt_ids is None:
                found.prompt_ids = _ids(choice.get("prompt_token_ids"))
            # a chunk without ids (vLLM's first, the role alone) adds none; later ones add theirs
            ids = _ids(choice.get("token_ids"))
            if ids is not None:
                one["token_ids"].extend(ids)
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                values = self._logprobs(logprobs)
                if values:
                    one["log_probs"].extend(values)
            if choice.get("finish_reason") is not None:
                one["finish_reason"] = choice["finish_reason"]

    def _read_shaped(self, chunk: ReadChunk) -> None:
        """:meth:`_read` of a chunk :func:`read_chunks` read against its shape."""
        found = self._found
        if found.prompt_ids is None:
            found.prompt_ids = _ids(chunk.prompt_token_ids)
        usage, named = chunk.usage, (chunk.model, chunk.system_fingerprint, chunk.weight_version)
        if usage is not None or named[1] is not None or named[2] is not None:
            if isinstance(usage, dict):
                found.usage = usage
            _engine_values(found.engine, usage, *named)
        elif named[0] is not None:  # the model alone: vLLM names it in every chunk
            found.engine["model"] = named[0]
        chat = self.route == CHAT
        for choice in chunk.choices or ():
            index = choice.index or 0
            if type(index) is not int:
                index = _whole(index)
                if index is None:
                    continue
            one = self._by_index.get(index)
            if one is None:
                one = self._by_index[index] = {"token_ids": [], "log_probs": []}
            if found.prompt_ids is None:
                found.prompt_ids = _ids(choice.prompt_token_ids)
            ids = _ids(choice.token_ids)
            if ids is not None:
                one["token_ids"].extend(ids)
            logprobs = choice.logprobs
            if logprobs is not None:
                if chat:
                    entries = logprobs.content
                    values = None if entries is None else [entry.logprob for entry in entries]
                else:
                    values = logprobs.token_logprobs
                    values = list(values) if isinstance(values, list) else None
                if values:
                    one["log_probs"].extend(values)
            if choice.finish_reason is not None:
                one["finish_reason"] = choice.finish_reason

    def generated(self) -> Generated:
        if self.route == GENERATE:
            return self._generate()
        if self.route == RESPONSES:  # the last event that carries the whole response says it all
            whole = [c for c in self.chunks if isinstance(c.get("response"), dict)]
            return generated(RESPONSES, self.body, whole[-1]) if whole else Generated()
        found = Generated(self._found.prompt_ids, [], self._found.usage, dict(self._found.engine))
        for index in sorted(self._by_index):
            one = self._by_index[index]
            found.choices.append(
                {
                    "token_ids": one["token_ids"] or None,
                    "log_probs": one["log_probs"] or None,
                    "finish_reason": one.get("finish_reason"),
                }
            )
        return found

    def _generate(self) -> Generated:
        """SGLang streams the answer so far in each chunk (or, with incremental output, each
        chunk's new part): the last chunk when it holds every token, else all chunks joined."""
        if not self.chunks:
            return Generated(prompt_ids=_ids(self.body.get("input_ids")))
        last = self.chunks[-1]
        found = generated(GENERATE, self.body, last)
        meta = last.get("meta_info") if isinstance(last.get("meta_info"), dict) else {}
        total = meta.get("completion_tokens")
        choice = found.choices[0]
        if isinstance(total, int) and len(choice.get("token_ids") or ()) < total:
            ids: list[int] = []
            values: list[float] = []
            for chunk in self.chunks:
                one = generated(GENERATE, self.body, chunk).choices[0]
                ids.extend(one.get("token_ids") or ())
                values.extend(one.get("log_probs") or ())
            choice["token_ids"], choice["log_probs"] = ids or None, values or None
        return found


# ---- reading a streamed answer's chunks for what the proxy records -------------------------------


class _ChatEntry(msgspec.Struct, gc=False):
    logprob: Any = None


class _ChatLogprobs(msgspec.Struct, gc=False):
    content: list[_ChatEntry] | None = None


class _CompletionLogprobs(msgspec.Struct, gc=False):
    token_logprobs: Any = None


class _Delta(msgspec.Struct, gc=False):
    content: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: Any = None
    token_ids: Any = None
    prompt_token_ids: Any = None
    finish_reason: Any = None


class _ChatChoice(_Choice, gc=False):
    delta: _Delta | None = None
    logprobs: _ChatLogprobs | None = None


class _CompletionChoice(_Choice, gc=False):
    text: Any = None
    logprobs: _CompletionLogprobs | None = None


class _Chunk(msgspec.Struct, gc=False):
    prompt_token_ids: Any = None
    usage: Any = None
    model: Any = None
    system_fingerprint: Any = None
    weight_version: Any = None


class _ChatChunk(_Chunk, gc=False):
    choices: list[_ChatChoice] | None = None


class _CompletionChunk(_Chunk, gc=False):
    choices: list[_CompletionChoice] | None = None


#: A chunk read by :func:`read_chunks` (a member it does not hold reads as null, as ``get`` does).
ReadChunk = _ChatChunk | _CompletionChunk
_SHAPES = frozenset((_ChatChunk, _CompletionChunk))


@functools.cache
def chunk_reader(route: str) -> Any:
    """A reader of one OpenAI-shaped chunk's bytes into a :data:`ReadChunk` (raises
    :data:`SHAPE_REFUSED`)."""
    return msgspec.json.Decoder(_ChatChunk if route == CHAT else _CompletionChunk).decode


def read_chunks(route: str, raw: bytes) -> list[Any]:
    """The chunks of a whole SSE answer as :class:`StreamedAnswer` and :func:`answer_of` read them:
    an OpenAI-shaped chunk as a :data:`ReadChunk` holding only the members they look at (read by
    msgspec, what else it holds skipped unread); any other event's data is read whole, as
    :func:`stream_chunks` reads it. Both give those readers the same values."""
    if route not in (CHAT, COMPLETIONS):
        return stream_chunks(raw)
    decode, refused = chunk_reader(route), SHAPE_REFUSED
    datas = stream_datas(raw)
    done = len(datas) - (datas[-1:] == [b"[DONE]"])
    try:  # the usual stream: every event but the end of the shape
        out = list(map(decode, datas[:done]))
        datas = datas[done:]
    except refused:
        out = []
    short: bool | None = None
    for data in datas:
        if data == b"[DONE]":
            out.append(read_chunk(data))
            continue
        try:
            out.append(decode(data))
        except refused:  # not of the shape (``[DONE]``, NaN, a lone surrogate): read whole
            if short is None:
                short = not long_number(raw)
            out.append(read_chunk(data, short))
    return out


# ---- what a client asked, for trajectories ---------------------------------------------------------


def prompt_of(route: str, body: dict[str, Any]) -> Any:
    """The prompt a request continues from: chat messages, completion prompt (text or ids), or
    ``/generate``'s ``input_ids`` or ``text``."""
    if route == CHAT:
        return body.get("messages")
    if route == COMPLETIONS:
        return body.get("prompt")
    if route == RESPONSES:
        return body.get("input")
    return body.get("input_ids") if body.get("input_ids") is not None else body.get("text")


def answer_of(route: str, record: dict[str, Any], read: list[Any] | None = None) -> Any:
    """What the first choice of a recorded answer (the span output: ``body`` or ``stream`` as the
    client got it, ``token_ids``) said, in the shape the next prompt would hold it: the assistant
    message (chat), else the text and the ids. ``read``: the values of a streamed answer's events,
    what :func:`stream_chunks` reads of its ``wire`` (read by the caller on the way)."""
    if route == RESPONSES:  # a later call names the response it follows (previous_response_id)
        return None
    ids = _ids(record.get("token_ids")) if route != CHAT else None  # a chat prompt holds messages
    stream = record.get("stream")
    body = record.get("body") if isinstance(record.get("body"), dict) else None
    wire = record.get("wire")
    if stream is None and body is None and isinstance(wire, bytes):  # the answer's bytes alone
        whole = read_json(wire) if read is None or wire.lstrip()[:1] == b"{" else None
        if isinstance(whole, dict):
            body = whole
        else:
            stream = stream_chunks(wire) if read is None else read
    chunks = [c for c in stream or () if isinstance(c, (dict, _Chunk))]
    if route == GENERATE:
        source = body if body is not None else chunks[-1] if chunks else {}
        return {"text": source.get("text"), "ids": ids}
    if body is not None:
        choices = [c for c in _list(body.get("choices")) if isinstance(c, dict)]
        first = choices[0] if choices else {}
        if route == CHAT:
            return first.get("message")
        return {"text": first.get("text"), "ids": ids}
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    at = 0
    while at < len(chunks):
        stop = _usual_run(chunks, at)
        if stop > at:  # the usual chunks: one choice each, the first
            ones = [chunk.choices[0] for chunk in chunks[at:stop]]
            at = stop
            if route != CHAT:
                content += [_str(one.text) for one in ones]
                continue
            deltas = [one.delta for one in ones if one.delta is not None]
            content += [delta.content for delta in deltas if isinstance(delta.content, str)]
            for delta in deltas:
                if delta.tool_calls is not None:
                    _add_calls(calls, delta.tool_calls)
            continue
        chunk = chunks[at]
        at += 1
        if isinstance(chunk, _Chunk):  # read against its shape
            for choice in chunk.choices or ():
                index = choice.index or 0
                if index != 0 and _whole(index) != 0:
                    continue
                if route != CHAT:
                    content.append(_str(choice.text))
                    continue
                delta = choice.delta
                if delta is not None:
                    if isinstance(delta.content, str):
                        content.append(delta.content)
                    _add_calls(calls, delta.tool_calls)
            continue
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index") or 0
            if index != 0 and whole_index(choice) != 0:  # the first choice alone
                continue
            if route != CHAT:
                content.append(_str(choice.get("text")))
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content")
            if isinstance(text, str):
                content.append(text)
            _add_calls(calls, delta.get("tool_calls"))
    if route != CHAT:
        return {"text": "".join(content), "ids": ids}
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": calls[i]} for i in sorted(calls)]
    return message


def _add_calls(calls: dict[int, dict[str, str]], made: Any) -> None:
    """``calls`` (by index: name and arguments so far) with a streamed delta's tool call pieces."""
    for call in made if isinstance(made, list) else ():
        if isinstance(call, dict):
            at = whole_index(call)
            if at is None:
                continue
            one = calls.setdefault(at, {"name": "", "arguments": ""})
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            one["name"] += _str(fn.get("name"))
            one["arguments"] += _str(fn.get("arguments"))
