"""Weave upload benchmark: calls per second to a loopback Weave server, and bytes per step
sent by rlreplay vs by verl's own weave backend (token2text on), both through weave's client.

- Throughput: every span of the shipped sample run, sent (1) by rlreplay's uploader
  (prepare + ``calls/complete`` through ``RemoteHTTPTraceServer``) and (2) through weave's own
  tracing client (``WeaveClient.create_call``/``finish_call`` with its batch processor, the
  path verl's ``rollout_trace_op`` takes), each to a fresh loopback server (tests/weave_loopback.py).
- Bytes for one step: rlreplay uploads the step's trajectories with decoded text (the upload
  pipeline with the run's tokenizer); verl's side re-runs the same step's agent loops
  (sample_runs/make_sample_run.py: same deterministic conversations and token ids) with the
  methods decorated by verl's real ``rollout_trace_op`` instead of rlreplay's, under verl's
  ``rollout_trace_attr``, ``RolloutTraceConfig(backend="weave", token2text=True)``, and a real
  ``WeaveClient`` pointed at the loopback. Bytes are request bodies the server received, plus
  the op definitions weave publishes (obj/file create, answered locally: the loopback has no
  object store; they are counted from the bodies weave would send).

    python benchmarks/bench_upload_weave.py [--run sample_runs/gsm8k-grpo-qwen3] [--step 3]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
PROJECT = "bench/weave-upload"
KEY = "bench-key"

sys.path.insert(0, str(ROOT / "tests"))
os.environ["WANDB_ERROR_REPORTING"] = "false"  # weave reports its errors to Sentry otherwise


def _load_module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _local_ops_server(url: str) -> Any:
    """weave's HTTP client, with op publishing (obj/file create) answered locally and counted."""
    from pydantic_core import to_json
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer
    from weave.vendor.weave_server_sdk.types import FileCreateResponse, ObjectCreateResponse

    class LocalOps(RemoteHTTPTraceServer):
        op_bytes = 0

        def obj_create(self, req: Any) -> Any:
            body = to_json(dict(req), fallback=str)
            self.op_bytes += len(body)
            return ObjectCreateResponse(digest=hashlib.sha256(body).hexdigest()[:43])

        def file_create(self, req: Any) -> Any:
            file = req["file"]  # (name, content, ...) as httpx takes it
            content = file[1] if isinstance(file, tuple) else file
            content = content.encode() if isinstance(content, str) else bytes(content)
            self.op_bytes += len(content) + 300  # and the multipart envelope, about
            return FileCreateResponse(digest=hashlib.sha256(content).hexdigest()[:43])

    return LocalOps(url, should_batch=True, password=KEY)


def _weave_client(url: str) -> tuple[Any, Any]:
    from weave.trace.context import weave_client_context
    from weave.trace.weave_client import WeaveClient

    server = _local_ops_server(url)
    entity, project = PROJECT.split("/")
    client = WeaveClient(entity, project, server, ensure_project_exists=False)
    weave_client_context.set_weave_client_global(client)
    return client, server


def _flush(client: Any) -> None:
    client.flush()
    processor = client.server.call_processor
    if processor is not None:
        processor.stop_accepting_new_work_and_flush_queue()


# -- throughput ------------------------------------------------------------------------------------


def throughput(run: Any) -> tuple[int, float, int, float]:
    from weave_loopback import WeaveLoopback

    from rlreplay.uploaders.weave import WeaveUploader

    trajs = run.load(run.trajectories()["id"].to_pylist())
    calls = sum(len(t.spans) for t in trajs)

    with WeaveLoopback(api_key=KEY) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY)
        started = time.perf_counter()
        for i in range(0, len(trajs), 100):
            results = up.send(up.prepare(trajs[i : i + 100]))
            assert all(r.ok for r in results)
        ours = time.perf_counter() - started
        up.close()
        assert len(lb.calls) == calls and not lb.duplicates

    with WeaveLoopback(api_key=KEY) as lb:
        client, _ = _weave_client(lb.url)
        started = time.perf_counter()
        for t in trajs:
            open_calls: dict[str, Any] = {}
            for span in t.spans:  # sorted by start: parents come first
                parent = open_calls.get(span.parent_id) if span.parent_id else None
                open_calls[span.span_id] = client.create_call(
                    op=span.name,
                    inputs=span.inputs if isinstance(span.inputs, dict) else {},
                    parent=parent,
                    attributes=t.attributes,
                    use_stack=False,
                )
            for span in reversed(t.spans):
                client.finish_call(open_calls[span.span_id], output=span.output)
        _flush(client)
        theirs = time.perf_counter() - started
        assert len(lb.calls) == calls, (len(lb.calls), calls)
    return calls, ours, calls, theirs


# -- bytes for one step -----------------------------------------------------------------------------


def rlreplay_step_bytes(run: Any, step: int, max_samples: int | None = None) -> tuple[int, int, int, int]:
    from weave_loopback import WeaveLoopback

    from rlreplay.read import selection
    from rlreplay.uploaders.pipeline import load_decoder, upload
    from rlreplay.uploaders.weave import WeaveUploader

    groups = selection.select(run.trajectories(step=step), max_samples=max_samples)
    decoder = load_decoder(run, None, print)
    assert decoder is not None, "the sample run's tokenizer did not load"
    with WeaveLoopback(api_key=KEY) as lb:
        up = WeaveUploader(PROJECT, url=lb.url, api_key=KEY)
        # a throwaway copy of the run's ledger: point the run at a temp dir for the ledger
        summary = upload(run, up, groups, decoder=decoder)
        assert summary.ok and summary.sent == sum(len(g.ids) for g in groups), summary
        # token2text's per-turn `conversation` on the agent call repeats prompt_text + response_text
        conversation = sum(
            len(orjson.dumps(row["output"]["conversation"]))
            for row in lb.stored(PROJECT)
            if isinstance(row["output"], dict) and "conversation" in row["output"]
        )
        return lb.bytes_received, summary.sent, len(lb.calls), conversation


def verl_step_bytes(step: int) -> tuple[int, int, int]:
    """Re-run one step of the sample run under verl's weave backend, with token2text on."""
    from verl.utils import rollout_trace as vt
    from weave_loopback import WeaveLoopback

    sr = _load_module(ROOT / "sample_runs" / "make_sample_run.py", "make_sample_run")
    for cls, method in (
        (sr.ToolAgentLoop, "run"),
        (sr.LLMServerClient, "generate"),
        (sr.HermesToolParser, "extract_tool_calls"),
        (sr.Gsm8kTool, "execute"),
    ):
        raw = getattr(cls, method).__wrapped__  # the undecorated method under rlreplay's trace_op
        setattr(cls, method, vt.rollout_trace_op(raw))

    tokenizer = sr._hf_tokenizer()
    trajectories = 0
    with WeaveLoopback(api_key=KEY) as lb:
        client, server = _weave_client(lb.url)
        config = vt.RolloutTraceConfig.get_instance()  # what RolloutTraceConfig.init sets, minus weave.init
        config.backend, config.client, config.token2text = "weave", client, True
        config.project_name, config.experiment_name = PROJECT, sr.EXPERIMENT
        config._initialized = True

        async def one(server_: Any, tool: Any, sample: int, n: int, validate: bool) -> None:
            problem = sr.gsm8k()[sample]
            texts = sr.conversation_texts(step, sample, n, validate)
            request_id = sr._request_id(step, sample, n, validate)
            server_.scripts[request_id] = [text for role, text in texts if role == "assistant"]
            with vt.rollout_trace_attr(
                step=step, sample_index=sample, rollout_n=n, validate=validate, name="agent_loop"
            ):
                await sr.ToolAgentLoop(server_, tokenizer, tool, request_id).run(
                    sr._sampling_params(validate),
                    raw_prompt=sr.raw_prompt(sample),
                    data_source="openai/gsm8k",
                    reward_model={"style": "rule", "ground_truth": problem.answer},
                    extra_info={"split": "test", "index": sample, "question": problem.question},
                    tools_kwargs={sr.TOOL_NAME: {"create_kwargs": {"ground_truth": problem.answer}}},
                    index=sample,
                )

        async def go() -> int:
            jobs = []
            for worker in range(sr.NUM_WORKERS):
                llm, tool = sr.LLMServerClient(tokenizer), sr.Gsm8kTool()
                for s_step, validate, samples, n in sr.batches(worker):
                    if s_step == step:
                        jobs += [one(llm, tool, s, r, validate) for s in samples for r in range(n)]
            await asyncio.gather(*jobs)
            return len(jobs)

        trajectories = asyncio.run(go())
        _flush(client)
        vt.RolloutTraceConfig.reset()
        return lb.bytes_received + server.op_bytes, trajectories, len(lb.calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=SAMPLE_RUN)
    parser.add_argument("--step", type=int, default=3)
    args = parser.parse_args()

    import shutil
    import tempfile

    import rlreplay

    os.environ["WEAVE_RETRY_MAX_INTERVAL"] = "0.1"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        shutil.copytree(args.run, run_dir, ignore=shutil.ignore_patterns("_uploads"))  # ledgers go here
        run = rlreplay.open_run(run_dir)

        calls, ours, calls_w, theirs = throughput(run)
        print(f"throughput to a loopback Weave server ({calls} calls, {len(run.trajectories())} traces):")
        print(f"  rlreplay uploader (calls/complete)     {calls / ours:9.0f} calls/s  ({ours:.2f} s)")
        print(f"  weave client create_call/finish_call   {calls_w / theirs:9.0f} calls/s  ({theirs:.2f} s)")
        print(f"  ratio rlreplay / weave client          {(calls / ours) / (calls_w / theirs):9.2f}x")

        ours_b, ours_t, ours_c, conv_b = rlreplay_step_bytes(run, args.step)
        shutil.rmtree(run_dir / "_uploads", ignore_errors=True)
        few_b, few_t, few_c, _ = rlreplay_step_bytes(run, args.step, max_samples=2)
        verl_b, verl_t, verl_c = verl_step_bytes(args.step)
        # the same spans on both sides: verl has no trajectory root call
        assert (verl_t, verl_c) == (ours_t, ours_c - ours_t), (verl_t, verl_c, ours_t, ours_c)
        print(f"bytes for step {args.step} with token2text (request bodies received):")
        print(f"  verl weave backend, whole step      {verl_b:10,d} B  {verl_t} trajectories, {verl_c} calls")
        print(f"  rlreplay upload, whole step         {ours_b:10,d} B  {ours_t} trajectories, {ours_c} calls")
        print(
            f"    of which agent `conversation`     {conv_b:10,d} B  (per-turn text, repeats prompt/response)"
        )
        print(f"  rlreplay upload --max-samples 2     {few_b:10,d} B  {few_t} trajectories, {few_c} calls")
        print(f"  ratio verl / rlreplay, same trajectories   {verl_b / ours_b:6.2f}x")
        print(f"  ratio verl whole step / rlreplay --max-samples 2   {verl_b / few_b:6.2f}x")
        print(f"  bytes per trajectory: verl {verl_b / verl_t:,.0f}, rlreplay {ours_b / ours_t:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
