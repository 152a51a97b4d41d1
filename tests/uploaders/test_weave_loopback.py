"""The Weave loopback fixture is faithful: weave's real HTTP client writes to it and reads back."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from weave.utils.exception import exception_to_json_str
from weave.utils.ids import generate_id
from weave.vendor.weave_server_sdk import APIStatusError
from weave_loopback import WeaveLoopback

PROJECT = "ent/proj"
T0 = datetime.datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=datetime.timezone.utc)


@pytest.fixture
def loopback() -> Iterator[WeaveLoopback]:
    with WeaveLoopback(api_key="secret") as lb:
        yield lb


def _at(ms: int) -> str:
    return (T0 + datetime.timedelta(milliseconds=ms)).isoformat()


def make_trace() -> list[dict[str, Any]]:
    """A root call and two children, shaped the way weave's own client sends them."""
    root, gen, tool = generate_id(), generate_id(), generate_id()
    try:
        raise ValueError("tool failed")
    except ValueError as e:
        exc = exception_to_json_str(e)
    common = {"project_id": PROJECT, "trace_id": root, "display_name": None}
    ok = {"status_counts": {"success": 1, "error": 0}}
    return [
        {
            **common,
            "id": root,
            "parent_id": None,
            "op_name": "weave:///ent/proj/op/ToolAgentLoop.run:abc123",
            "display_name": "trajectory 7",
            "started_at": _at(0),
            "ended_at": _at(900),
            "attributes": {"weave": {"source": "rlreplay"}, "step": 3, "sample_index": 7},
            "inputs": {"prompt": "What is 2+2?"},
            "output": {"reward": 1.0},
            "summary": {"status_counts": {"success": 1, "error": 1}},
            "exception": None,
        },
        {
            **common,
            "id": gen,
            "parent_id": root,
            "op_name": "LLMServerClient.generate",
            "started_at": _at(10),
            "ended_at": _at(500),
            "attributes": {"step": 3},
            "inputs": {"prompt_ids": [1, 2, 3]},
            "output": "4",
            "summary": {**ok, "usage": {"qwen": {"requests": 1, "prompt_tokens": 3, "completion_tokens": 1}}},
            "exception": None,
        },
        {
            **common,
            "id": tool,
            "parent_id": root,
            "op_name": "BaseTool.execute",
            "started_at": _at(510),
            "ended_at": _at(890),
            "attributes": {},
            "inputs": {"name": "calc"},
            "output": None,
            "summary": {"status_counts": {"success": 0, "error": 1}},
            "exception": exc,
        },
    ]


def test_batch_of_completed_calls_round_trips(loopback: WeaveLoopback) -> None:
    calls = make_trace()
    client = loopback.client()
    client.calls_complete({"batch": calls})

    (req,) = loopback.requests_to("/calls/complete")
    assert (req.path, req.status) == ("/v2/ent/proj/calls/complete", 200)
    assert req.bytes_received == loopback.bytes_received > 0

    root_id = calls[0]["id"]
    got = {
        c.id: c
        for c in client.calls_query_stream({"project_id": PROJECT, "filter": {"trace_ids": [root_id]}})
    }
    assert set(got) == {c["id"] for c in calls}
    for sent in calls:
        back = got[sent["id"]].model_dump(mode="json")
        for key in ("trace_id", "parent_id", "op_name", "display_name", "attributes", "inputs", "output"):
            assert back[key] == sent[key], key
        assert back["exception"] == sent["exception"]
        assert got[sent["id"]].started_at == datetime.datetime.fromisoformat(sent["started_at"])
        assert got[sent["id"]].ended_at == datetime.datetime.fromisoformat(sent["ended_at"])
        summary = dict(back["summary"])
        weave_summary = summary.pop("weave")
        assert summary == sent["summary"]
        expected = "error" if sent["exception"] else "success"
        if sent["summary"]["status_counts"]["error"] and not sent["exception"]:
            expected = "descendant_error"  # the server derives it from status_counts
        assert weave_summary["status"] == expected
    assert got[root_id].summary["weave"]["latency_ms"] == 900  # type: ignore[index]
    assert got[root_id].summary["weave"]["display_name"] == "trajectory 7"  # type: ignore[index]
    assert json.loads(got[calls[2]["id"]].exception or "")["type"] == "ValueError"

    children = list(client.calls_query_stream({"project_id": PROJECT, "filter": {"parent_ids": [root_id]}}))
    assert [c.id for c in children] == [calls[1]["id"], calls[2]["id"]]
    assert not loopback.duplicates


def test_weave_batch_processor_path_is_accepted(loopback: WeaveLoopback) -> None:
    """weave's own batching client pairs start+end into one calls/complete request."""
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    server = RemoteHTTPTraceServer(loopback.url, should_batch=True, password="secret")
    call_id = generate_id()
    start = {
        "project_id": PROJECT,
        "id": call_id,
        "trace_id": call_id,
        "op_name": "f",
        "started_at": T0,
        "attributes": {},
        "inputs": {"x": 1},
    }
    server.call_start({"start": start})
    server.call_end(
        {
            "end": {
                "project_id": PROJECT,
                "id": call_id,
                "trace_id": call_id,
                "ended_at": T0,
                "output": 2,
                "summary": {"status_counts": {"success": 1, "error": 0}},
            }
        }
    )
    assert server.call_processor is not None
    server.call_processor.stop_accepting_new_work_and_flush_queue()
    assert [r.status for r in loopback.requests_to("/calls/complete")] == [200]
    assert loopback.stored(PROJECT)[0]["output"] == 2


def test_body_weave_rejects_is_answered_422(loopback: WeaveLoopback) -> None:
    auth = ("api", "secret")
    bad = make_trace()[:1]
    del bad[0]["summary"]
    r = httpx.post(f"{loopback.url}/v2/ent/proj/calls/complete", json={"batch": bad}, auth=auth)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "batch", 0, "summary"]

    # weave's client does not retry a 422, and nothing is stored.
    with pytest.raises(APIStatusError) as info:
        loopback.client().calls_complete({"batch": bad})
    assert info.value.status_code == 422
    assert len(loopback.requests_to("/calls/complete")) == 2

    late = make_trace()[:1]
    late[0]["started_at"] = "yesterday"
    r = httpx.post(f"{loopback.url}/v2/ent/proj/calls/complete", json={"batch": late}, auth=auth)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "started_at"

    odd = make_trace()[:1]
    odd[0]["id"] = "Not-A-UUID"
    r = httpx.post(f"{loopback.url}/v2/ent/proj/calls/complete", json={"batch": odd}, auth=auth)
    assert r.status_code == 400 and "Invalid call id" in r.json()["reason"]
    assert not loopback.calls


def test_wrong_key_401_unknown_route_404_server_info(loopback: WeaveLoopback) -> None:
    with pytest.raises(APIStatusError) as info:
        loopback.client(api_key="wrong").calls_complete({"batch": make_trace()})
    assert info.value.status_code == 401
    assert len(loopback.requests_to("/calls/complete")) == 1
    assert not loopback.calls

    r = httpx.post(f"{loopback.url}/v2/ent/proj/calls/nope", json={}, auth=("api", "secret"))
    assert r.status_code == 404
    assert loopback.client().server_info().trace_server_version == "loopback"


def test_injected_503_then_success_lands_exactly_once(loopback: WeaveLoopback) -> None:
    loopback.inject("/calls/complete", [503, 429], retry_after_s=0.01)
    loopback.client().calls_complete({"batch": make_trace()})
    assert [r.status for r in loopback.requests_to("/calls/complete")] == [503, 429, 200]
    assert len(loopback.stored(PROJECT)) == 3
    assert not loopback.duplicates


def test_write_kept_despite_error_answer_is_counted_as_duplicate(loopback: WeaveLoopback) -> None:
    """The client re-sends after a 5xx; a server that had stored the call keeps both."""
    loopback.inject("/calls/complete", [503], store=True, retry_after_s=0.01)
    calls = make_trace()
    loopback.client().calls_complete({"batch": calls})
    assert [r.status for r in loopback.requests_to("/calls/complete")] == [503, 200]
    assert loopback.duplicates == {(PROJECT, c["id"]): 1 for c in calls}


def test_request_over_the_size_limit_is_413_and_not_split_by_calls_complete() -> None:
    with WeaveLoopback(api_key="secret", max_request_bytes=2_000) as lb:
        with pytest.raises(APIStatusError) as info:
            lb.client().calls_complete({"batch": make_trace()})
        assert info.value.status_code == 413
        assert [r.status for r in lb.requests_to("/calls/complete")] == [413]
