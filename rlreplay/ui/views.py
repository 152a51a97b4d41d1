"""One trajectory made ready for its page: chat messages, span timeline, tokens with overlays."""

from __future__ import annotations

import math
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson
from markupsafe import Markup

from rlreplay.format.payload import readable
from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_SIGNALS, KIND_TOOL
from rlreplay.format.tool_errors import tool_error
from rlreplay.model import Span, Trajectory

LOGPROB_KEYS = ("response_logprobs", "rollout_log_probs", "log_probs", "logprobs")
MAX_TOKENS = 100_000


def _one_line_numbers(value: Any) -> Any:
    """``value`` with each list of numbers as ready JSON on one line (``[1, 2, 3]``), not one a line."""
    if isinstance(value, dict):
        return {k: _one_line_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) in (int, float):
            dumped = orjson.dumps(value)
            if not dumped[1:-1].translate(None, b"0123456789.-+eE,"):  # numbers only
                return orjson.Fragment(dumped.replace(b",", b", "))
        return [_one_line_numbers(v) for v in value]
    return value


def pretty(value: Any, limit: int = 4000) -> str:
    """JSON text of a value for display (strings as they are), cut at ``limit`` characters."""
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = orjson.dumps(
                _one_line_numbers(readable(value)), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
            )
            text = text.decode()
        except TypeError:
            text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text):,} characters)"


_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def plain(text: Any) -> str:
    """Decoded text without chat-template markers such as ``<|im_end|>`` (token ids as they are)."""
    if not isinstance(text, str):
        return " ".join(map(str, text)) if isinstance(text, list) else ""
    return _SPECIAL.sub("", text)


class Memo:
    """A decoder that decodes each id list once (a page decodes the same turns for several views)."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self._texts: dict[tuple[bool, tuple[int, ...]], str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self.decode_many([ids], skip_special_tokens)[0]

    def decode_many(self, seqs: Any, skip_special_tokens: bool = False) -> list[str]:
        keys = [(skip_special_tokens, tuple(ids)) for ids in seqs]
        missing = list(dict.fromkeys(k for k in keys if k not in self._texts))
        if missing:
            texts = self.decoder.decode_many([list(k[1]) for k in missing], skip_special_tokens)
            self._texts.update(zip(missing, texts))
        return [self._texts[k] for k in keys]


# ---- conversation ------------------------------------------------------------------------------


@dataclass
class Message:
    role: str
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments" (text)}
    tokens: int | None = None
    stopped: str | None = None  # an answer cut by its length limit: how (the audit's truncated rule)

    @property
    def head(self) -> str:
        """The content shown at once (a long one's rest is laid out only when opened)."""
        return self.content[:CHAT_SHOWN]

    @property
    def rest(self) -> str:
        return self.content[CHAT_SHOWN:]


#: characters of a chat message shown at once (laying out a 100,000-token answer takes seconds)
CHAT_SHOWN = 20_000


def messages(traj: Trajectory, decoder: Any, adapter: Any = None) -> list[Message]:
    """The conversation as OpenAI-style chat messages (system, user, assistant, tool); without a
    tokenizer, the turns (prompt, assistant, tool) with their token ids."""
    from rlreplay.adapters.registry import get_adapter, openai_messages

    adapter = adapter or get_adapter()
    if decoder is None:
        out = _id_messages(traj, adapter)
    else:
        out = []
        for m in openai_messages(traj, decoder, adapter):
            calls = []
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                calls.append({"name": fn.get("name"), "arguments": _pretty_arguments(fn.get("arguments"))})
            out.append(Message(str(m.get("role")), str(m.get("content") or ""), calls))
    _mark_length_stops(traj, out, adapter)
    return out


def _mark_length_stops(traj: Trajectory, out: list[Message], adapter: Any) -> None:
    """Mark the answers whose model call stopped on its length limit: the k-th assistant message is
    the k-th assistant turn, the answer of that turn's model call."""
    from rlreplay.audit.calls import length_stops
    from rlreplay.text.conversation import ROLE_ASSISTANT, turns

    stopped = length_stops(traj, adapter)
    if not stopped:
        return
    answers = [t.span_id for t in turns(traj, None, adapter) if t.role == ROLE_ASSISTANT]
    for message, span_id in zip((m for m in out if m.role == ROLE_ASSISTANT), answers):
        message.stopped = stopped.get(span_id) if span_id else None


def prompt_text(traj: Trajectory, decoder: Any, adapter: Any = None) -> str:
    """The prompt's first user message (the question), without the chat template."""
    if decoder is None:
        return ""
    users = [m.content for m in messages(traj, decoder, adapter) if m.role == "user"]
    return users[0] if users else ""


def recorded_prompt(traj: Trajectory, adapter: Any) -> str | None:
    """:func:`prompt_text` from the agent spans alone, when the adapter builds the prompt from the
    chat messages recorded there (its first user message); None when the whole trajectory is needed."""
    from rlreplay.adapters.generic import GenericAdapter
    from rlreplay.text.messages import build_messages

    kind = type(adapter)
    if not (
        isinstance(adapter, GenericAdapter)
        and kind.messages is GenericAdapter.messages
        and kind.prompt_messages is GenericAdapter.prompt_messages
        and adapter.prompt_messages(traj)
    ):
        return None
    # with recorded messages they open the conversation, whatever the turns: none are needed
    users = [m for m in build_messages(adapter, traj, [], None) if str(m.get("role")) == "user"]
    return str(users[0].get("content") or "") if users else ""


def _id_messages(traj: Trajectory, adapter: Any = None) -> list[Message]:
    from rlreplay.text.conversation import turns

    out = []
    for turn in turns(traj, None, adapter):
        calls = [{"name": c.get("name"), "arguments": pretty(c.get("arguments"))} for c in turn.tool_calls]
        out.append(Message(turn.role, " ".join(map(str, turn.token_ids)), calls, tokens=len(turn.token_ids)))
    return out


def _pretty_arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return pretty(value)


# ---- span timeline -----------------------------------------------------------------------------


@dataclass
class SpanRow:
    span: Span
    depth: int
    left: float  # percent of the trajectory's duration
    width: float
    texts: list[tuple[str, str, int]] = field(default_factory=list)  # (what, decoded text, tokens)

    @property
    def ms(self) -> float:
        return (self.span.end_ns - self.span.start_ns) / 1e6


TEXT_FIELDS = (
    ("inputs", "prompt_ids", "prompt_text"),
    ("output", "token_ids", "response_text"),
    ("output", "response_ids", "response_text"),
)


def _texts(span: Span, decoder: Any) -> list[tuple[str, str, int]]:
    """The span's token-id lists decoded (a model call's prompt and answer): the text ``add_text``
    put beside them when there, else decoded here."""
    if decoder is None:
        return []
    found, missing = [], []
    for where, key, text_key in TEXT_FIELDS:
        value = getattr(span, where)
        ids = value.get(key) if isinstance(value, dict) else None
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            text = value.get(text_key)
            found.append([key, text if isinstance(text, str) else None, len(ids)])
            if not isinstance(text, str):
                missing.append((len(found) - 1, ids))
    for (at, _), text in zip(missing, decoder.decode_many([ids for _, ids in missing])):
        found[at][1] = text
    return [(key, _cut(text), n) for key, text, n in found]


#: characters of a span's decoded text shown (the conversation above shows it whole)
SPAN_TEXT_SHOWN = 20_000


def _cut(text: str) -> str:
    if len(text) <= SPAN_TEXT_SHOWN:
        return text
    return f"{text[:SPAN_TEXT_SHOWN]}… ({len(text):,} characters; the conversation above has them all)"


def timeline(traj: Trajectory, decoder: Any = None) -> list[SpanRow]:
    """The spans as rows of a timeline over the trajectory's time (signals spans at its end)."""
    t0, t1 = traj.start_ns, traj.end_ns
    total = max(t1 - t0, 1)
    rows: list[SpanRow] = []

    def walk(span: Span, depth: int) -> None:
        left = min(max((span.start_ns - t0) / total * 100, 0.0), 99.6)  # signals come after the end
        width = max((span.end_ns - span.start_ns) / total * 100, 0.4)
        rows.append(
            SpanRow(span, depth, round(left, 3), round(min(width, 100 - left), 3), _texts(span, decoder))
        )
        for child in sorted(span.children, key=lambda s: (s.start_ns, -s.end_ns)):
            walk(child, depth + 1)

    for root in sorted(traj.roots, key=lambda s: s.start_ns):
        walk(root, 0)
    return rows


def timings(traj: Trajectory) -> dict[str, Any]:
    """Time spent in model calls and in tools, and how many of each."""
    llm, tools = traj.by_kind(KIND_LLM), traj.by_kind(KIND_TOOL)
    return {
        "llm": len(llm),
        "llm_s": sum(s.duration_s for s in llm),
        "tool": len(tools),
        "tool_s": sum(s.duration_s for s in tools),
        "tool_errors": traj.tool_errors,  # the listing's count (rlreplay.format.tool_errors)
    }


def tool_calls(traj: Trajectory) -> list[dict[str, Any]]:
    """Tool spans in call order: name, arguments, result, status, time."""
    out = []
    for span in sorted(traj.by_kind(KIND_TOOL), key=lambda s: s.start_ns):
        inputs = span.inputs if isinstance(span.inputs, dict) else {}
        result = span.output
        if isinstance(result, list) and result:
            result = result[0]
        if isinstance(result, dict) and "text" in result:
            result = result["text"]
        if isinstance(result, dict) and result.get("__type__") == "exception":
            result = None  # the error line says it; the traceback is in the span's output
        out.append(
            {
                "name": span.name,
                "arguments": pretty(inputs.get("parameters", inputs.get("kwargs", inputs))),
                "result": pretty(result),
                "status": span.status,
                "error": tool_error(span.status, span.error, span.output),
                "ms": span.duration_s * 1000,
            }
        )
    return out


# ---- tokens ------------------------------------------------------------------------------------


@dataclass
class TokenView:
    data: Markup  # JSON the page draws the tokens from: ids, text per id, mask and overlay levels
    values: Markup  # JSON: per-token values, read by the tooltips
    count: int
    has_logprobs: bool
    has_mismatch: bool
    mismatch_note: str | None = None
    truncated: bool = False
    has_entropy: bool = False
    minimap: Markup | None = None
    scale: dict[str, float] = field(default_factory=dict)

    @property
    def chunk(self) -> int:
        """Tokens per block the page draws at a time."""
        return CHUNK


#: log-prob shown at full colour (and below); mismatch |Δ| likewise
LOGPROB_FULL = -5.0
MISMATCH_FULL = 1.0
#: responses longer than this get a minimap
MINIMAP_FROM = 1500
MINIMAP_CELLS = 240
ENTROPY_KEYS = ("entropy", "entropies", "token_entropy")


def _floats(value: Any, n: int) -> list[float | None] | None:
    """``value`` when it is a list of ``n`` numbers (its first one says; ``_array`` reads the rest)."""
    if isinstance(value, list) and len(value) == n and all(isinstance(v, (int, float)) for v in value[:1]):
        return value
    return None


def _first(d: dict[str, Any], keys: tuple[str, ...], n: int) -> list[float | None] | None:
    for key in keys:
        found = _floats(d.get(key), n)
        if found is not None:
            return found
    return None


def _marks(mask: list[Any]) -> Any:
    """A response mask as int64 (1 model, 0 tool): any true value is 1."""
    import numpy as np

    arr = np.asarray(mask)
    if arr.ndim == 1 and arr.dtype.kind in "biuf":  # numbers: one pass, no Python loop
        return (arr != 0).astype(np.int64)
    return np.array([int(bool(m)) for m in mask], dtype=np.int64)


def _response(traj: Trajectory) -> tuple[list[int], Any, list[float | None] | None]:
    """Response ids, mask (int64: 1 model, 0 tool) and rollout log-probs, from the agent span or the
    turns."""
    from rlreplay.text.conversation import ROLE_ASSISTANT, ROLE_PROMPT, turns

    agents = [s for s in traj.by_kind(KIND_AGENT) if isinstance(s.output, dict)]
    for agent in agents:
        out = agent.output
        ids, mask = out.get("response_ids"), out.get("response_mask")
        if isinstance(ids, list) and isinstance(mask, list) and len(mask) >= len(ids):
            return ids, _marks(mask[: len(ids)]), _first(out, LOGPROB_KEYS, len(ids))
    by_span = {s.span_id: s for s in traj.by_kind(KIND_LLM)}
    ids, mask, lps = [], [], []
    for turn in turns(traj):
        if turn.role == ROLE_PROMPT:
            continue
        n = len(turn.token_ids)
        ids += turn.token_ids
        model = turn.role == ROLE_ASSISTANT
        mask += [int(model)] * n
        span = by_span.get(turn.span_id) if turn.span_id else None
        found = _first(span.output, LOGPROB_KEYS, n) if span and isinstance(span.output, dict) else None
        lps += found if found is not None else [None] * n
    return ids, _marks(mask), lps if any(v is not None for v in lps) else None


def _aligned(value: Any, n: int) -> list[float | None] | None:
    """A list of numbers cut or padded (None) to ``n`` entries (the trainer may pad or trim)."""
    if not isinstance(value, list) or not value or not isinstance(value[0], (int, float)):
        return None
    out = value[:n]
    return out + [None] * (n - len(out))


def _entropy(traj: Trajectory, n: int) -> list[float | None] | None:
    """Per-token entropy, when the rollout or the trainer recorded it."""
    for kind in (KIND_AGENT, KIND_SIGNALS):
        for span in sorted(traj.by_kind(kind), key=lambda s: s.end_ns, reverse=kind == KIND_SIGNALS):
            for value in (span.output, span.attributes):
                if isinstance(value, dict):
                    for key in ENTROPY_KEYS:
                        found = _aligned(value.get(key), n)
                        if found is not None:
                            return found
    return None


def _compared(traj: Trajectory, n: int, fields: Any) -> Any:
    """The response's trainer and rollout log-probs as the mismatch numbers take them
    (``rlreplay.mismatch.tokens``), when its trainer log-probs were recorded per token and it is
    the response the page shows (``n`` tokens); else None."""
    import numpy as np

    from rlreplay.mismatch.tokens import of_trajectory

    found = of_trajectory(traj, fields)
    if found is None or len(found) != n or not np.isfinite(found.trainer).any():
        return None
    return found


LEVELS = 20  # colour steps of an overlay (classes a0–a20, b0–b20, c0–c20 in style.css)
CHUNK = 2000  # tokens per block: the page draws a block at a time, the browser lays out those in view


def _array(values: list[float | None] | None, n: int) -> Any:
    """Values as float64 (NaN where none or not a number)."""
    import numpy as np

    if values is None:
        return np.full(n, np.nan)
    try:
        return np.asarray(values, dtype=np.float64)  # None becomes NaN
    except (TypeError, ValueError):
        return np.array([v if isinstance(v, (int, float)) else np.nan for v in values], dtype=np.float64)


def _levels(values: Any, full: float) -> Any:
    """``values`` as a share of ``full`` (the scale's end), in LEVELS steps (0 where none)."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        share = np.nan_to_num(values / full, nan=0.0, posinf=1.0, neginf=0.0)
    return np.rint(np.clip(share, 0.0, 1.0) * LEVELS).astype(np.int64)


def _json_values(values: Any) -> Any:
    return values.round(4).tolist()  # NaN is written as null


_PIECES: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
_PIECES_LOCK = threading.Lock()


def _token_texts(decoder: Any, ids: list[int]) -> list[str]:
    """Each token's text alone, decoded once per tokenizer (kept for the pages that follow)."""
    if decoder is None:
        return [f"{i} " for i in ids]
    decoder = decoder.decoder if isinstance(decoder, Memo) else decoder
    try:
        with _PIECES_LOCK:
            known = _PIECES.setdefault(decoder, {})
    except TypeError:  # not weakly referable: decode every time
        known = {}
    missing = [i for i in ids if i not in known]
    if missing:
        decoded = dict(zip(missing, decoder.decode_many([[i] for i in missing])))
        with _PIECES_LOCK:
            known.update(decoded)
    else:
        decoded = {}
    return [known.get(i, decoded.get(i, "")) for i in ids]


def _script_json(value: Any) -> Markup:
    """JSON for a ``<script type="application/json">`` element (no ``<`` to end it early)."""
    return Markup(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode().replace("<", "\\u003c"))


def _chars(values: Any, first: str) -> str:
    """Small non-negative integers as one character each (``first`` for 0): compact per-token data."""
    import numpy as np

    return (values + ord(first)).astype(np.uint8).tobytes().decode("ascii")


def tokens(traj: Trajectory, decoder: Any, fields: Any = None) -> TokenView | None:
    """The response's tokens as compact data the page draws from (``ui.js``, block by block): ids,
    each distinct id's text decoded once, the mask and each overlay's colour level as one character
    per token; the values for the tooltips apart (read on the first hover); a minimap of the whole
    response when it is long. The mismatch overlay paints |trainer − rollout| of the tokens the
    mismatch numbers count (model tokens, ``fields``: the run's adapter's); tool and observation
    tokens get no level."""
    import numpy as np

    ids, mask, lps = _response(traj)
    if not ids:
        return None
    truncated = len(ids) > MAX_TOKENS
    n_all = len(ids)
    ids, mask = ids[:MAX_TOKENS], mask[:MAX_TOKENS]
    lps = lps[:MAX_TOKENS] if lps else None
    n = len(ids)
    compared = _compared(traj, n_all, fields)
    entropy_list = _entropy(traj, n)
    rollout, entropy = _array(lps, n), _array(entropy_list, n)
    trainer = compared.trainer[:n] if compared is not None else np.full(n, np.nan)
    gap = (
        np.where(compared.counted[:n], np.abs(trainer - compared.rollout[:n]), np.nan)
        if compared
        else trainer
    )
    known = entropy[~np.isnan(entropy)]
    top_entropy = float(known.max()) if known.size and known.max() > 0 else 1.0
    unique = list(dict.fromkeys(ids))
    texts = _token_texts(decoder, unique)
    levels = [
        _levels(rollout, LOGPROB_FULL),
        _levels(gap, MISMATCH_FULL),
        _levels(entropy, top_entropy),
    ]
    marks = mask
    present = (lps is not None, compared is not None, entropy_list is not None)
    data = {
        "ids": ids,
        "text": dict(zip(unique, texts)),
        "mask": _chars(marks, "0"),
        "levels": {
            name: _chars(lv, "a") if on else None
            for name, lv, on in zip(("logprob", "mismatch", "entropy"), levels, present)
        },
    }
    values = {
        "logprob": _json_values(rollout) if present[0] else None,
        "trainer": _json_values(trainer) if present[1] else None,
        # |Δ| from the stored log-probs, as `rlreplay mismatch` takes it (not from the rounded ones)
        "gap": _json_values(gap) if present[1] else None,
        "entropy": _json_values(entropy) if present[2] else None,
    }
    note = None
    if compared is None:
        note = "no trainer log-probs per token recorded (record them: rlreplay record --token-signals)"
    return TokenView(
        _script_json(data),
        _script_json(values),
        n,
        present[0],
        present[1],
        note,
        truncated,
        present[2],
        _minimap(marks, levels) if n >= MINIMAP_FROM else None,
        {"logprob": LOGPROB_FULL, "mismatch": MISMATCH_FULL, "entropy": top_entropy},
    )


def _minimap(mask: Any, levels: list[Any]) -> Markup:
    """The response in cells (the worst token of each); a click scrolls to the cell's first token."""
    per = math.ceil(len(mask) / MINIMAP_CELLS)
    cells = []
    for start in range(0, len(mask), per):
        end = min(start + per, len(mask))
        lp, mm, en = (int(lv[start:end].max()) / LEVELS for lv in levels)
        tool = 0 if (mask[start:end] == 0).any() else 1
        cells.append(
            f'<span class="cell m{tool}" data-at="{start}" style="--lp:{lp:.2f};--mm:{mm:.2f};--en:{en:.2f}" '
            f'data-tip="tokens {start}–{end - 1}"></span>'
        )
    return Markup(f'<div class="minimap" id="minimap">{"".join(cells)}</div>')
