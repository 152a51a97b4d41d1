"""Upload throughput to a local MLflow server: rlreplay's uploader vs MLflow's public span API.

Starts ``mlflow server`` (sqlite backend) on 127.0.0.1, then sends the same trajectories of a
recorded run (default: the shipped sample run) three ways, each into its own experiment:

- ``rlreplay``: ``rlreplay.uploaders.pipeline.upload`` with the MLflow backend (ids only, no text);
- ``rlreplay +text``: the same with token2text (what ``rlreplay upload`` does by default);
- ``mlflow span API``: ``MlflowClient.start_trace/start_span/end_span/end_trace`` per span with
  the recorded timestamps, async logging on and trace tags set on the live trace, as verl's
  mlflow backend does (verl/utils/rollout_trace.py), then a flush.

Then it counts what arrived (traces and spans read back from the server) and prints traces/s
side by side, with ratios.

    python benchmarks/bench_upload_mlflow.py [--run sample_runs/gsm8k-grpo-qwen3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import support
from support import free_port, mlflow_server_command

REPO = Path(__file__).resolve().parents[1]
SPAN_TYPES = {"trajectory": "CHAIN", "agent": "AGENT", "llm": "LLM", "tool": "TOOL", "parser": "PARSER"}


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    cmd, env = mlflow_server_command(home, port)
    return support.start_server(cmd, home=home, env=env, health=f"{uri}/health"), uri


def arrived(uri: str, experiment: str) -> tuple[int, int]:
    """(traces, spans) the server holds for an experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return 0, 0
    traces = spans = 0
    token = None
    while True:
        page = client.search_traces(locations=[exp.experiment_id], max_results=200, page_token=token)
        traces += len(page)
        spans += sum(len(t.data.spans) for t in page)
        token = page.token
        if not token:
            return traces, spans


def run_rlreplay(run_dir: Path, uri: str, experiment: str, text: bool) -> float:
    import rlreplay
    from rlreplay.read import selection
    from rlreplay.uploaders.mlflow import MlflowUploader
    from rlreplay.uploaders.pipeline import load_decoder, upload

    run = rlreplay.open_run(run_dir)
    groups = selection.select(run.trajectories())
    decoder = load_decoder(run, None, print) if text else None
    uploader = MlflowUploader(experiment, uri=uri, run_name=experiment)
    started = time.perf_counter()
    summary = upload(run, uploader, groups, decoder=decoder)
    seconds = time.perf_counter() - started
    assert summary.ok, summary.failures[:3]
    return seconds


def run_span_api(trajectories: list[Any], uri: str, experiment: str) -> float:
    """verl's way: spans through MLflow's client API, async logging on, tags on the live trace."""
    import mlflow
    from mlflow.entities import SpanStatusCode
    from mlflow.tracking import MlflowClient

    mlflow.config.enable_async_logging()
    mlflow.set_tracking_uri(uri)
    experiment_id = mlflow.set_experiment(experiment).experiment_id
    client = MlflowClient(uri)

    def status(span: Any) -> str:
        return SpanStatusCode.ERROR if span.status == "error" else SpanStatusCode.OK

    def children(trace_id: str, parent_id: str, span: Any) -> None:
        for child in span.children:
            live = client.start_span(
                child.name,
                trace_id=trace_id,
                parent_id=parent_id,
                span_type=SPAN_TYPES.get(child.kind, "UNKNOWN"),
                inputs=child.inputs,
                start_time_ns=child.start_ns,
            )
            children(trace_id, live.span_id, child)
            client.end_span(
                trace_id, live.span_id, outputs=child.output, status=status(child), end_time_ns=child.end_ns
            )

    started = time.perf_counter()
    for traj in trajectories:
        (root,) = traj.roots
        live = client.start_trace(
            root.name,
            span_type=SPAN_TYPES.get(root.kind, "UNKNOWN"),
            inputs=root.inputs,
            experiment_id=experiment_id,
            start_time_ns=root.start_ns,
        )
        for key in ("step", "sample_index", "rollout_n", "validate", "experiment_name"):
            mlflow.set_trace_tag(live.trace_id, key, str(traj.attributes[key]))
        children(live.trace_id, live.span_id, root)
        client.end_trace(live.trace_id, outputs=root.output, status=status(root), end_time_ns=root.end_ns)
    mlflow.flush_trace_async_logging(terminate=False)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=REPO / "sample_runs" / "gsm8k-grpo-qwen3")
    args = parser.parse_args(argv)

    import rlreplay

    home = Path(tempfile.mkdtemp(prefix="bench-upload-mlflow-"))
    proc, uri = start_server(home)
    try:
        run_dir = home / "run"
        shutil.copytree(args.run, run_dir)  # the ledger is written into the run directory
        shutil.rmtree(run_dir / "_uploads", ignore_errors=True)
        run = rlreplay.open_run(run_dir)
        ids = run.trajectories()["id"].to_pylist()
        n_spans = len(run.spans(columns=["span_id"]))
        trajectories = run.load(ids)
        print(f"run: {args.run} ({len(ids)} trajectories, {n_spans} spans); server: {uri} (sqlite)")
        # warm both paths (connections, experiment creation, imports) on a throwaway experiment
        run_span_api(trajectories[:2], uri, "warmup-api")
        warm = home / "warm"
        shutil.copytree(run_dir, warm)
        run_rlreplay(warm, uri, "warmup-rlreplay", text=False)

        rows = []
        t = run_rlreplay(run_dir, uri, "rlreplay", text=False)
        rows.append(("rlreplay", t, *arrived(uri, "rlreplay")))
        shutil.rmtree(run_dir / "_uploads")
        t = run_rlreplay(run_dir, uri, "rlreplay-text", text=True)
        rows.append(("rlreplay +text", t, *arrived(uri, "rlreplay-text")))
        t = run_span_api(trajectories, uri, "span-api")
        time.sleep(2)  # anything still in flight after the flush gets a chance to land
        rows.append(("mlflow span API (verl)", t, *arrived(uri, "span-api")))
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)

    peer_rate = len(ids) / rows[-1][1]
    print(
        f"{'path':<24} {'seconds':>8} {'traces/s':>9} {'arrived':>9} {'spans':>11} {'lost':>5} {'vs API':>7}"
    )
    for name, seconds, traces, spans in rows:
        rate = len(ids) / seconds
        print(
            f"{name:<24} {seconds:>8.2f} {rate:>9.1f} {traces:>4}/{len(ids):<4} {spans:>5}/{n_spans:<5} "
            f"{len(ids) - traces:>5} {rate / peer_rate:>6.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
