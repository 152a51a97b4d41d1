"""``rlreplay proxy`` in front of a real model server (it stands in for vLLM and SGLang, which need
GPUs): the client gets what it gets without the proxy, the run holds the token ids and log-probs the
server produced, calls join trajectories and steps, and a replay answers with the server gone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support import free_port, rlreplay_proc

from rlreplay.format import payload
from rlreplay.proxy.protocol import stream_chunks
from rlreplay.read.open import open_run
from rlreplay.read.replays import replay_rows

pytestmark = pytest.mark.timeout(900)
KEY = "sk-proxy-test-4f1c9a"  # an API key: passes through, never stored
CHAT = [{"role": "user", "content": "Name a colour."}]


def plain(answer: Any) -> Any:
    """An answer without what differs between two calls of the same request (ids, times)."""
    data = answer.model_dump() if hasattr(answer, "model_dump") else json.loads(json.dumps(answer))
    data.pop("id", None)
    data.pop("created", None)
    if isinstance(data.get("meta_info"), dict):
        for key in ("id", "e2e_latency"):
            data["meta_info"].pop(key, None)
    return data


def llm_spans(run_dir: Path) -> list[list[Any]]:
    """Each trajectory's llm spans, in call order, trajectories in listing order."""
    run = open_run(run_dir)
    out = []
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        spans = sorted((s for s in traj.spans if s.kind == "llm"), key=lambda s: s.start_ns)
        out.append((traj, spans))
    return out


def listing(run_dir: Path) -> list[dict[str, Any]]:
    return open_run(run_dir).trajectories().to_pylist()


def test_chat_answers_as_the_server_does_and_records_the_tokens_it_produced(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    through = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=KEY)
    direct = openai.OpenAI(base_url=f"{model_server}/v1", api_key=KEY)
    got = through.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    expected = direct.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert plain(got) == plain(expected)
    assert got.choices[0].logprobs is None and got.prompt_token_ids is None  # what it did not ask for
    # what the server produced, asked of it directly
    raw = httpx.post(
        f"{model_server}/v1/chat/completions",
        json={"model": "m", "messages": CHAT, "max_tokens": 4, "return_token_ids": True, "logprobs": True},
        timeout=120,
    ).json()
    assert proxy.stop() == 0, proxy.stderr
    [(_traj, [span])] = llm_spans(tmp_path / "run")
    assert span.name == "chat.completions"
    assert span.inputs["messages"] == CHAT and span.inputs["prompt_ids"] == raw["prompt_token_ids"]
    assert list(span.output["token_ids"]) == raw["choices"][0]["token_ids"]
    assert list(span.output["log_probs"]) == [c["logprob"] for c in raw["choices"][0]["logprobs"]["content"]]
    assert span.output["finish_reason"] == raw["choices"][0]["finish_reason"]
    assert span.output["usage"] == raw["usage"]
    as_sent = httpx.post(
        f"{model_server}/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4}
    )
    got_bytes = payload.from_json(span.output, None)["wire"]  # the answer as the client got it
    assert "body" not in span.output and plain(json.loads(got_bytes)) == plain(as_sent.json())
    stored = b"".join(p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert KEY.encode() not in stored


def test_streams_pass_chunk_by_chunk_and_a_continuing_call_joins_the_trajectory(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")

    async def chunks(base: str, messages: list[dict[str, Any]]) -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY)
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=3, stream=True)
        return [chunk async for chunk in stream]

    got = asyncio.run(chunks(proxy.url, CHAT))
    assert [plain(c) for c in got] == [plain(c) for c in asyncio.run(chunks(model_server, CHAT))]
    text = "".join(c.choices[0].delta.content or "" for c in got)
    turn2 = [*CHAT, {"role": "assistant", "content": text}, {"role": "user", "content": "Another one."}]
    sync = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=KEY)
    second = sync.chat.completions.create(model="m", messages=turn2, max_tokens=3)
    other = sync.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    expected = [
        httpx.post(
            f"{model_server}/v1/chat/completions",
            json={"model": "m", "messages": m, "max_tokens": n, "return_token_ids": True, "logprobs": True},
        ).json()
        for m, n in ((CHAT, 3), (turn2, 3))
    ]
    assert proxy.stop() == 0, proxy.stderr
    found = llm_spans(tmp_path / "run")
    assert sorted(len(spans) for _, spans in found) == [1, 2]  # the third call opened its own
    [spans] = [spans for _, spans in found if len(spans) == 2]
    for span, raw in zip(spans, expected):
        assert list(span.output["token_ids"]) == raw["choices"][0]["token_ids"]
        assert span.inputs["prompt_ids"] == raw["prompt_token_ids"]
        assert list(span.output["log_probs"]) == [
            c["logprob"] for c in raw["choices"][0]["logprobs"]["content"]
        ]
    # the stream as the client got it: its bytes, without the ids the proxy asked for
    stream = stream_chunks(payload.from_json(spans[0].output, None)["wire"])
    assert stream[-1] == "[DONE]" and all("token_ids" not in c["choices"][0] for c in stream[:-1])
    whole = json.loads(payload.from_json(spans[1].output, None)["wire"])
    assert whole["choices"][0]["message"]["content"] == second.choices[0].message.content
    assert other.choices[0].message.content


def test_completions_generate_keys_steps_and_signals(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    prompt = [1, 4093, 198, 36218, 15876, 2, 198, 1, 520, 9531, 198]
    request = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    first = httpx.post(f"{proxy.url}/generate", json=request, timeout=120)
    direct = httpx.post(f"{model_server}/generate", json=request, timeout=120)
    assert first.status_code == 200 and plain(first.json()) == plain(direct.json())
    assert "output_token_logprobs" not in first.json()["meta_info"]
    raw = httpx.post(f"{model_server}/generate", json={**request, "return_logprob": True}, timeout=120).json()
    longer = {**request, "input_ids": prompt + first.json()["output_ids"] + [198, 1]}
    assert httpx.post(f"{proxy.url}/generate", json=longer, timeout=120).status_code == 200
    keyed = {"model": "m", "prompt": "Two plus two is", "max_tokens": 2}
    header = {"X-Rlreplay-Trajectory": "step=7,sample_index=3,rollout_n=1,validate=true"}
    completion = httpx.post(f"{proxy.url}/v1/completions", json=keyed, headers=header, timeout=120)
    assert completion.json()["choices"][0]["logprobs"] is None
    assert httpx.post(f"{proxy.url}/update_weights_from_disk", json={"model_path": "x"}, timeout=120).json()[
        "success"
    ]
    after = httpx.post(f"{proxy.url}/v1/completions", json={**keyed, "prompt": "Hello"}, timeout=120)
    assert after.status_code == 200
    trainer = [-0.5, -0.25]  # the trainer's log-prob of each response token, for the mismatch numbers
    signals = httpx.post(
        f"{proxy.url}/rlreplay/signals",
        json={
            "step": 7,
            "sample_index": 3,
            "rollout_n": 1,
            "validate": True,
            "reward": 0.5,
            "output": {"old_log_probs": trainer},
        },
    )
    assert signals.status_code == 200, signals.text
    assert signals.json()["trajectory_id"] == completion.headers["X-Rlreplay-Trajectory-Id"]
    unknown = httpx.post(f"{proxy.url}/rlreplay/signals", json={"step": 99, "sample_index": 0, "reward": 1})
    assert unknown.status_code == 404 and "no recorded trajectory" in unknown.json()["error"]["message"]
    assert proxy.stop() == 0, proxy.stderr
    rows = {
        (
            r["step"],
            r["sample_index"] if r["sample_index"] is not None else r["sample_index_str"],
            r["rollout_n"],
            r["validate"],
        ): r
        for r in listing(tmp_path / "run")
    }
    # the unnamed calls are numbered auto-N (never a named key); the update made step 1
    assert set(rows) == {(0, "auto-0", None, False), (7, 3, 1, True), (1, "auto-0", None, False)}
    assert rows[(7, 3, 1, True)]["reward"] == 0.5
    [keyed_traj] = open_run(tmp_path / "run").load([rows[(7, 3, 1, True)]["id"]])
    [signals_span] = [s for s in keyed_traj.spans if s.kind == "signals"]
    assert list(signals_span.output["old_log_probs"]) == trainer
    found = {t.id: spans for t, spans in llm_spans(tmp_path / "run")}
    generate = found[rows[(0, "auto-0", None, False)]["id"]]
    assert [s.name for s in generate] == ["generate", "generate"]  # the longer prompt continued it
    assert list(generate[0].output["token_ids"]) == raw["output_ids"]
    assert list(generate[0].output["log_probs"]) == [r[0] for r in raw["meta_info"]["output_token_logprobs"]]
    assert generate[0].output["engine"]["weight_version"] == "0"


def test_an_unreachable_upstream_is_one_line_and_records_nothing(start_proxy: Any, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy("--upstream", closed, "--out", "run")
    answer = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m", "messages": CHAT})
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert closed in message and "\n" not in message
    assert proxy.stop() == 0, proxy.stderr
    assert listing(tmp_path / "run") == []


def test_a_malformed_body_goes_to_the_server_as_is(model_server: str, start_proxy: Any) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    for body in (b"{not json", b"[1, 2]"):
        got = httpx.post(f"{proxy.url}/v1/chat/completions", content=body)
        direct = httpx.post(f"{model_server}/v1/chat/completions", content=body)
        assert (got.status_code, got.json()) == (direct.status_code, direct.json())


def test_the_experiment_name_is_recorded_under_either_spelling(start_proxy: Any, tmp_path: Path) -> None:
    for flag in ("--experiment-name", "--experiment"):
        out = tmp_path / flag.strip("-")
        proxy = start_proxy("--upstream", "http://127.0.0.1:1", "--out", str(out), flag, f"exp{flag}")
        assert proxy.stop() == 0, proxy.stderr
        assert open_run(out).manifest["experiment"] == f"exp{flag}"
        said = "rlreplay: --experiment is now --experiment-name" in proxy.stderr
        assert said == (flag == "--experiment")


def test_bad_options_are_one_line_exit_2(tmp_path: Path) -> None:
    for args, words in (
        (["--port", "0"], "give --upstream"),
        (["--upstream", "localhost:8000"], "base URL"),
        (["--upstream", "http://127.0.0.1:1", "--out", str(tmp_path)], "never overwritten"),
    ):
        (tmp_path / "x").write_text("")  # --out tmp_path: not empty
        proc = rlreplay_proc("proxy", *args, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr


def test_a_replay_answers_from_the_recording_with_the_server_gone(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    def session(base: str) -> list[Any]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
        first = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3)
        turn2 = [
            *CHAT,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Why?"},
        ]
        second = client.chat.completions.create(model="m", messages=turn2, max_tokens=3, stream=True)
        keyed = httpx.post(
            f"{base}/generate",
            json={"text": "One, two,", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
            headers={"X-Rlreplay-Trajectory": "step=2,sample_index=5"},
            timeout=120,
        )
        return [plain(first), [plain(c) for c in second], plain(keyed.json())]

    recording = start_proxy("--upstream", model_server, "--out", "recorded")
    answers = session(recording.url)
    assert recording.stop() == 0, recording.stderr
    replay = start_proxy("--replay", "recorded", "--out", "replayed")  # no upstream: the server is not there
    assert session(replay.url) == answers
    assert replay.stop() == 0, replay.stderr
    assert "3 calls served; 0 trajectories diverged; 0 recorded trajectories never asked for" in replay.stderr
    compared = rlreplay_proc("compare", "recorded", "replayed", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "2 pairs: 2 same, 0 changed, 0 only in A, 0 only in B" in compared.stdout
    assert {r["replay"] for r in replay_rows(open_run(tmp_path / "replayed")).values()} == {"served"}

    # a call the recording does not hold: 409 with the reason, or the server answers it
    failing = start_proxy("--replay", "recorded", "--out", "failed", "--on-diverge", "fail")
    other = [{"role": "user", "content": "Name a colour!"}]
    refused = httpx.post(f"{failing.url}/v1/chat/completions", json={"model": "m", "messages": other})
    assert refused.status_code == 409
    assert refused.json()["error"]["message"].endswith("holds no trajectory that starts with this call")
    changed = httpx.post(
        f"{failing.url}/generate",
        json={"text": "Three, four,", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        headers={"X-Rlreplay-Trajectory": "step=2,sample_index=5"},
    )
    assert changed.status_code == 409 and "other inputs than recorded" in changed.json()["error"]["message"]
    assert failing.stop() == 0
    live = start_proxy("--replay", "recorded", "--upstream", model_server, "--out", "live")
    answer = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY).chat.completions.create(
        model="m", messages=other, max_tokens=2
    )
    assert answer.choices[0].message.content
    assert live.stop() == 0
    [row] = replay_rows(open_run(tmp_path / "live")).values()
    assert row["replay"] == "live"
