"""Trajectory identity through ``rlreplay proxy`` in front of a real model server: a group of
rollouts answered alike, named and unnamed calls side by side, a rollout idle past
``--idle-close``, and ids the proxy never gave."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlreplay.read.open import open_run

pytestmark = pytest.mark.timeout(600)
ID_HEADER = "X-Rlreplay-Trajectory-Id"  # the id every answer carries
QUESTION = [{"role": "user", "content": "Name a colour."}]


def chat(url: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)


def trajectories(run_dir: Path) -> dict[str, Any]:
    """Each recorded trajectory by id: its listing row and its llm spans in call order."""
    run = open_run(run_dir)
    rows = {r["id"]: r for r in run.trajectories().to_pylist()}
    loaded = {t.id: t for t in run.load(list(rows))}
    return {
        tid: (row, sorted((s for s in loaded[tid].spans if s.kind == "llm"), key=lambda s: s.start_ns))
        for tid, row in rows.items()
    }


def test_a_group_answered_alike_keeps_each_rollout_and_its_rewards_when_ids_are_sent_back(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    """Eight rollouts of one prompt get the same first answer; each then sends its own follow-up
    with the id its first answer carried, in the reverse order: each stays one trajectory, and the
    reward posted with its first id lands on the trajectory holding its follow-up."""
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    first = [chat(proxy.url, QUESTION) for _ in range(8)]
    assert len({r.json()["choices"][0]["message"]["content"] for r in first}) == 1  # answered alike
    ids = [r.headers[ID_HEADER] for r in first]
    assert len(set(ids)) == 8
    for k in reversed(range(8)):
        answer = first[k].json()["choices"][0]["message"]
        follow = [*QUESTION, answer, {"role": "user", "content": f"Rollout {k}: another one."}]
        second = chat(proxy.url, follow, {ID_HEADER: ids[k]})
        assert second.status_code == 200 and second.headers[ID_HEADER] == ids[k]
    for k in range(8):
        posted = httpx.post(
            f"{proxy.url}/rlreplay/signals", json={"trajectory_id": ids[k], "reward": float(k)}
        )
        assert posted.status_code == 200 and posted.json()["trajectory_id"] == ids[k]
    assert proxy.stop() == 0, proxy.stderr
    found = trajectories(tmp_path / "run")
    assert sorted(found) == sorted(ids)
    for k, tid in enumerate(ids):
        row, spans = found[tid]
        assert row["model_calls"] == 2 and row["reward"] == float(k)
        assert spans[1].inputs["messages"][-1]["content"] == f"Rollout {k}: another one."


def test_named_and_unnamed_calls_never_share_a_key(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    unnamed = chat(proxy.url, QUESTION)
    named = chat(
        proxy.url, [{"role": "user", "content": "Two."}], {"X-Rlreplay-Trajectory": "step=0,sample_index=0"}
    )
    assert unnamed.status_code == named.status_code == 200
    assert unnamed.headers[ID_HEADER] != named.headers[ID_HEADER]
    taken = chat(proxy.url, QUESTION, {"X-Rlreplay-Trajectory": "step=0,sample_index=auto-0"})
    assert taken.status_code == 400 and "auto-" in taken.json()["error"]["message"]
    # signals by the named keys reach the named trajectory only
    posted = httpx.post(f"{proxy.url}/rlreplay/signals", json={"step": 0, "sample_index": 0, "reward": 1.0})
    assert posted.json()["trajectory_id"] == named.headers[ID_HEADER]
    assert proxy.stop() == 0, proxy.stderr
    rows = [row for row, _ in trajectories(tmp_path / "run").values()]
    keys = [
        (r["step"], r["sample_index"], r["sample_index_str"], r["rollout_n"], r["validate"]) for r in rows
    ]
    assert len(rows) == 2 and len(set(keys)) == 2, keys
    by_id = {r["id"]: r for r in rows}
    assert by_id[named.headers[ID_HEADER]]["reward"] == 1.0
    assert by_id[unnamed.headers[ID_HEADER]]["reward"] is None


def test_a_rollout_idle_past_idle_close_stays_one_trajectory(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    """A long tool call: the trajectory is written while it waits, and the rollout's next call
    (by continuation, by keys, by its id sent back) appends to the same id and keys."""
    proxy = start_proxy("--upstream", model_server, "--out", "run", "--idle-close", "0.3")
    named_header = {"X-Rlreplay-Trajectory": "step=0,sample_index=5"}
    a1 = chat(proxy.url, QUESTION)
    b1 = chat(proxy.url, [{"role": "user", "content": "Count to three."}], named_header)
    c1 = chat(proxy.url, [{"role": "user", "content": "Say hi."}])
    time.sleep(1.5)  # idle past --idle-close: all three are written
    a_follow = [*QUESTION, a1.json()["choices"][0]["message"], {"role": "user", "content": "Another."}]
    a2 = chat(proxy.url, a_follow)
    b2 = chat(proxy.url, [{"role": "user", "content": "Count to four."}], named_header)
    c2 = chat(proxy.url, [{"role": "user", "content": "Say bye."}], {ID_HEADER: c1.headers[ID_HEADER]})
    for early, late in ((a1, a2), (b1, b2), (c1, c2)):
        assert late.status_code == 200 and late.headers[ID_HEADER] == early.headers[ID_HEADER]
    time.sleep(1.0)  # written again, then rewarded
    posted = httpx.post(f"{proxy.url}/rlreplay/signals", json={"step": 0, "sample_index": 5, "reward": 0.5})
    assert posted.json()["trajectory_id"] == b1.headers[ID_HEADER]
    assert proxy.stop() == 0, proxy.stderr
    found = trajectories(tmp_path / "run")
    assert sorted(found) == sorted(r.headers[ID_HEADER] for r in (a1, b1, c1))
    for row, spans in found.values():
        assert row["model_calls"] == 2 and len(spans) == 2 and row["status"] == "ok"
    assert found[b1.headers[ID_HEADER]][0]["reward"] == 0.5
    assert len({(r["step"], r["sample_index"], r["sample_index_str"]) for r, _ in found.values()}) == 3


def test_ids_the_proxy_never_gave_are_refused_and_leave_nothing(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    made = chat(proxy.url, QUESTION)
    stranger = "0" * 32
    signals = httpx.post(f"{proxy.url}/rlreplay/signals", json={"trajectory_id": stranger, "reward": 1.0})
    assert signals.status_code == 404 and stranger in signals.json()["error"]["message"]
    call = chat(proxy.url, QUESTION, {ID_HEADER: stranger})
    assert call.status_code == 404 and stranger in call.json()["error"]["message"]
    assert proxy.stop() == 0, proxy.stderr
    found = trajectories(tmp_path / "run")
    assert list(found) == [made.headers[ID_HEADER]]
    assert found[made.headers[ID_HEADER]][0]["reward"] is None
