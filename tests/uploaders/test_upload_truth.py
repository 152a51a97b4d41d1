"""`rlreplay upload` tells the truth and takes care: artifact locations, re-sends with text,
silent and down servers, damaged ledgers, and credentials in tracking URIs (issue #12, 9-13)."""

from __future__ import annotations

import http.server
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import support
from support import qwen_tokenizer_dir

import rlreplay
from rlreplay.format.manifest import update_manifest
from rlreplay.uploaders.base import LEDGER_DIR

run_cli = partial(support.run_cli, command="upload")


def ledger_lines(run_dir: Path, backend: str = "mlflow") -> list[dict]:
    out = []
    for path in (run_dir / LEDGER_DIR).glob(f"{backend}-*.jsonl"):
        out += [json.loads(line) for line in path.read_bytes().splitlines() if b'"trajectory_id"' in line]
    return out


def experiment(uri: str, name: str):
    from mlflow.tracking import MlflowClient

    found = MlflowClient(uri).get_experiment_by_name(name)
    assert found is not None
    return found


def traces(uri: str, name: str, spans: bool = False) -> list:
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_traces(
        locations=[experiment(uri, name).experiment_id],
        include_spans=spans,
        return_type="list",
        max_results=5000,
    )


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A loopback socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def closed_port() -> str:
    return f"http://127.0.0.1:{support.free_port()}"


# -- 9: artifact location ------------------------------------------------------------------------------


def test_remote_server_picks_the_artifact_location(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"art-{uuid.uuid4().hex[:8]}"
    rc, _, err = run_cli(capsys, str(run_copy), "--step", "0", "--max-samples", "1", "--project", project)
    assert rc == 0, err
    location = experiment(mlflow_server, project).artifact_location
    assert str(run_copy) not in location and "mlflow-artifacts" not in location
    # the server's own default: under its --default-artifact-root, named by experiment id
    assert location.endswith(f"artifacts/{experiment(mlflow_server, project).experiment_id}")


def test_local_sqlite_store_keeps_artifacts_in_the_run(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rc, _, err = run_cli(capsys, str(run_copy), "--step", "0", "--max-samples", "1")
    assert rc == 0, err
    uri = f"sqlite:///{run_copy / LEDGER_DIR / 'mlflow.db'}"
    location = experiment(uri, rlreplay.open_run(run_copy).experiment).artifact_location
    assert location == (run_copy / LEDGER_DIR / "mlflow-artifacts").resolve().as_uri()


# -- 10: a rerun that can decode replaces undecoded traces; --resend re-sends -----------------------------


def test_rerun_with_a_tokenizer_replaces_traces_sent_without_text(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"text-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--step", "1", "--project", project, "--json"]
    update_manifest(run_copy, tokenizer="/gone/tokenizer-dir")
    rc, out, err = run_cli(capsys, *args)
    first = json.loads(out)
    assert rc == 0 and first["text"] is None and first["sent"] > 0, err
    assert {e["text"] for e in ledger_lines(run_copy)} == {False}  # the ledger says: no text
    before = traces(mlflow_server, project, spans=True)
    assert all("prompt_text" not in s.inputs for t in before for s in t.data.spans if s.span_type == "LLM")

    update_manifest(run_copy, tokenizer=str(qwen_tokenizer_dir()))  # a tokenizer is available now
    rc, out, err = run_cli(capsys, *args)
    second = json.loads(out)
    assert rc == 0, err
    assert second["sent"] == first["sent"] and second["replaced"] == first["sent"]
    assert second["already_uploaded"] == 0 and second["text"]
    after = traces(mlflow_server, project, spans=True)
    assert sorted(t.info.trace_id for t in after) == sorted(t.info.trace_id for t in before)  # same ids
    llm = [s for t in after for s in t.data.spans if s.span_type == "LLM"]
    assert llm and all(s.inputs["prompt_text"] for s in llm)
    assert all(
        len(t.data.spans) == len(rlreplay.open_run(run_copy).trajectory(t.info.tags["trajectory_id"]).spans)
        for t in after
    )

    rc, out, _ = run_cli(capsys, *args)  # with text already there: nothing to do
    assert json.loads(out)["sent"] == 0
    rc, out, _ = run_cli(capsys, *args, "--resend")  # --resend re-sends the selection
    forced = json.loads(out)
    assert rc == 0 and forced["sent"] == first["sent"] and forced["replaced"] == first["sent"]
    assert len(traces(mlflow_server, project)) == len(before)


# -- 11: silent and down servers ---------------------------------------------------------------------------


def test_silent_mlflow_server_stops_at_the_deadline(
    silent_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", silent_server)
    started = time.monotonic()
    rc, _out, err = run_cli(capsys, str(run_copy), "--max-samples", "1", "--timeout", "2")
    elapsed = time.monotonic() - started
    assert rc == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: ") and "no answer" in line and "2s" in line
    assert "rerun" in line  # resumable
    assert elapsed < 20
    assert ledger_lines(run_copy) == []


def test_silent_weave_server_stops_at_the_deadline(
    silent_server: str,
    run_copy: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("WF_TRACE_SERVER_URL", silent_server)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    started = time.monotonic()
    rc, out, err = run_cli(
        capsys,
        str(run_copy),
        "--backend",
        "weave",
        "--project",
        "team/p",
        "--max-samples",
        "1",
        "--timeout",
        "2",
    )
    assert rc == 1
    (line,) = err.strip().splitlines()
    assert "no answer" in line and "FAILED" not in out
    assert time.monotonic() - started < 20
    assert ledger_lines(run_copy, "weave") == []


def test_silent_otlp_collector_stops_at_the_deadline(
    silent_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    rc, out, err = run_cli(
        capsys,
        str(run_copy),
        "--backend",
        "otlp",
        "--endpoint",
        silent_server,
        "--max-samples",
        "1",
        "--timeout",
        "2",
        "--json",
    )
    assert rc == 1 and json.loads(out)["resumable"]
    (line,) = err.strip().splitlines()
    assert "no answer from the OTLP collector" in line and "2s" in line and "rerun" in line
    assert time.monotonic() - started < 20
    assert ledger_lines(run_copy, "otlp") == []


def test_down_otlp_collector_is_one_line(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, str(run_copy), "--backend", "otlp", "--endpoint", closed_port())
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: cannot reach the OTLP collector at http://127.0.0.1")


def test_upload_backoff_setting_paces_the_retries(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$RLREPLAY_UPLOAD_BACKOFF_S is the first wait before a retry, doubled for each next one; a bad
    value is one line naming it, and nothing is sent."""
    from rlreplay import settings
    from rlreplay.uploaders.pipeline import DEFAULT_RETRIES, MAX_BACKOFF_S

    arrived: list[float] = []

    class Busy(http.server.BaseHTTPRequestHandler):  # a collector that always answers 503
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            arrived.append(time.monotonic())
            self.send_error(503)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = [str(run_copy), "--backend", "otlp", "--endpoint", f"http://127.0.0.1:{server.server_address[1]}"]
    args += ["--max-samples", "1", "--batch-size", "1000"]
    try:
        monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", "soon")
        rc, out, err = run_cli(capsys, *args)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("rlreplay: error: $RLREPLAY_UPLOAD_BACKOFF_S='soon'")
        assert arrived == []

        first = 0.1
        monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", str(first))
        rc, out, err = run_cli(capsys, *args, "--json")
    finally:
        server.shutdown()
        server.server_close()
    summary = json.loads(out)
    assert rc == 1 and summary["sent"] == 0 and summary["failed"] == summary["selected"] > 0
    assert {f["attempts"] for f in summary["failures"]} == {1 + DEFAULT_RETRIES}
    waits = [later - earlier for earlier, later in itertools.pairwise(arrived)]
    expected = [min(MAX_BACKOFF_S, first * 2**i) for i in range(DEFAULT_RETRIES)]
    assert len(waits) == len(expected), waits
    # each wait at least what was asked, and short of the default's (0.5, 1, 2 s)
    default = [min(MAX_BACKOFF_S, settings.UPLOAD_BACKOFF_S.default * 2**i) for i in range(DEFAULT_RETRIES)]
    assert all(want <= got < slow for got, want, slow in zip(waits, expected, default)), (waits, expected)


def test_down_weave_server_is_one_line_on_stderr(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WF_TRACE_SERVER_URL", closed_port())
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WEAVE_RETRY_MAX_INTERVAL", "0.05")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    started = time.monotonic()
    rc, out, err = run_cli(
        capsys, str(run_copy), "--backend", "weave", "--project", "team/p", "--timeout", "5"
    )
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: cannot reach Weave at http://127.0.0.1")
    assert time.monotonic() - started < 30


# -- 12: damaged upload state, --max-samples 0 ---------------------------------------------------------------


def test_uploads_path_that_is_a_file(run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (run_copy / LEDGER_DIR).write_text("not a directory")
    rc, out, err = run_cli(capsys, str(run_copy), "--step", "0")
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: ") and LEDGER_DIR in line and "not a directory" in line
    assert (run_copy / LEDGER_DIR).read_text() == "not a directory"  # left as it was


def test_ledger_line_that_is_not_a_record(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rc, _, err = run_cli(capsys, str(run_copy), "--step", "0", "--max-samples", "1")
    assert rc == 0, err
    (ledger,) = (run_copy / LEDGER_DIR).glob("mlflow-*.jsonl")
    ledger.write_bytes(ledger.read_bytes() + b"123\n")
    kept = ledger.read_bytes()
    rc, out, err = run_cli(capsys, str(run_copy), "--step", "0")
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: ") and ledger.name in line and "line" in line
    assert ledger.read_bytes() == kept


def test_huge_max_bytes_is_one_line(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, str(run_copy), "--max-bytes", "9" * 400, "--dry-run")
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: --max-bytes") and "Traceback" not in err


def test_max_samples_zero_is_refused(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, str(run_copy), "--max-samples", "0", "--dry-run")
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: ") and "--max-samples" in line


# -- 13: tracking-URI credentials ---------------------------------------------------------------------


def test_tracking_uri_credentials_reach_no_file_and_no_output(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-pw-0123456789"
    uri = mlflow_server.replace("http://", f"http://alice:{secret}@")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    project = f"cred-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--step", "0", "--max-samples", "1", "--project", project]
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["sent"] > 0
    rc, out2, err2 = run_cli(capsys, *args, "--dry-run")
    rc3, out3, err3 = run_cli(capsys, *args)
    assert rc == rc3 == 0
    for text in (out, err, out2, err2, out3, err3):
        assert secret not in text and "alice:" not in text
    assert "127.0.0.1" in summary["target"]
    for path in (run_copy / LEDGER_DIR).rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


# -- what a server already has -----------------------------------------------------------------------


def test_check_server_counts_what_mlflow_has(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"has-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--step", "2", "--project", project, "--json"]
    rc, out, err = run_cli(capsys, *args, "--max-samples", "1")
    assert rc == 0, err
    sent = json.loads(out)["sent"]
    for ledger in (run_copy / LEDGER_DIR).glob("mlflow-*.jsonl"):
        ledger.unlink()
    rc, out, err = run_cli(capsys, *args, "--dry-run", "--check-server")
    report = json.loads(out)
    assert rc == 0, err
    assert report["on_server"] == sent < report["selected"] == report["to_send"]


def test_check_server_counts_what_weave_has(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from weave_loopback import WeaveLoopback

    key = "wandb-key-0123456789abcdef0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with WeaveLoopback(api_key=key) as lb:
        monkeypatch.setenv("WF_TRACE_SERVER_URL", lb.url)
        args = [str(run_copy), "--backend", "weave", "--project", "team/has", "--step", "2", "--json"]
        rc, out, err = run_cli(capsys, *args, "--max-samples", "1")
        assert rc == 0, err
        sent = json.loads(out)["sent"]
        for ledger in (run_copy / LEDGER_DIR).glob("weave-*.jsonl"):
            ledger.unlink()
        rc, out, err = run_cli(capsys, *args, "--dry-run", "--check-server")
        assert rc == 0, err
        report = json.loads(out)
        assert report["on_server"] == sent < report["selected"]


def test_upload_takes_the_shared_selection(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(
        capsys, str(run_copy), "--where", "reward > 0.5", "--step", "1..2", "--dry-run", "--json"
    )
    assert rc == 0, err
    chosen = set(json.loads(out)["ids"])
    rows = rlreplay.open_run(run_copy).trajectories().to_pylist()
    expected = {
        r["id"] for r in rows if r["step"] in (1, 2) and r["reward"] is not None and r["reward"] > 0.5
    }
    assert chosen == expected and 0 < len(chosen) < len(rows)
