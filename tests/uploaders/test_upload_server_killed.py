"""The server goes away in the middle of an upload, comes back at the same address, and a
rerun completes it: nothing lost, nothing sent twice (MLflow, Weave; OTLP and Trackio have
theirs in test_upload_otlp.py and test_upload_trackio.py).

Between the client and the real server (the real ``mlflow server``; the validating Weave
loopback) sits a forwarding proxy: it forwards every request, records the trace payloads that
were accepted, and after ``die_after`` accepted trace requests it drops the next one and stops
listening: to the client, the server is gone.
"""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import support
from support import free_port
from test_upload_mlflow import MAX_SAMPLES, check_max_samples_upload, traj_id
from weave_loopback import WeaveLoopback

import rlreplay

WEAVE_KEY = "wandb-key-0123456789abcdef0123456789abcdef"
#: The pipeline's first wait before a retry (the default 0.5 s makes the dead server's three
#: batches of retries sleep ~10 s; the same retries happen, sooner).
FAST_BACKOFF_S = "0.05"


class ForwardingProxy:
    """Forwards any request to ``upstream``; counts the trace requests it let through."""

    def __init__(self, upstream: str, trace_path: str, port: int = 0, die_after: int | None = None) -> None:
        self.upstream = upstream
        self.accepted: list[bytes] = []  # bodies of trace requests answered 2xx (uncompressed)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                is_trace = self.command == "POST" and self.path.startswith(trace_path)
                if is_trace and die_after is not None and len(proxy.accepted) >= die_after:
                    self.close_connection = True  # the server is gone: no answer, no one listening
                    threading.Thread(target=proxy.stop, daemon=True).start()
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                request = urllib.request.Request(
                    proxy.upstream + self.path, data=body, method=self.command, headers=headers
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        status, payload, kind = (
                            answer.status,
                            answer.read(),
                            answer.headers.get("Content-Type"),
                        )
                except urllib.error.HTTPError as exc:
                    status, payload, kind = exc.code, exc.read(), exc.headers.get("Content-Type")
                if is_trace and 200 <= status < 300 and body is not None:
                    gz = self.headers.get("Content-Encoding") == "gzip"
                    proxy.accepted.append(gzip.decompress(body) if gz else body)
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


run_cli = partial(support.run_cli, command="upload", json_out=True)


def otlp_trace_ids(bodies: list[bytes]) -> Counter[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    found: Counter[str] = Counter()
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found.update(
            {
                span.trace_id.hex()
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            }
        )
    return found


def test_mlflow_server_gone_mid_upload_then_back(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", FAST_BACKOFF_S)
    port = free_port()
    first = ForwardingProxy(mlflow_server, "/v1/traces", port=port, die_after=2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", first.url)
    project = f"gone-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--project", project, "--max-samples", str(MAX_SAMPLES), "--batch-size", "3"]
    rc, interrupted, _ = run_cli(capsys, *args)
    assert rc == 1 and interrupted["sent"] == 6

    second = ForwardingProxy(mlflow_server, "/v1/traces", port=port)  # back, at the same address
    rc, resumed, err = run_cli(capsys, *args)
    assert rc == 0, err
    total = resumed["selected"]
    assert resumed["already_uploaded"] == 6 and resumed["sent"] == total - 6
    assert interrupted["sent"] + interrupted["failed"] + interrupted["not_attempted"] == total
    sent_first, sent_second = otlp_trace_ids(first.accepted), otlp_trace_ids(second.accepted)
    assert not set(sent_first) & set(sent_second)  # nothing sent twice
    assert max((sent_first + sent_second).values()) == 1
    traces = check_max_samples_upload(run_copy, mlflow_server, project, spans=True)  # each once, whole groups
    assert len(traces) == total == len(sent_first + sent_second)  # nothing lost
    num_spans = dict(
        zip(*(rlreplay.open_run(run_copy).trajectories()[c].to_pylist() for c in ("id", "num_spans")))
    )
    assert all(len(t.data.spans) == num_spans[traj_id(t)] for t in traces)
    second.stop()


def test_weave_server_gone_mid_upload_then_back(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", FAST_BACKOFF_S)
    monkeypatch.setenv("WEAVE_RETRY_MAX_INTERVAL", "0.05")
    # one attempt per request in weave's own retry loop (its client still retries a refused
    # connection twice): rlreplay's retries and its giving up after failed batches are the same
    monkeypatch.setenv("WEAVE_RETRY_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("WANDB_API_KEY", WEAVE_KEY)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with WeaveLoopback(api_key=WEAVE_KEY) as lb:
        port = free_port()
        first = ForwardingProxy(lb.url, "/v2/", port=port, die_after=2)
        monkeypatch.setenv("WF_TRACE_SERVER_URL", first.url)
        args = [str(run_copy), "--backend", "weave", "--project", "team/gone", "--max-samples", "2"]
        args += ["--batch-size", "3"]
        rc, interrupted, _ = run_cli(capsys, *args)
        assert rc == 1 and interrupted["sent"] == 6

        second = ForwardingProxy(lb.url, "/v2/", port=port)
        rc, resumed, err = run_cli(capsys, *args)
        assert rc == 0, err
        total = resumed["selected"]
        assert resumed["already_uploaded"] == 6 and resumed["sent"] == total - 6
        calls = [c for body in first.accepted + second.accepted for c in json.loads(body)["batch"]]
        assert len(calls) == len({c["id"] for c in calls})  # no call sent twice
        stored = list(lb.client().calls_query_stream({"project_id": "team/gone"}))
        roots = {c.attributes["rlreplay"]["trajectory_id"] for c in stored if c.parent_id is None}
        run = rlreplay.open_run(run_copy)
        assert len(roots) == total and not lb.duplicates  # nothing lost, nothing twice
        assert len(stored) == sum(len(t.spans) for t in run.load(sorted(roots)))
        second.stop()
