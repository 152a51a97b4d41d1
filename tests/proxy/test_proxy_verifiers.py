"""A real agent framework from PyPI through ``rlreplay proxy``: verifiers 0.4.0's ``vf-eval`` runs its
own rollouts (the ``user-sim`` environment: a modeled user and the assistant talk for two turns each,
every turn a call of verifiers' chat program through verifiers' model-call interception and client)
against the real model server, which stands in for vLLM (it needs a GPU). The proxy records each
agent's conversation as a trajectory; then ``vf-eval`` runs again against ``rlreplay proxy --replay``
with no server behind it, and gets the same rollouts, and ``compare`` finds every pair the same.

verifiers' harnesses install their agent programs with ``uv`` at run time; the test's harness
(``verifiers_env/proxy_arith.py``) runs verifiers' own ``null`` chat program with this Python instead,
so nothing is downloaded.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import free_port, rlreplay_proc

from rlreplay.format import payload
from rlreplay.proxy.protocol import stream_chunks
from rlreplay.read.open import open_run
from rlreplay.read.replays import replay_rows

pytestmark = pytest.mark.timeout(1500)
HERE = Path(__file__).resolve().parent
KEY = "sk-verifiers-test-77d0"  # the model endpoint's key: passes through, never stored
TASKS = 2


def vf_eval(base_url: str, tmp_path: Path, out: str) -> list[dict[str, Any]]:
    """``vf-eval`` of two sums in the user-sim environment through ``base_url``; its episodes."""
    vf_eval_bin = Path(sys.executable).with_name("vf-eval")
    home = tmp_path / "home"  # verifiers keeps its runtimes' folders under ~/.cache
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "PYTHONPATH": str(HERE / "verifiers_env"),
        "VF_TEST_KEY": KEY,
        "OMP_NUM_THREADS": "1",
    }
    seats = []
    for seat in ("assistant", "user"):
        seats += [f"--env.{seat}.harness.id", "proxy_arith", f"--env.{seat}.runtime.type", "subprocess"]
    argv = [
        str(vf_eval_bin),
        "proxy_arith",
        "--env.id",
        "user-sim",
        *seats,
        "--env.user.max-turns",
        "2",
        "--model",
        "SmolLM2-135M-Instruct",
        "--client.base-url",
        f"{base_url}/v1",
        "--client.api-key-var",
        "VF_TEST_KEY",
        "--sampling.max-tokens",
        "6",
        "--sampling.temperature",
        "0",
        "-n",
        str(TASKS),
        "-r",
        "1",
        "--no-push",
        "--no-rich",
        "-o",
        out,
    ]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [traces] = (tmp_path / out).glob("*/traces.jsonl")
    return [json.loads(line) for line in traces.read_text().splitlines()]


def conversations(episodes: list[dict[str, Any]]) -> list[tuple]:
    """Each agent's whole conversation as verifiers recorded it: (role, text) per message."""
    found = []
    for episode in episodes:
        assert episode["ok"], episode["errors"]
        for trace in episode["traces"]:
            found.append(tuple((n["message"]["role"], n["message"]["content"]) for n in trace["nodes"]))
    return sorted(found)


def outcome(episodes: list[dict[str, Any]]) -> list[tuple]:
    """What a rollout came to, per task and agent: its conversation, rewards, why it stopped."""
    found = []
    for episode in episodes:
        for trace in episode["traces"]:
            messages = tuple((n["message"]["role"], n["message"]["content"]) for n in trace["nodes"])
            rewards = json.dumps(trace["rewards"], sort_keys=True)
            found.append(
                (
                    episode["task"]["data"]["idx"],
                    trace["agent"]["name"],
                    messages,
                    rewards,
                    trace["stop_condition"],
                )
            )
    return sorted(found)


def streamed_text(stream: list[Any]) -> str:
    """The assistant text of a streamed chat answer, from the chunks the client got."""
    parts = []
    for chunk in stream:
        if isinstance(chunk, dict):
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def ui_page(run: Path, trajectory_id: str) -> str:
    """The web UI's page of one trajectory of ``run`` (``rlreplay ui`` as its own process), as text."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "ui", str(run), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                home = httpx.get(f"http://127.0.0.1:{port}/", follow_redirects=True, timeout=30)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "rlreplay ui did not start"
                time.sleep(0.3)
        page = httpx.get(f"{home.url}t/{trajectory_id}", timeout=60)
        assert page.status_code == 200, page.text[-2000:]
        return html.unescape(page.text)
    finally:
        proc.terminate()
        proc.wait(30)


def test_vf_eval_recorded_through_the_proxy_replays_with_the_server_gone(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    # the served model's tokenizer (vLLM's model card names its folder): show and audit read ids as text
    tokenizer = httpx.get(f"{model_server}/v1/models").json()["data"][0]["root"]
    recording = start_proxy("--upstream", model_server, "--out", "recorded", "--tokenizer", tokenizer)
    episodes = vf_eval(recording.url, tmp_path, "vf-recorded")
    assert recording.stop() == 0, recording.stderr
    assert len(episodes) == TASKS

    # one trajectory per agent's conversation, its calls in order, as verifiers saw them
    run = open_run(tmp_path / "recorded")
    recorded = {}
    calls = 0
    finish_reasons = sorted(c["finish_reason"] for e in episodes for t in e["traces"] for c in t["calls"])
    span_finish = []
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        spans = sorted((s for s in traj.spans if s.kind == "llm"), key=lambda s: s.start_ns)
        calls += len(spans)
        for span in spans:
            assert span.name == "chat.completions" and span.inputs["stream"] is True
            ids, log_probs = list(span.output["token_ids"]), list(span.output["log_probs"])
            assert 0 < len(ids) <= 6 and len(log_probs) == len(ids) and len(span.inputs["prompt_ids"]) > 0
            span_finish.append(span.output["finish_reason"])
        last = spans[-1]
        messages = [(m["role"], m["content"]) for m in last.inputs["messages"]]
        stream = stream_chunks(payload.from_json(last.output["wire"], None))  # the bytes the client got
        recorded[traj.id] = (*messages, ("assistant", streamed_text(stream)))
    assert sorted(recorded.values()) == conversations(episodes)
    assert calls == sum(len(t["calls"]) for e in episodes for t in e["traces"]) == 4 * TASKS
    assert sorted(span_finish) == finish_reasons
    stored = b"".join(p.read_bytes() for p in (tmp_path / "recorded").rglob("*") if p.is_file())
    assert KEY.encode() not in stored

    # the run reads like any other: the audit finds each answer cut by its length limit
    audited = rlreplay_proc("audit", "recorded", cwd=tmp_path)
    cut = finish_reasons.count("length")
    assert audited.returncode == (1 if cut else 0), audited.stderr
    assert f"audited {2 * TASKS} trajectories" in audited.stdout
    lines = {line.split()[0]: line.split()[1:] for line in audited.stdout.splitlines()[1:12] if line.strip()}
    assert lines["truncated"][0] == str(cut) and lines["garbled"][1:] == ["findings"]
    first = run.trajectories()["id"][0].as_py()
    shown = rlreplay_proc("show", "recorded", first, cwd=tmp_path)
    assert shown.returncode == 0 and "no tokenizer" not in shown.stdout + shown.stderr
    # the UI shows it as text: the trajectory's last answer, as verifiers saw it
    said = recorded[first][-1][1].strip()
    page = ui_page(tmp_path / "recorded", first)
    assert said and said in page and "no tokenizer" not in page

    # the same eval against the recording alone: no --upstream, the server cannot be reached
    replay = start_proxy("--replay", "recorded", "--out", "replayed", "--on-diverge", "fail")
    replayed = vf_eval(replay.url, tmp_path, "vf-replayed")
    assert replay.stop() == 0, replay.stderr
    assert outcome(replayed) == outcome(episodes)
    assert (
        f"{calls} calls served; 0 trajectories diverged; 0 recorded trajectories never asked for"
        in replay.stderr
    )
    assert {r["replay"] for r in replay_rows(open_run(tmp_path / "replayed")).values()} == {"served"}
    compared = rlreplay_proc("compare", "recorded", "replayed", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    pairs = 2 * TASKS
    assert f"{pairs} pairs: {pairs} same, 0 changed, 0 only in A, 0 only in B" in compared.stdout
