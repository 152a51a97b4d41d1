"""`rlreplay upload --backend otlp` against a real Arize Phoenix on 127.0.0.1.

Phoenix runs from its own virtual environment (its pins conflict with MLflow's): the one named
by $RLREPLAY_PHOENIX (a ``phoenix`` executable), else ``.phoenix-venv/`` in the repository,
created here on first use (``pip install arize-phoenix`` at the version in constraints.txt).
Between the client and Phoenix sits a counting proxy that parses each request with the OTLP
protobuf types: it shows what leaves the client (Phoenix ignores span ids it already has, so
"a rerun sends nothing" is proved here), and it is the server killed mid-upload.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import support
from support import free_port, phoenix_env, qwen_tokenizer_dir, start_server, stop_server

import rlreplay
from rlreplay.uploaders.base import LEDGER_DIR
from rlreplay.uploaders.otlp_proto import otel_span_id, otel_trace_id

REPO = Path(__file__).resolve().parents[2]


def phoenix_executable() -> Path:
    given = os.environ.get("RLREPLAY_PHOENIX")
    if given:
        return Path(given)
    venv = REPO / ".phoenix-venv"
    exe = venv / "bin" / "phoenix"
    if not exe.exists():
        pin = re.search(r"^arize-phoenix==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
        spec = f"arize-phoenix=={pin.group(1)}" if pin else "arize-phoenix"
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec], check=True)
    return exe


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory):
    """A real Phoenix server on 127.0.0.1; yields its base URL."""
    home = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = phoenix_env(home, port)
    url = f"http://127.0.0.1:{port}"
    proc = start_server([str(phoenix_executable()), "serve"], home=home, env=env, health=f"{url}/healthz")
    yield url
    stop_server(proc)


class CountingProxy:
    """Forwards OTLP/HTTP requests to ``upstream``, recording what each carried; ``die_after``
    requests answered, it stops listening (the server goes away mid-upload)."""

    def __init__(self, upstream: str, port: int = 0, die_after: int | None = None) -> None:
        self.upstream = upstream
        self.die_after = die_after
        self.requests = 0
        self.bytes = 0  # uncompressed protobuf bytes
        self.spans: Counter[tuple[str, str]] = Counter()  # (trace id, span id) → times received
        self.headers: list[dict[str, str]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                body = self.rfile.read(int(self.headers["Content-Length"]))
                if proxy.die_after is not None and proxy.requests >= proxy.die_after:
                    self.close_connection = True  # gone: no answer, and no one listening after
                    threading.Thread(target=proxy.stop, daemon=True).start()
                    return
                raw = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
                request = ExportTraceServiceRequest()
                request.ParseFromString(raw)  # the client's own wire type
                forward = urllib.request.Request(
                    proxy.upstream + self.path,
                    data=body,
                    method="POST",
                    headers={k: v for k, v in self.headers.items() if k.lower() != "host"},
                )
                with urllib.request.urlopen(forward, timeout=30) as answer:
                    status, payload = answer.status, answer.read()
                proxy.requests += 1
                proxy.bytes += len(raw)
                proxy.headers.append({k.lower(): v for k, v in self.headers.items()})
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            proxy.spans[(span.trace_id.hex(), span.span_id.hex())] += 1
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


run_cli = partial(support.run_cli, command="upload")


def phoenix_spans(url: str, project: str, expect: int) -> list[dict[str, Any]]:
    """The project's spans, once Phoenix has inserted ``expect`` of them (it inserts in the background)."""
    deadline = time.monotonic() + 180
    while True:
        spans = _all_spans(url, project)
        if len(spans) >= expect or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def _all_spans(url: str, project: str) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = f"?limit=1000{f'&cursor={cursor}' if cursor else ''}"
        try:
            with urllib.request.urlopen(f"{url}/v1/projects/{project}/spans{query}", timeout=30) as resp:
                page = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # the project is created with its first spans
                return []
            raise
        spans += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def project_id(url: str, name: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/projects", timeout=30) as resp:
        (found,) = [p for p in json.loads(resp.read())["data"] if p["name"] == name]
    return found["id"]


def expected_spans(run_dir: Path, ids: list[str], project: str) -> dict[tuple[str, str], Any]:
    run = rlreplay.open_run(run_dir)
    return {
        (otel_trace_id(t.id, project), otel_span_id(s.span_id, project)): (t, s)
        for t in run.load(ids)
        for s in t.spans
    }


def test_phoenix_round_trip_dry_run_rerun_and_screenshot(
    phoenix: str, run_copy: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch
) -> None:
    from tokenizers import Tokenizer

    project = f"otlp-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(phoenix)
    token = "Bearer tok-" + uuid.uuid4().hex
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-env-header=from%20env")
    args = [str(run_copy), "--backend", "otlp", "--endpoint", proxy.url, "--project", project]
    args += ["--max-samples", "2", "--header", f"Authorization={token}"]
    rc, out, err = run_cli(capsys, *args, "--dry-run", "--json")
    assert rc == 0, err
    dry = json.loads(out)
    assert proxy.requests == 0 and not (run_copy / LEDGER_DIR).exists()

    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["sent"] == dry["to_send"] == len(dry["ids"]) > 0
    assert summary["bytes"] == dry["bytes"] == proxy.bytes  # --dry-run figures = what arrived
    assert all(h["authorization"] == token and h["x-env-header"] == "from env" for h in proxy.headers)
    expected = expected_spans(run_copy, dry["ids"], project)
    assert dict(proxy.spans) == dict.fromkeys(expected, 1)  # every span once

    # what Phoenix holds: the span trees, times, kinds, and the conversation, readable
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    got = {
        (s["context"]["trace_id"], s["context"]["span_id"]): s
        for s in phoenix_spans(phoenix, project, len(expected))
    }
    assert set(got) == set(expected)
    kinds = {"trajectory": "CHAIN", "agent": "AGENT", "llm": "LLM", "tool": "TOOL", "parser": "CHAIN"}
    for key, (traj, span) in expected.items():
        pb = got[key]
        parent = otel_span_id(span.parent_id, project) if span.parent_id else None
        assert pb["name"] == span.name and pb["parent_id"] == parent
        assert pb["attributes"]["rlreplay.span_id"] == span.span_id
        assert pb["span_kind"] == kinds[span.kind]
        assert pb["status_code"] == ("ERROR" if span.status == "error" else "OK")
        attrs = pb["attributes"]
        if span.parent_id is None:
            assert attrs["rlreplay.trajectory_id"] == traj.id and attrs["rlreplay.step"] == traj.step
            assert attrs["rlreplay.rollout_n"] == traj.rollout_n
            if traj.reward is not None:
                assert attrs["rlreplay.trajectory_reward"] == pytest.approx(traj.reward)
        if span.kind == "llm":
            reply = tok.decode(span.output["token_ids"], skip_special_tokens=False)
            assert attrs["llm.output_messages.0.message.role"] == "assistant"
            # the conversation, readable: decoded text (with or without the chat template's markers)
            content = attrs.get("llm.output_messages.0.message.content", "")
            called = "llm.output_messages.0.message.tool_calls.0.tool_call.function.name" in attrs
            assert content.strip() in reply and (content.strip() or called)
            n = 0
            while f"llm.input_messages.{n}.message.role" in attrs:
                n += 1
            contents = [attrs.get(f"llm.input_messages.{i}.message.content", "") for i in range(n)]
            prompt = tok.decode(span.inputs["prompt_ids"], skip_special_tokens=False)
            assert {"user"} <= {attrs[f"llm.input_messages.{i}.message.role"] for i in range(n)}
            users = [contents[i] for i in range(n) if attrs[f"llm.input_messages.{i}.message.role"] == "user"]
            assert all(c.strip() in prompt for c in contents) and all(u.strip() for u in users)
            assert attrs["llm.token_count.prompt"] == len(span.inputs["prompt_ids"])
        if span.kind == "tool":
            assert attrs["tool.name"]
    first = min(expected.values(), key=lambda ts: ts[1].start_ns)[1]
    (pb_first,) = [s for k, s in got.items() if k[1] == otel_span_id(first.span_id, project)]
    assert pb_first["start_time"].startswith(
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(first.start_ns // 1_000_000_000))
    )  # recorded times

    # a rerun sends nothing (ledger), whatever Phoenix would do with it
    before = proxy.requests
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0 and json.loads(out)["sent"] == 0 and proxy.requests == before
    # the token reached the collector and nothing else
    secret = token.split()[1]
    assert all(secret not in p.read_text() for p in (run_copy / LEDGER_DIR).iterdir())
    assert secret not in out + err

    # the trace page in headless Chromium
    from playwright.sync_api import sync_playwright

    trace_id = next(iter(expected))[0]
    page_url = f"{phoenix}/projects/{project_id(phoenix, project)}/traces/{trace_id}"
    shot = tmp_path / "phoenix-trace.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(page_url)
        page.get_by_text("ToolAgentLoop.run").first.wait_for(timeout=60_000)
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 20_000
    proxy.stop()


def test_collector_killed_mid_upload_then_resumed_loses_and_duplicates_nothing(
    phoenix: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", "0.05")  # the same retries, without ~10 s of waits
    project = f"kill-{uuid.uuid4().hex[:8]}"
    port = free_port()
    first = CountingProxy(phoenix, port=port, die_after=2)
    args = [str(run_copy), "--backend", "otlp", "--endpoint", first.url, "--project", project]
    args += ["--max-samples", "2", "--batch-size", "3"]
    rc, out, err = run_cli(capsys, *args, "--json")
    interrupted = json.loads(out)
    assert rc == 1 and interrupted["sent"] == 6
    assert "cannot reach the OTLP collector" in (interrupted["failures"][0]["error"] + err)

    second = CountingProxy(phoenix, port=port)  # the server is back, same address
    rc, out, err = run_cli(capsys, *args, "--json")
    resumed = json.loads(out)
    assert rc == 0, err
    total = resumed["selected"]
    assert resumed["already_uploaded"] == 6 and resumed["sent"] == total - 6
    assert interrupted["sent"] + interrupted["failed"] + interrupted["not_attempted"] == total
    expected = expected_spans(run_copy, rlreplay_ids(run_copy, resumed), project)
    assert not set(first.spans) & set(second.spans)  # nothing sent twice
    assert dict(first.spans + second.spans) == dict.fromkeys(expected, 1)  # nothing lost
    got = {
        (s["context"]["trace_id"], s["context"]["span_id"])
        for s in phoenix_spans(phoenix, project, len(expected))
    }
    assert got == set(expected)
    second.stop()


def rlreplay_ids(run_dir: Path, *summaries: dict[str, Any]) -> list[str]:
    """The trajectories the ledger holds after the uploads."""
    ids = set()
    for path in (run_dir / LEDGER_DIR).glob("otlp-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "trajectory_id" in entry:
                ids.add(entry["trajectory_id"])
    assert len(ids) == summaries[0]["selected"]
    return sorted(ids)
