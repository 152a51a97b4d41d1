"""One trajectory as a conversation: the prompt, then alternating assistant and tool turns.

Turns and their counts are defined here, once, from the fields a framework adapter names
(:class:`ConversationFields`): which hold the prompt, the response and its mask. The source of
truth is the agent span's output (e.g. verl's ``AgentLoopOutput``): ``prompt_ids``,
``response_ids`` and ``response_mask`` (1 = model token, 0 = tool/observation token). The
response splits into contiguous runs of equal mask; runs of 1 are assistant turns, runs of 0
tool turns. Assistant turns get the span id of their model call (``llm`` spans, in order) and
the tool calls its parser found (``parser`` spans). Without an agent span or a mask, the
``llm`` spans alone give the turns: each call's output is an assistant turn, and whatever the
next call's prompt adds after it is a tool turn.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_PARSER

if TYPE_CHECKING:
    from rlreplay.model import Span, Trajectory

ROLE_PROMPT = "prompt"
ROLE_ASSISTANT = "assistant"
ROLE_TOOL = "tool"


class BatchDecoder(Protocol):
    def decode_many(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]: ...


@dataclass(frozen=True)
class ConversationFields:
    """Where a conversation's token ids live in recorded spans (names tried in order); a framework
    adapter names its own (``fields``)."""

    prompt: tuple[str, ...] = ("prompt_ids",)  # agent output: the prompt
    response: tuple[str, ...] = ("response_ids",)  # agent output: the whole response
    mask: tuple[str, ...] = ("response_mask",)  # agent output: 1 = model token, 0 = tool token
    llm_prompt: tuple[str, ...] = ("prompt_ids",)  # llm inputs (or inputs["kwargs"])
    llm_output: tuple[str, ...] = ("token_ids", "output_ids")  # llm output
    log_probs: tuple[str, ...] = ("log_probs", "response_logprobs")
    reward: tuple[str, ...] = ("reward_score", "reward")  # agent/trajectory output
    stop_reason: tuple[str, ...] = ("stop_reason", "finish_reason")  # llm output: why it stopped
    max_tokens: tuple[str, ...] = ("max_tokens", "max_new_tokens")  # llm inputs (or sampling params)
    #: stop reasons meaning the call hit its length limit
    length_stops: tuple[str, ...] = ("length", "max_tokens")
    #: where a trajectory's response and its rollout log-probs are (``rlreplay.mismatch``):
    #: ``RESPONSE_IN_AGENT``, the agent span's response ids, mask and log-probs; or
    #: ``RESPONSE_IN_CALLS``, each model call's generated ids and log-probs, in call order (model
    #: tokens only: the trainer's log-probs come one per generated token, in that order)
    response_in: str = "agent"


RESPONSE_IN_AGENT = "agent"
RESPONSE_IN_CALLS = "llm"


@dataclass
class Turn:
    role: str  # "prompt" | "assistant" | "tool"
    token_ids: list[int]
    text: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"}
    span_id: str | None = None  # the llm span that generated an assistant turn
    start: int = 0  # token offset within the response (the prompt starts at 0 too)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "token_ids": self.token_ids,
            "text": self.text,
            "tool_calls": self.tool_calls,
            "span_id": self.span_id,
            "start": self.start,
        }


def turns(traj: Trajectory, decoder: BatchDecoder | None = None, adapter: Any = None) -> list[Turn]:
    """The trajectory's turns in order, as its framework adapter splits them (``adapter``, e.g.
    ``rlreplay.adapters.registry.adapter_for_run(run)``; None: the generic fields).

    With ``decoder``, ``text`` is filled in one batched call.
    """
    result = adapter.turns(traj) if adapter is not None else segment(traj, ConversationFields())
    if decoder is not None and result:
        texts = decoder.decode_many([t.token_ids for t in result], skip_special_tokens=False)
        for turn, text in zip(result, texts):
            turn.text = text
    return result


def segment(traj: Trajectory, fields: ConversationFields) -> list[Turn]:
    """Turns from the agent span's prompt/response/mask fields, else from the llm spans alone."""
    agent = _agent_span(traj, fields)
    llm_spans = _descendants(traj, agent, KIND_LLM)
    parser_spans = _descendants(traj, agent, KIND_PARSER)
    out = agent.output if agent is not None else None
    result = None
    if isinstance(out, dict):
        response = first_field(out, fields.response)
        mask = first_field(out, fields.mask)
        if _is_ids(response) and _is_ids(mask) and (mask or not response):
            prompt_ids = first_field(out, fields.prompt)
            if not _is_ids(prompt_ids):
                prompt_ids = _llm_prompt(llm_spans[0], fields) if llm_spans else []
            result = _from_mask(prompt_ids or [], response, mask, llm_spans, fields)
    if result is None:
        result = _from_llm_spans(llm_spans, fields)
    _attach_tool_calls(result, llm_spans, parser_spans)
    return result


def first_field(source: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in source:
            return source[name]
    return None


# ---- span lookup ------------------------------------------------------------------------------


def conversation_span(traj: Trajectory, fields: ConversationFields) -> Span | None:
    """The agent span holding the conversation: the first with a response mask, else the first."""
    return _agent_span(traj, fields)


def _agent_span(traj: Trajectory, fields: ConversationFields) -> Span | None:
    agents = traj.by_kind(KIND_AGENT)
    if not agents:
        return None
    with_mask = [s for s in agents if isinstance(s.output, dict) and any(m in s.output for m in fields.mask)]
    return (with_mask or agents)[0]


def _descendants(traj: Trajectory, root: Span | None, kind: str) -> list[Span]:
    """Spans of ``kind`` under ``root`` (all of the trajectory's when no root), by start time."""
    if root is None:
        found = traj.by_kind(kind)
    else:
        found = []
        stack = list(root.children)
        while stack:
            span = stack.pop()
            if span.kind == kind:
                found.append(span)
            stack.extend(span.children)
        if not found:  # agent spans recorded flat beside their calls
            found = traj.by_kind(kind)
    return sorted(found, key=lambda s: (s.start_ns, s.end_ns))


def _is_ids(value: Any) -> bool:
    """A list of ints, or a 1-d numpy array of integers (ids a reader left as numpy)."""
    if isinstance(value, list):
        return all(type(v) is int for v in value[:1])
    return type(value).__name__ == "ndarray" and value.ndim == 1 and value.dtype.kind in "iu"


def llm_output_ids(output: Any, fields: ConversationFields) -> list[int] | None:
    """The ids an llm span generated (its output's id field, or the output itself)."""
    if isinstance(output, dict):
        ids = first_field(output, fields.llm_output)
        return ids if _is_ids(ids) else None
    return output if _is_ids(output) else None


def llm_prompt_ids(inputs: Any, fields: ConversationFields) -> list[int] | None:
    """The context an llm span was called with (top-level or ``**kwargs`` argument)."""
    if not isinstance(inputs, dict):
        return None
    for source in (inputs, inputs.get("kwargs")):
        if isinstance(source, dict):
            ids = first_field(source, fields.llm_prompt)
            if _is_ids(ids):
                return ids
    return None


def _llm_output_ids(span: Span, fields: ConversationFields) -> list[int] | None:
    return llm_output_ids(span.output, fields)


def _llm_prompt(span: Span, fields: ConversationFields) -> list[int] | None:
    return llm_prompt_ids(span.inputs, fields)


# ---- segmentation -----------------------------------------------------------------------------


def _mask_runs(mask: Sequence[int], length: int) -> list[tuple[int, int, int]]:
    """(value, start, end) for each run of equal mask values over the first ``length`` tokens."""
    import numpy as np

    runs: list[tuple[int, int, int]] = []
    n = min(length, len(mask))
    marks = np.asarray(mask[:n])
    if marks.ndim == 1 and marks.dtype.kind in "biuf":  # numbers: the run ends found in one pass
        on = marks != 0
        ends = [*(np.flatnonzero(on[1:] != on[:-1]) + 1).tolist(), n] if n else []
        start = 0
        for end in ends:
            runs.append((int(on[start]), start, end))
            start = end
    else:
        start = 0
        for i in range(1, n + 1):
            if i == n or (mask[i] != 0) != (mask[start] != 0):
                runs.append((1 if mask[start] else 0, start, i))
                start = i
    if n < length:  # ids past the mask: unknown origin, shown as tool output
        runs.append((0, n, length))
    return runs


def _from_mask(
    prompt_ids: list[int],
    response_ids: list[int],
    mask: list[int],
    llm_spans: list[Span],
    fields: ConversationFields,
) -> list[Turn]:
    result = [Turn(ROLE_PROMPT, list(prompt_ids), start=0)]
    outputs = [_llm_output_ids(s, fields) for s in llm_spans]
    next_llm = 0
    for value, start, end in _mask_runs(mask, len(response_ids)):
        ids = response_ids[start:end]
        if not value:
            result.append(Turn(ROLE_TOOL, ids, start=start))
            continue
        # Model calls with no tool turn between them merge into one run: split it back when the
        # run is exactly their outputs back to back.
        count = _split_count(ids, outputs[next_llm:])
        offset = start
        for k in range(count):
            piece = outputs[next_llm + k] if count > 1 else ids
            span = llm_spans[next_llm + k] if next_llm + k < len(llm_spans) else None
            result.append(
                Turn(ROLE_ASSISTANT, list(piece), span_id=span.span_id if span else None, start=offset)
            )
            offset += len(piece)
        next_llm += count
    return result


def _split_count(ids: list[int], outputs: list[list[int] | None]) -> int:
    total = 0
    for k, out in enumerate(outputs):
        if out is None:
            break
        if ids[total : total + len(out)] != out:
            break
        total += len(out)
        if total == len(ids):
            return k + 1
        if total > len(ids):
            break
    return 1


def _from_llm_spans(llm_spans: list[Span], fields: ConversationFields) -> list[Turn]:
    if not llm_spans:
        return []
    prompt = _llm_prompt(llm_spans[0], fields) or []
    result = [Turn(ROLE_PROMPT, list(prompt), start=0)]
    context = list(prompt)
    offset = 0
    for span in llm_spans:
        this_prompt = _llm_prompt(span, fields)
        if (
            this_prompt is not None
            and len(this_prompt) > len(context)
            and this_prompt[: len(context)] == context
        ):
            extra = this_prompt[len(context) :]
            result.append(Turn(ROLE_TOOL, extra, start=offset))
            offset += len(extra)
            context = list(this_prompt)
        ids = _llm_output_ids(span, fields) or []
        result.append(Turn(ROLE_ASSISTANT, list(ids), span_id=span.span_id, start=offset))
        offset += len(ids)
        context.extend(ids)
    return result


# ---- tool calls -------------------------------------------------------------------------------


def _attach_tool_calls(result: list[Turn], llm_spans: list[Span], parser_spans: list[Span]) -> None:
    assistant = [t for t in result if t.role == ROLE_ASSISTANT]
    if not parser_spans or not assistant:
        return
    by_llm = {t.span_id: t for t in assistant if t.span_id}
    for i, parser in enumerate(parser_spans):
        calls = function_calls(parser.output)
        if not calls:
            continue
        target = None
        if llm_spans:  # the parser reads the output of the latest model call before it
            before = [s for s in llm_spans if s.start_ns <= parser.start_ns]
            if before:
                target = by_llm.get(before[-1].span_id)
        elif i < len(assistant):
            target = assistant[i]
        if target is not None:
            target.tool_calls.extend(calls)


def function_calls(output: Any) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` from a parser's output, e.g. ``(content, [FunctionCall, ...])``."""
    candidates: list[Any] = []
    if isinstance(output, dict):
        candidates = [output.get("tool_calls"), output.get("function_calls"), output.get("calls")]
    elif isinstance(output, list):
        candidates = [output, *output]
    for cand in candidates:
        if isinstance(cand, list) and cand and all(isinstance(c, dict) and "name" in c for c in cand):
            return [_one_call(c) for c in cand]
    return []


def _one_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return {"name": fn.get("name", call.get("name")), "arguments": args}
