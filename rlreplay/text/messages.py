"""A trajectory as OpenAI chat messages: the form exports, the UI and tracing backends show.

``[{"role": "system"|"user"|"assistant"|"tool", "content": str, "tool_calls"?: [...],
"tool_call_id"?: str}]``. The turns come from the framework adapter (``rlreplay.hookspecs``);
system and user messages are the chat messages the prompt was rendered from when the agent span
recorded them, else the decoded prompt as one user message; a tool message's content is the
tool span's own output text when recorded, else the decoded tool turn without template markers.
"""

from __future__ import annotations

import json
from collections import deque
from typing import TYPE_CHECKING, Any

from rlreplay.format.kinds import KIND_TOOL

if TYPE_CHECKING:
    from rlreplay.model import Trajectory
    from rlreplay.text.conversation import BatchDecoder, Turn


def _content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else json.dumps(value, ensure_ascii=False)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def build_messages(
    adapter: Any, traj: Trajectory, turns: list[Turn], decoder: BatchDecoder | None
) -> list[dict[str, Any]]:
    """Messages from an adapter's turns; ``adapter`` supplies ``prompt_messages``, ``clean_text``,
    ``tool_texts`` and ``tool_output_text`` (see ``rlreplay.adapters.generic.GenericAdapter``)."""
    if decoder is not None and turns:
        texts = decoder.decode_many([t.token_ids for t in turns], skip_special_tokens=False)
    else:
        texts = [t.text or "" for t in turns]
    out: list[dict[str, Any]] = []
    recorded = adapter.prompt_messages(traj)
    if recorded:
        out.extend({"role": m["role"], "content": _content(m.get("content"))} for m in recorded)
    elif turns and turns[0].role == "prompt":
        out.append({"role": "user", "content": adapter.clean_text("user", texts[0])})
    tool_spans = sorted(traj.by_kind(KIND_TOOL), key=lambda s: (s.start_ns, s.end_ns))
    tool_outputs = deque(adapter.tool_output_text(s.output) for s in tool_spans)
    pending: deque[str] = deque()
    n_calls = 0
    for turn, text in zip(turns, texts):
        if turn.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": adapter.clean_text("assistant", text)}
            if turn.tool_calls:
                calls = []
                for call in turn.tool_calls:
                    call_id = call.get("id") or f"call_{n_calls}"
                    n_calls += 1
                    pending.append(call_id)
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": call.get("name"),
                                "arguments": _arguments(call.get("arguments")),
                            },
                        }
                    )
                message["tool_calls"] = calls
            out.append(message)
        elif turn.role == "tool":
            wanted = max(1, len(pending))
            if len(tool_outputs) >= wanted and all(o is not None for o in list(tool_outputs)[:wanted]):
                responses = [tool_outputs.popleft() for _ in range(wanted)]
            else:
                responses = adapter.tool_texts(text) or [""]
            for response in responses:
                message = {"role": "tool", "content": response}
                if pending:
                    message["tool_call_id"] = pending.popleft()
                out.append(message)
    return out
