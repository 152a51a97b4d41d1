"""Agent frameworks from PyPI, each running its own tool-using loop through ``rlreplay proxy`` in
front of the real model server (it stands in for vLLM and calls the offered tool, see
``model_server.py``): the ``openai`` client by hand (streamed, with the log-probs it asked for,
named by header; and whole answers joined by continuation), langgraph's ReAct agent over
langchain-openai's ``ChatOpenAI``, and pydantic-ai's ``Agent`` over its OpenAI chat model. The
proxy records every loop; then each runs again against ``rlreplay proxy --replay --on-diverge
fail`` with the server not asked, gets the same answers, and ``compare`` finds every pair the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from support import rlreplay_proc

from rlreplay.read.open import open_run

pytestmark = pytest.mark.timeout(1200)
KEY = "sk-frameworks-test-5b2e"  # the endpoint's key: passes through, never stored
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _plain(value: Any) -> Any:
    """An answer without what differs between two calls of one request (ids, times)."""
    data = value.model_dump() if hasattr(value, "model_dump") else value
    data = json.loads(json.dumps(data, default=str))
    if isinstance(data, dict):
        for key in ("id", "created", "system_fingerprint"):
            data.pop(key, None)
    return data


def openai_loop(base: str, question: str, stream: bool, headers: dict[str, str]) -> list[Any]:
    """The openai client's own loop: ask, run the tool calls, ask again, until an answer without any."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    got: list[Any] = []
    for _ in range(4):
        asked = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
        asked |= {"logprobs": True, "top_logprobs": 2}
        if stream:
            chunks = list(client.chat.completions.create(**asked, stream=True, extra_headers=headers))
            got.append([_plain(c) for c in chunks])
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls: dict[int, dict[str, Any]] = {}
            for c in chunks:
                for call in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                    slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += call.id or ""
                    slot["name"] += (call.function.name or "") if call.function else ""
                    slot["arguments"] += (call.function.arguments or "") if call.function else ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        else:
            answer = client.chat.completions.create(**asked, extra_headers=headers)
            got.append(_plain(answer))
            assert answer.choices[0].logprobs is not None  # what it asked for, as the server wrote it
            text = answer.choices[0].message.content or ""
            tool_calls = [c.model_dump() for c in answer.choices[0].message.tool_calls or []]
        messages.append(
            {
                "role": "assistant",
                "content": text or None,
                **({"tool_calls": tool_calls} if tool_calls else {}),
            }
        )
        if not tool_calls:
            return got
        for call in tool_calls:
            result = add(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
    raise AssertionError("the loop did not end")


def langgraph_loop(base: str, question: str) -> list[Any]:
    """langgraph's own agent loop: a model node, langgraph's ToolNode, and its tools_condition."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    tools = [tool(add)]
    model = ChatOpenAI(
        model="m", base_url=f"{base}/v1", api_key=KEY, temperature=0, max_tokens=6, max_retries=0
    )
    bound = model.bind_tools(tools)
    graph = StateGraph(MessagesState)
    graph.add_node("model", lambda state: {"messages": [bound.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    result = graph.compile().invoke({"messages": [("user", question)]})
    return [
        {
            "type": m.type,
            "content": m.content,
            "tool_calls": [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])],
        }
        for m in result["messages"]
    ]


def pydantic_ai_loop(base: str, question: str) -> list[Any]:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=f"{base}/v1", api_key=KEY))
    agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 6}, tools=[add])
    result = agent.run_sync(question)
    return [
        [(type(p).__name__, getattr(p, "content", None), getattr(p, "args", None)) for p in m.parts]
        for m in result.all_messages()
    ]


def every_loop(base: str) -> dict[str, Any]:
    return {
        "openai streamed, named": openai_loop(
            base, "What is 2+3?", True, {"X-Rlreplay-Trajectory": "step=0,sample_index=100"}
        ),
        "openai by continuation": openai_loop(base, "What is 4+5?", False, {}),
        "langgraph": langgraph_loop(base, "What is 6+7?"),
        "pydantic-ai": pydantic_ai_loop(base, "What is 8+9?"),
    }


def test_agent_frameworks_record_and_replay_their_own_tool_loops(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    recording = start_proxy("--upstream", model_server, "--out", "recorded")
    recorded = every_loop(recording.url)
    assert recording.stop() == 0, recording.stderr
    rows = open_run(tmp_path / "recorded").trajectories().to_pylist()
    assert len(rows) == 4 and all(r["model_calls"] == 2 and r["tool_calls"] == 1 for r in rows), rows
    stored = b"".join(p.read_bytes() for p in (tmp_path / "recorded").rglob("*") if p.is_file())
    assert KEY.encode() not in stored

    # no --upstream: the recording answers every call, or the call fails (409)
    replay = start_proxy("--replay", "recorded", "--on-diverge", "fail", "--out", "replayed")
    replayed = every_loop(replay.url)
    assert replay.stop() == 0, replay.stderr
    assert "8 calls served; 0 trajectories diverged; 0 recorded trajectories never asked for" in replay.stderr
    assert replayed == recorded
    compared = rlreplay_proc("compare", "recorded", "replayed", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "4 pairs: 4 same, 0 changed, 0 only in A, 0 only in B" in compared.stdout
