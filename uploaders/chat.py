"""A trajectory's conversation as OpenAI chat messages, for the backends that show chats.

``rlreplay.adapters.registry.openai_messages`` (the framework adapter's) when it is available, else the
decoded conversation token2text put on the agent span.
"""

from __future__ import annotations

import json
from typing import Any

from rlreplay.format.schema import KIND_AGENT
from rlreplay.model import Trajectory


def messages(traj: Trajectory, decoder: Any) -> list[dict[str, Any]]:
    """The conversation in OpenAI chat form (``rlreplay.text.messages`` when available)."""
    try:
        from rlreplay.adapters.registry import openai_messages
    except ImportError:
        openai_messages = None
    if openai_messages is not None and decoder is not None:
        try:
            return list(openai_messages(traj, decoder))
        except Exception:
            pass
    return messages_from_text(traj)


def messages_from_text(traj: Trajectory) -> list[dict[str, Any]]:
    """Messages from the decoded conversation token2text put on the agent span."""
    for agent in traj.by_kind(KIND_AGENT)[:1]:
        conversation = agent.output.get("conversation") if isinstance(agent.output, dict) else None
        if not isinstance(conversation, list):
            break
        out = []
        for turn in conversation:
            role = {"prompt": "user"}.get(turn.get("role"), turn.get("role"))
            message: dict[str, Any] = {"role": role, "content": turn.get("text") or ""}
            calls = turn.get("tool_calls") or []
            if calls:
                message["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {
                            "name": str(c.get("name", "")),
                            "arguments": c["arguments"]
                            if isinstance(c.get("arguments"), str)
                            else json.dumps(c.get("arguments")),
                        },
                    }
                    for c in calls
                    if isinstance(c, dict)
                ]
            out.append(message)
        return out
    return []
