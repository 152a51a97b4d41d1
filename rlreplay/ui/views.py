"""One trajectory made ready for its page: chat messages, span timeline, tokens with overlays."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from markupsafe import Markup, escape

from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_SIGNALS, KIND_TOOL
from rlreplay.model import Span, Trajectory

LOGPROB_KEYS = ("response_logprobs", "rollout_log_probs", "log_probs", "logprobs")
TRAINER_LOGPROB_KEYS = ("old_log_probs", "trainer_log_probs", "log_probs", "logprobs")
MAX_TOKENS = 20_000


_NUMBERS = re.compile(r"\[\s*((?:-?[0-9][0-9.eE+-]*,?\s*)+)\]")  # a list of numbers: one line


def pretty(value: Any, limit: int = 4000) -> str:
    """JSON text of a value for display (strings as they are), cut at ``limit`` characters."""
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
            text = _NUMBERS.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
        except TypeError:
            text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text):,} characters)"


_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def plain(text: Any) -> str:
    """Decoded text without chat-template markers such as ``<|im_end|>`` (token ids as they are)."""
    if not isinstance(text, str):
        return " ".join(map(str, text)) if isinstance(text, list) else ""
    return _SPECIAL.sub("", text)


# ---- conversation ------------------------------------------------------------------------------


@dataclass
class Message:
    role: str
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments" (text)}
    tokens: int | None = None


def messages(traj: Trajectory, decoder: Any, adapter: Any = None) -> list[Message]:
    """The conversation as OpenAI-style chat messages (system, user, assistant, tool); without a
    tokenizer, the turns (prompt, assistant, tool) with their token ids."""
    from rlreplay.text.adapters import openai_messages

    if decoder is None:
        return _id_messages(traj)
    out = []
    for m in openai_messages(traj, decoder, adapter):
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            calls.append({"name": fn.get("name"), "arguments": _pretty_arguments(fn.get("arguments"))})
        out.append(Message(str(m.get("role")), str(m.get("content") or ""), calls))
    return out


def prompt_text(traj: Trajectory, decoder: Any, adapter: Any = None) -> str:
    """The prompt's first user message (the question), without the chat template."""
    if decoder is None:
        return ""
    users = [m.content for m in messages(traj, decoder, adapter) if m.role == "user"]
    return users[0] if users else ""


def _id_messages(traj: Trajectory) -> list[Message]:
    from rlreplay.text.adapters import turns

    out = []
    for turn in turns(traj):
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


TEXT_FIELDS = (("inputs", "prompt_ids"), ("output", "token_ids"), ("output", "response_ids"))


def _texts(span: Span, decoder: Any) -> list[tuple[str, str, int]]:
    """The span's token-id lists decoded (a model call's prompt and answer)."""
    if decoder is None:
        return []
    found = []
    for where, key in TEXT_FIELDS:
        value = getattr(span, where)
        ids = value.get(key) if isinstance(value, dict) else None
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            found.append((key, ids))
    if not found:
        return []
    texts = decoder.decode_many([ids for _, ids in found])
    return [(key, text, len(ids)) for (key, ids), text in zip(found, texts)]


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
        "tool_errors": sum(1 for s in tools if s.status == "error"),
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
                "error": span.error,
                "ms": span.duration_s * 1000,
            }
        )
    return out


# ---- tokens ------------------------------------------------------------------------------------


@dataclass
class TokenView:
    html: Markup
    count: int
    has_logprobs: bool
    has_mismatch: bool
    mismatch_note: str | None = None
    truncated: bool = False
    has_entropy: bool = False
    minimap: Markup | None = None
    scale: dict[str, float] = field(default_factory=dict)


#: log-prob shown at full colour (and below); mismatch |Δ| likewise
LOGPROB_FULL = -5.0
MISMATCH_FULL = 1.0
#: responses longer than this get a minimap
MINIMAP_FROM = 1500
MINIMAP_CELLS = 240
ENTROPY_KEYS = ("entropy", "entropies", "token_entropy")


def _floats(value: Any, n: int) -> list[float | None] | None:
    if isinstance(value, list) and len(value) == n and all(isinstance(v, (int, float)) for v in value[:1]):
        return [float(v) if isinstance(v, (int, float)) else None for v in value]
    return None


def _first(d: dict[str, Any], keys: tuple[str, ...], n: int) -> list[float | None] | None:
    for key in keys:
        found = _floats(d.get(key), n)
        if found is not None:
            return found
    return None


def _response(traj: Trajectory) -> tuple[list[int], list[int], list[float | None] | None]:
    """Response ids, mask (1 model, 0 tool) and rollout log-probs, from the agent span or the turns."""
    from rlreplay.text.adapters import turns
    from rlreplay.text.conversation import ROLE_ASSISTANT, ROLE_PROMPT

    agents = [s for s in traj.by_kind(KIND_AGENT) if isinstance(s.output, dict)]
    for agent in agents:
        out = agent.output
        ids, mask = out.get("response_ids"), out.get("response_mask")
        if isinstance(ids, list) and isinstance(mask, list) and len(mask) >= len(ids):
            return ids, [int(bool(m)) for m in mask[: len(ids)]], _first(out, LOGPROB_KEYS, len(ids))
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
    return ids, mask, lps if any(v is not None for v in lps) else None


def _aligned(value: Any, n: int) -> list[float | None] | None:
    """A list of numbers cut or padded (None) to ``n`` entries (the trainer may pad or trim)."""
    if not isinstance(value, list) or not value or not isinstance(value[0], (int, float)):
        return None
    out = [float(v) if isinstance(v, (int, float)) else None for v in value[:n]]
    return out + [None] * (n - len(out))


def _trainer_logprobs(
    traj: Trajectory, n: int, keys: tuple[str, ...] = TRAINER_LOGPROB_KEYS
) -> list[float | None] | None:
    """Per-token trainer values (log-probs unless ``keys`` says) from the latest ``signals`` span."""
    for span in sorted(traj.by_kind(KIND_SIGNALS), key=lambda s: s.end_ns, reverse=True):
        for value in (span.output, span.attributes):
            if keys is not TRAINER_LOGPROB_KEYS and not isinstance(value, dict):
                continue
            candidates = [value.get(k) for k in keys] if isinstance(value, dict) else [value]
            for candidate in candidates:
                found = _aligned(candidate, n)
                if found is not None:
                    return found
    return None


def _entropy(traj: Trajectory, n: int) -> list[float | None] | None:
    """Per-token entropy, when the rollout or the trainer recorded it."""
    for agent in traj.by_kind(KIND_AGENT):
        if isinstance(agent.output, dict):
            for key in ENTROPY_KEYS:
                found = _aligned(agent.output.get(key), n)
                if found is not None:
                    return found
    return _trainer_logprobs(traj, n, ENTROPY_KEYS)


def tokens(traj: Trajectory, decoder: Any) -> TokenView | None:
    """Each response token as a ``<span>`` carrying its mask, log-prob, mismatch and entropy as
    colour variables and a tooltip; a minimap of the whole response when it is long."""
    ids, mask, lps = _response(traj)
    if not ids:
        return None
    truncated = len(ids) > MAX_TOKENS
    ids, mask = ids[:MAX_TOKENS], mask[:MAX_TOKENS]
    lps = lps[:MAX_TOKENS] if lps else None
    trainer = _trainer_logprobs(traj, len(ids))
    entropy = _entropy(traj, len(ids))
    top_entropy = max((e for e in entropy or () if e is not None), default=0.0) or 1.0
    pieces = decoder.decode_many([[i] for i in ids]) if decoder is not None else [f"{i} " for i in ids]
    parts = []
    heat: list[tuple[float, float, float, int]] = []
    for k, (tid, m, piece) in enumerate(zip(ids, mask, pieces)):
        lp = lps[k] if lps else None
        tip = f"#{k} id {tid} · {'model' if m else 'tool'} · {piece!r}"
        style = []
        lp_v = mm_v = en_v = 0.0
        if lp is not None and math.isfinite(lp):
            tip += f" · logprob {lp:.4f}"
            lp_v = max(0.0, min(1.0, lp / LOGPROB_FULL))
            style.append(f"--lp:{lp_v:.3f}")
        if trainer is not None and trainer[k] is not None and lp is not None:
            diff = abs(trainer[k] - lp)
            tip += f" · trainer {trainer[k]:.4f} (|Δ| {diff:.4f})"
            mm_v = min(1.0, diff / MISMATCH_FULL)
            style.append(f"--mm:{mm_v:.3f}")
        if entropy is not None and entropy[k] is not None:
            tip += f" · entropy {entropy[k]:.4f}"
            en_v = min(1.0, entropy[k] / top_entropy)
            style.append(f"--en:{en_v:.3f}")
        heat.append((lp_v, mm_v, en_v, m))
        parts.append(
            f'<span class="tk m{m}" id="tk{k}" data-tip="{escape(tip)}"'
            + (f' style="{";".join(style)}"' if style else "")
            + f">{escape(piece)}</span>"
        )
    scale = {"logprob": LOGPROB_FULL, "mismatch": MISMATCH_FULL, "entropy": top_entropy}
    note = None
    if trainer is None:
        scalars = [
            s.attributes
            for s in traj.by_kind(KIND_SIGNALS)
            if isinstance(s.attributes, dict) and "logprob_diff_max" in s.attributes
        ]
        note = "no per-token trainer log-probs recorded" + (
            f" (logprob_diff_max {scalars[-1]['logprob_diff_max']})" if scalars else ""
        )
    return TokenView(
        Markup("".join(parts)),
        len(ids),
        lps is not None,
        trainer is not None,
        note,
        truncated,
        entropy is not None,
        _minimap(heat) if len(ids) >= MINIMAP_FROM else None,
        scale,
    )


def _minimap(heat: list[tuple[float, float, float, int]]) -> Markup:
    """The response in cells (the worst token of each), each linking to its first token."""
    per = math.ceil(len(heat) / MINIMAP_CELLS)
    cells = []
    for start in range(0, len(heat), per):
        chunk = heat[start : start + per]
        lp, mm, en = (max(c[i] for c in chunk) for i in range(3))
        tool = 0 if any(c[3] == 0 for c in chunk) else 1
        cells.append(
            f'<a class="cell m{tool}" href="#tk{start}" style="--lp:{lp:.3f};--mm:{mm:.3f};--en:{en:.3f}" '
            f'data-tip="tokens {start}–{start + len(chunk) - 1}"></a>'
        )
    return Markup(f'<div class="minimap" id="minimap">{"".join(cells)}</div>')
