"""What a proxy replay says about itself: a diverged trajectory is not listed ``ok``, and calls
refused with 409 are counted in the stop line and in ``rlreplay info``; a proxy run lists the
model's tool calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import rlreplay_proc

from rlreplay.read.open import open_run

pytestmark = pytest.mark.timeout(600)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def ask(url: str, text: str, key: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"X-Rlreplay-Trajectory": key}, timeout=120
    )


def test_a_diverged_replay_is_not_ok_and_refused_calls_are_counted(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    recording = start_proxy("--upstream", model_server, "--out", "recorded")
    for n in range(2):
        assert ask(recording.url, f"Say {n}.", f"step=0,sample_index={n}").status_code == 200
    assert recording.stop() == 0, recording.stderr

    live = start_proxy("--replay", "recorded", "--upstream", model_server, "--out", "live")
    assert ask(live.url, "Say 0.", "step=0,sample_index=0").status_code == 200  # served
    assert ask(live.url, "Say something else.", "step=0,sample_index=1").status_code == 200  # diverged
    assert live.stop() == 0, live.stderr
    rows = {r["sample_index"]: r for r in open_run(tmp_path / "live").trajectories().to_pylist()}
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "error" and "replay diverged" in rows[1]["error"]
    listed = rlreplay_proc("ls", "live", "--json", cwd=tmp_path)
    assert sorted(json.loads(line)["status"] for line in listed.stdout.splitlines()) == ["error", "ok"]

    failing = start_proxy("--replay", "recorded", "--out", "failed", "--on-diverge", "fail")
    assert ask(failing.url, "Say 0.", "step=0,sample_index=0").status_code == 200
    for text, key in (("Say something else.", "step=0,sample_index=1"), ("New.", "step=5,sample_index=5")):
        assert ask(failing.url, text, key).status_code == 409
    assert failing.stop() == 0, failing.stderr
    assert "2 calls refused (409)" in failing.stderr
    info = rlreplay_proc("info", "failed", "--json", cwd=tmp_path)
    assert json.loads(info.stdout)["refused_calls"] == 2, info.stdout


def test_a_proxy_run_lists_the_models_tool_calls(model_server: str, start_proxy: Any, tmp_path: Path) -> None:
    """The model server answers with tool calls when it is given tools; ``ls`` counts them,
    streamed or not, as the answers the client got hold them."""
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    got = []
    for n, stream in ((0, False), (1, True)):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "What is 2+3? Use the tool."}],
            "tools": TOOLS,
            "max_tokens": 40,
            "temperature": 0,
            "stream": stream,
        }
        answer = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json=body,
            headers={"X-Rlreplay-Trajectory": f"step=0,sample_index={n}"},
            timeout=300,
        )
        assert answer.status_code == 200
        got.append(answer)
    assert proxy.stop() == 0, proxy.stderr
    plain = got[0].json()["choices"][0]["message"].get("tool_calls") or []
    streamed = {
        call["index"]
        for line in got[1].text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
        for call in (choice.get("delta") or {}).get("tool_calls") or ()
    }
    assert plain and streamed  # the server called the tool both times
    rows = {r["sample_index"]: r for r in open_run(tmp_path / "run").trajectories().to_pylist()}
    assert rows[0]["tool_calls"] == len(plain) and rows[1]["tool_calls"] == len(streamed)
