"""Upload throughput of every built-in backend against its real local server, side by side.

The same trajectories (default: the shipped sample run, whole), decoded to text as
``rlreplay upload`` does, go through ``rlreplay.uploaders.pipeline.upload`` to:

- ``mlflow``: a local ``mlflow server`` (sqlite backend), OTLP protobuf to /v1/traces;
- ``otlp``: a local Arize Phoenix (``phoenix serve``, from .phoenix-venv/ or $RLREPLAY_PHOENIX);
- ``trackio``: Trackio's local store in a temporary TRACKIO_DIR.

Weave has no local server (its benchmark, bench_upload_weave.py, uses the loopback). After each
upload (the time until the server accepted the last request), what arrived is counted from the
server (traces, spans; Phoenix stores in the background, so it is polled until all are there),
then traces/s are printed with the ratio to MLflow's.

    python benchmarks/bench_upload_backends.py [--run sample_runs/gsm8k-grpo-qwen3] [--max-samples N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_upload_mlflow import start_server as start_mlflow  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port, phoenix_env, start_server  # noqa: E402  (tests/: the helpers the tests share)


def start_phoenix(home: Path) -> tuple[subprocess.Popen, str] | None:
    exe = Path(os.environ.get("RLREPLAY_PHOENIX") or REPO / ".phoenix-venv" / "bin" / "phoenix")
    if not exe.exists():
        print(f"otlp: no Phoenix at {exe} (see README: .phoenix-venv)")
        return None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = phoenix_env(home, port)
    return start_server(
        [str(exe), "serve"], home=home, env=env, health=f"{url}/healthz", log="phoenix.log"
    ), url


def phoenix_arrived(url: str, project: str, expect_spans: int) -> tuple[int, int]:
    deadline = time.monotonic() + 300
    while True:
        spans: list[dict] = []
        cursor = None
        try:
            while True:
                query = f"?limit=1000{f'&cursor={cursor}' if cursor else ''}"
                with urllib.request.urlopen(f"{url}/v1/projects/{project}/spans{query}", timeout=30) as resp:
                    page = json.loads(resp.read())
                spans += page["data"]
                cursor = page.get("next_cursor")
                if not cursor:
                    break
        except urllib.error.HTTPError:
            pass
        if len(spans) >= expect_spans or time.monotonic() > deadline:
            return len({s["context"]["trace_id"] for s in spans}), len(spans)
        time.sleep(0.5)


def mlflow_arrived(uri: str, experiment: str) -> tuple[int, int]:
    from bench_upload_mlflow import arrived

    return arrived(uri, experiment)


def trackio_arrived(project: str, run_name: str) -> tuple[int, int]:
    from trackio.sqlite_storage import SQLiteStorage

    traces = SQLiteStorage.get_traces(project, run=run_name)
    return len({t["metadata"]["trajectory_id"] for t in traces}), len(traces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=REPO / "sample_runs" / "gsm8k-grpo-qwen3")
    parser.add_argument("--max-samples", type=int, default=2, help="per step and split (0: all; default 2)")
    args = parser.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="bench-upload-backends-"))
    os.environ["TRACKIO_DIR"] = str(home / "trackio")  # before trackio is imported

    import rlreplay
    from rlreplay.read import selection
    from rlreplay.uploaders.mlflow import MlflowUploader
    from rlreplay.uploaders.otlp import OtlpUploader
    from rlreplay.uploaders.pipeline import load_decoder, upload
    from rlreplay.uploaders.trackio import TrackioUploader

    servers = []
    mlflow_proc, mlflow_uri = start_mlflow(home)
    servers.append(mlflow_proc)
    phoenix = start_phoenix(home)
    if phoenix is not None:
        servers.append(phoenix[0])
    try:
        results = []
        for name in ("mlflow", "otlp", "trackio"):
            if name == "otlp" and phoenix is None:
                continue
            run_dir = home / f"run-{name}"
            shutil.copytree(args.run, run_dir, ignore=shutil.ignore_patterns("_uploads"))
            run = rlreplay.open_run(run_dir)
            groups = selection.select(run.trajectories(), max_samples=args.max_samples or None)
            decoder = load_decoder(run, None, print)
            project = f"bench-{name}"
            if name == "mlflow":
                uploader = MlflowUploader(project, uri=mlflow_uri, run_name=project)
            elif name == "otlp":
                uploader = OtlpUploader(phoenix[1], project=project)
            else:
                uploader = TrackioUploader(project, project, run=run)
            started = time.perf_counter()
            summary = upload(run, uploader, groups, decoder=decoder)
            seconds = time.perf_counter() - started
            assert summary.ok, (summary.error, summary.failures[:3])
            loaded = run.load([i for g in groups for i in g.ids])
            if name == "trackio":  # one trace per traced op: not rlreplay's own trajectory rows
                expect_spans = sum(
                    1 for t in loaded for s in t.spans if s.kind not in ("trajectory", "signals")
                )
            else:
                expect_spans = sum(len(t.spans) for t in loaded)
            if name == "mlflow":
                traces, spans = mlflow_arrived(mlflow_uri, project)
            elif name == "otlp":
                traces, spans = phoenix_arrived(phoenix[1], project, expect_spans)
            else:
                traces, spans = trackio_arrived(project, project)
            results.append((name, summary.sent, seconds, summary.bytes, traces, spans, expect_spans))
    finally:
        for proc in servers:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    base = next(r for r in results if r[0] == "mlflow")
    base_rate = base[1] / base[2]
    print(
        f"{'backend':9} {'traces':>6} {'seconds':>8} {'traces/s':>9} {'vs mlflow':>9} {'bytes':>11}  arrived"
    )
    for name, sent, seconds, nbytes, traces, spans, expect in results:
        rate = sent / seconds
        print(
            f"{name:9} {sent:6d} {seconds:8.2f} {rate:9.1f} {rate / base_rate:8.2f}x {nbytes:11,d}  "
            f"{traces} traces, {spans} spans (of {expect})"
        )
    shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
