"""`rlreplay upload --backend mlflow` against a real local MLflow server and a sqlite store.

Expected results are computed from the run's own listing (``Run.trajectories()``) and from the
recorded spans, then compared with what MLflow returns from ``mlflow.search_traces``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import support
from support import EXPERIMENT, VAL_STEPS, qwen_tokenizer_dir

import rlreplay
from rlreplay.format.manifest import update_manifest
from rlreplay.uploaders import pipeline as upload_module
from rlreplay.uploaders.base import LEDGER_DIR, SendResult, UploadError
from rlreplay.uploaders.mlflow import MlflowUploader

MAX_SAMPLES = 2
SAMPLE_RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"


# -- helpers -------------------------------------------------------------------------------------


run_cli = partial(support.run_cli, command="upload")


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)  # stdout holds the JSON summary and nothing else


def experiment_traces(
    uri: str,
    experiment: str,
    filter_string: str | None = None,
    run_id: str | None = None,
    spans: bool = False,
):
    """Traces of an experiment (with their spans only when asked: reading them is slow)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    found = MlflowClient(uri).get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} at {uri}"
    mlflow.set_tracking_uri(uri)
    return mlflow.search_traces(
        locations=[found.experiment_id],
        filter_string=filter_string,
        run_id=run_id,
        include_spans=spans,
        return_type="list",
        max_results=5000,
    )


def recorded_groups(run_dir: Path) -> dict[tuple, set[str]]:
    """(step, validate, sample_index) → trajectory ids, from the run's listing."""
    out: dict[tuple, set[str]] = defaultdict(set)
    for row in rlreplay.open_run(run_dir).trajectories().to_pylist():
        out[(row["step"], bool(row["validate"]), row["sample_index"])].add(row["id"])
    return out


def tag_key(trace: Any) -> tuple:
    tags = trace.info.tags
    return (int(tags["step"]), tags["validate"] == "true", int(tags["sample_index"]))


def traj_id(trace: Any) -> str:
    return trace.info.tags["trajectory_id"]


def ledger_entries(run_dir: Path) -> int:
    count = 0
    for path in (run_dir / LEDGER_DIR).glob("mlflow-*.jsonl"):
        count += sum(1 for line in path.read_bytes().splitlines() if b'"trajectory_id"' in line)
    return count


def check_max_samples_upload(run_dir: Path, uri: str, experiment: str, spans: bool = False) -> list[Any]:
    """Exactly the traces of MAX_SAMPLES whole samples per step and split, found step by step."""
    groups = recorded_groups(run_dir)
    traces = experiment_traces(uri, experiment, spans=spans)
    by_group: dict[tuple, set[str]] = defaultdict(set)
    for trace in traces:
        by_group[tag_key(trace)].add(traj_id(trace))
    assert len(traces) == sum(len(ids) for ids in by_group.values())  # no trace twice
    for key, ids in by_group.items():
        assert ids == groups[key], f"group {key} incomplete or mixed"  # all rollouts of a sample
    splits = {(step, val) for step, val, _ in groups}
    per_split: dict[tuple, int] = defaultdict(int)
    for step, val, _ in by_group:
        per_split[(step, val)] += 1
    assert per_split == {split: MAX_SAMPLES for split in splits}
    # the same set, asked for step by step through MLflow's tag filter
    for step in sorted({step for step, _ in splits}):
        at_step = experiment_traces(uri, experiment, filter_string=f"tags.step = '{step}'")
        expected = set().union(*(ids for key, ids in by_group.items() if key[0] == step))
        assert {traj_id(t) for t in at_step} == expected
    return traces


# -- the server ------------------------------------------------------------------------------------


def test_max_samples_to_server(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient
    from tokenizers import Tokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"srv-{uuid.uuid4().hex[:8]}"
    summary = run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES), "--project", project)
    traces = check_max_samples_upload(run_copy, mlflow_server, project, spans=True)
    assert summary["sent"] == summary["selected"] == len(traces)
    assert summary["failed"] == 0 and summary["failures"] == []
    assert summary["text"]  # the run's manifest names a tokenizer that loads here

    # the span trees, as recorded
    run = rlreplay.open_run(run_copy)
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    saw_error = saw_text = False
    for trace in traces:
        recorded = run.trajectory(traj_id(trace))
        spans = {s.span_id: s for s in trace.data.spans}
        assert set(spans) == {s.span_id for s in recorded.spans}
        for rec in recorded.spans:
            got = spans[rec.span_id]
            assert got.name == rec.name
            assert got.parent_id == rec.parent_id  # nesting
            assert (got.start_time_ns, got.end_time_ns) == (rec.start_ns, rec.end_ns)  # original times
            assert got.status.status_code == ("ERROR" if rec.status == "error" else "OK")
            if rec.status == "error":
                saw_error = True
                (event,) = [e for e in got.events if e.name == "exception"]
                assert event.attributes["exception.type"] == rec.error.split(":")[0]
            if rec.kind == "llm":  # decoded text beside the ids
                assert got.inputs["prompt_ids"] == rec.inputs["prompt_ids"]
                assert got.inputs["prompt_text"] == tok.decode(
                    rec.inputs["prompt_ids"], skip_special_tokens=False
                )
                assert got.outputs["response_text"] == tok.decode(
                    rec.output["token_ids"], skip_special_tokens=False
                )
                saw_text = True
        tags = trace.info.tags
        assert tags["experiment_name"] == EXPERIMENT
        assert tags["rollout_n"] == str(recorded.rollout_n)
        assert trace.info.state == ("ERROR" if recorded.status == "error" else "OK")
        assert trace.info.request_time == recorded.start_ns // 1_000_000
    assert saw_error and saw_text

    # linked to a run named after the experiment
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(project)
    (mlflow_run,) = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{EXPERIMENT}'")
    linked = experiment_traces(mlflow_server, project, run_id=mlflow_run.info.run_id)
    assert {t.info.trace_id for t in linked} == {t.info.trace_id for t in traces}

    # a second upload adds nothing
    again = run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES), "--project", project)
    assert again["sent"] == 0 and again["already_uploaded"] == summary["selected"]
    assert len(experiment_traces(mlflow_server, project)) == len(traces)
    assert len(client.search_runs([experiment.experiment_id])) == 1

    # without the ledger, everything is sent again, and MLflow still holds each trace once
    for path in (run_copy / LEDGER_DIR).glob("mlflow-*.jsonl"):
        path.unlink()
    resent = run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES), "--project", project)
    assert resent["sent"] == len(traces)
    after = experiment_traces(mlflow_server, project, spans=True)
    assert sorted(t.info.trace_id for t in after) == sorted(t.info.trace_id for t in traces)
    assert all(len(t.data.spans) == len(run.trajectory(traj_id(t)).spans) for t in after)

    # the same trajectories into another experiment of the same server: a copy there, none moved
    other = f"{project}-b"
    run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES), "--project", other, "--step", "0")
    step0 = {traj_id(t) for t in traces if t.info.tags["step"] == "0"}
    assert {traj_id(t) for t in experiment_traces(mlflow_server, other)} == step0
    assert len(experiment_traces(mlflow_server, project)) == len(traces)


def test_killed_upload_resumes_without_duplicates(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project = f"kill-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server}
    common = ["--max-samples", str(MAX_SAMPLES), "--project", project]
    args = [sys.executable, "-m", "rlreplay", "upload", str(run_copy), *common, "--batch-size", "1"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while ledger_entries(run_copy) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    done = ledger_entries(run_copy)
    assert proc.returncode == -signal.SIGKILL

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    summary = run_json(capsys, str(run_copy), *common)
    total = summary["selected"]
    assert 3 <= done < total, f"killed with {done} of {total} in the ledger"
    assert summary["already_uploaded"] == done
    assert summary["sent"] == total - done and summary["failed"] == 0
    traces = check_max_samples_upload(
        run_copy, mlflow_server, project, spans=True
    )  # each selected trace once
    assert len(traces) == total
    num_spans = dict(
        zip(*(rlreplay.open_run(run_copy).trajectories()[c].to_pylist() for c in ("id", "num_spans")))
    )
    assert all(len(t.data.spans) == num_spans[traj_id(t)] for t in traces)  # no span twice either


def test_dry_run_bytes_match_the_upload(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"budget-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--project", project, "--max-samples", str(MAX_SAMPLES), "--max-bytes", "60k"]
    dry = run_json(capsys, *args, "--dry-run")
    assert not (run_copy / LEDGER_DIR).exists()  # a dry run writes nothing
    assert 0 < dry["bytes"] == dry["selected_bytes"] <= 60_000
    assert dry["over_budget_groups"] > 0 and dry["to_send"] == len(dry["ids"]) == dry["selected"]
    rc, out, _ = run_cli(capsys, *args, "--dry-run")
    assert rc == 0 and "would send" in out and str(dry["bytes"]) in out

    real = run_json(capsys, *args)
    assert real["sent"] == dry["to_send"]
    assert abs(real["bytes"] - dry["bytes"]) <= 0.03 * dry["bytes"]
    traces = experiment_traces(mlflow_server, project)
    assert {traj_id(t) for t in traces} == set(dry["ids"])
    # whole groups, and the budget keeps the earliest steps
    groups = recorded_groups(run_copy)
    kept_keys = {tag_key(t) for t in traces}
    assert set().union(*(groups[k] for k in kept_keys)) == set(dry["ids"])
    unbounded = run_json(capsys, *args[:-2], "--dry-run")  # the same selection without a budget
    assert unbounded["selected"] == real["selected"] + real["over_budget_trajectories"]
    assert unbounded["already_uploaded"] == real["sent"]


class FlakyMlflow(MlflowUploader):
    """The real MLflow uploader, with failures injected: one transient network error, one
    trajectory refused once (retryable), one refused every time (not retryable)."""

    refuse_once: str = ""
    refuse_always: str = ""
    calls = 0

    def send(self, batch):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        if type(self).calls == 1:
            raise ConnectionError("connection reset by peer")
        out, good = [], []
        for p in batch:
            if p.trajectory_id == self.refuse_always:
                out.append(
                    SendResult(p.trajectory_id, p.backend_id, False, 0, "refused: span too large", False)
                )
            elif p.trajectory_id == self.refuse_once:
                type(self).refuse_once = ""
                out.append(SendResult(p.trajectory_id, p.backend_id, False, 0, "503 try again", True))
            else:
                good.append(p)
        return out + super().send(good)


def test_failures_are_retried_then_reported(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("RLREPLAY_UPLOAD_BACKOFF_S", "0.05")  # the same retries, without 1.5 s of waits
    monkeypatch.setitem(upload_module.BACKENDS, "flaky", f"{__name__}:FlakyMlflow")
    ids = rlreplay.open_run(run_copy).trajectories(step=1)["id"].to_pylist()
    FlakyMlflow.refuse_once, FlakyMlflow.refuse_always, FlakyMlflow.calls = ids[3], ids[5], 0
    project = f"flaky-{uuid.uuid4().hex[:8]}"
    rc, out, _err = run_cli(
        capsys, str(run_copy), "--step", "1", "--project", project, "--backend", "flaky", "--json"
    )
    summary = json.loads(out)
    assert rc == 1  # something failed
    assert summary["sent"] == len(ids) - 1 and summary["failed"] == 1
    (failure,) = summary["failures"]
    assert failure["trajectory_id"] == ids[5] and "span too large" in failure["error"]
    assert {traj_id(t) for t in experiment_traces(mlflow_server, project)} == set(ids) - {ids[5]}
    # the human summary names the failure too
    FlakyMlflow.refuse_always = ids[5]
    rc, out, err = run_cli(capsys, str(run_copy), "--step", "1", "--project", project, "--backend", "flaky")
    assert rc == 1 and "1 trajectory failed" in err and ids[5] in err and ids[5] not in out
    # the plain backend, same ledger: only the missing one goes
    again = run_json(capsys, str(run_copy), "--step", "1", "--project", project)
    assert again["sent"] == 1 and again["already_uploaded"] == len(ids) - 1
    assert {traj_id(t) for t in experiment_traces(mlflow_server, project)} == set(ids)


class FailsAfterFirstBatch(MlflowUploader):
    """The real MLflow uploader, whose server "goes away for good" after the first batch."""

    calls = 0

    def send(self, batch):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        if type(self).calls > 1:
            raise UploadError("MLflow at test: credentials revoked")
        return super().send(batch)


def test_fatal_error_midway_then_rerun(
    mlflow_server: str, run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setitem(upload_module.BACKENDS, "fails", f"{__name__}:FailsAfterFirstBatch")
    FailsAfterFirstBatch.calls = 0
    project = f"fatal-{uuid.uuid4().hex[:8]}"
    args = [str(run_copy), "--project", project, "--max-samples", str(MAX_SAMPLES), "--batch-size", "5"]
    rc, out, err = run_cli(capsys, *args, "--backend", "fails", "--json")
    summary = json.loads(out)
    assert rc == 1 and err.strip().splitlines()[-1] == "rlreplay: error: MLflow at test: credentials revoked"
    assert summary["sent"] == 5 and summary["error"] and summary["failed"] == 0
    total = run_json(capsys, *args, "--dry-run")["selected"]
    assert summary["not_attempted"] == total - 5  # nothing silently dropped
    assert ledger_entries(run_copy) == 5
    again = run_json(capsys, *args)
    assert again["already_uploaded"] == 5 and again["sent"] == total - 5
    assert len(check_max_samples_upload(run_copy, mlflow_server, project)) == total


def test_sample_run_to_server(
    mlflow_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped sample run (copied: the ledger is written into the run directory)."""
    from mlflow.tracking import MlflowClient
    from tokenizers import Tokenizer

    run_dir = tmp_path / SAMPLE_RUN.name
    shutil.copytree(SAMPLE_RUN, run_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    project = f"sample-{uuid.uuid4().hex[:8]}"
    summary = run_json(capsys, str(run_dir), "--max-samples", str(MAX_SAMPLES), "--project", project)
    traces = check_max_samples_upload(run_dir, mlflow_server, project)
    assert summary["sent"] == len(traces) and summary["text"]
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    run = rlreplay.open_run(run_dir)
    some = experiment_traces(mlflow_server, project, filter_string="tags.step = '7'", spans=True)
    assert some
    for trace in some:
        recorded = run.trajectory(traj_id(trace))
        (agent,) = [s for s in trace.data.spans if s.span_type == "AGENT"]
        (rec_agent,) = recorded.by_kind("agent")
        assert agent.outputs["response_text"] == tok.decode(
            rec_agent.output["response_ids"], skip_special_tokens=False
        )
        assert [turn["role"] for turn in agent.outputs["conversation"]][:2] == ["prompt", "assistant"]
        assert {s.span_id: s.parent_id for s in trace.data.spans} == {
            s.span_id: s.parent_id for s in recorded.spans
        }
    experiment = MlflowClient(mlflow_server).get_experiment_by_name(project)
    (mlflow_run,) = MlflowClient(mlflow_server).search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_name == run.experiment == "gsm8k-grpo-qwen3"
    assert len(experiment_traces(mlflow_server, project, run_id=mlflow_run.info.run_id)) == len(traces)


# -- local sqlite, errors ---------------------------------------------------------------------------


def test_max_samples_to_local_sqlite_by_default(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary = run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES))
    db = run_copy / LEDGER_DIR / "mlflow.db"
    assert db.is_file()
    uri = f"sqlite:///{db}"
    traces = check_max_samples_upload(run_copy, uri, EXPERIMENT)
    assert summary["sent"] == len(traces)
    val_step = VAL_STEPS[-1]
    val = experiment_traces(
        uri, EXPERIMENT, filter_string=f"tags.step = '{val_step}' AND tags.validate = 'true'"
    )
    assert {tag_key(t)[1] for t in val} == {True} and len(val) > 0
    again = run_json(capsys, str(run_copy), "--max-samples", str(MAX_SAMPLES))
    assert again["sent"] == 0 and len(experiment_traces(uri, EXPERIMENT)) == len(traces)


def test_unreachable_server_is_one_line(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = support.free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    rc, out, err = run_cli(capsys, str(run_copy), "--max-samples", "1")
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "rlreplay: error: cannot reach the MLflow server at http://127.0.0.1"
    )
    assert time.monotonic() - started < 30
    assert ledger_entries(run_copy) == 0
    assert not (run_copy / "_uploads").exists(), list((run_copy / "_uploads").rglob("*"))  # no ledger file


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-bytes", "lots"], "--max-bytes: not a size"),
        (["--status", "maybe"], "--status must be one of"),
        (["--backend", "nope"], "--backend must be one of"),
        (["--tokenizer", "/no/such/tokenizer-dir"], "no tokenizer at /no/such/tokenizer-dir"),
        (["--backend", "weave", "--dry-run"], "Weave needs --project"),
    ],
)
def test_bad_input(run_copy: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    rc, out, err = run_cli(capsys, str(run_copy), *args)
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlreplay: error: ") and message in line


def test_missing_tokenizer_warns_once_and_sends_ids(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    update_manifest(run_copy, tokenizer="/gone/tokenizer-dir")
    rc, out, err = run_cli(capsys, str(run_copy), "--dry-run", "--json")
    assert rc == 0
    warnings = [line for line in err.splitlines() if line.startswith("rlreplay: warning:")]
    assert len(warnings) == 1 and "without text" in warnings[0]
    summary = json.loads(out)
    assert (
        summary["text"] is None and summary["to_send"] == rlreplay.open_run(run_copy).trajectories().num_rows
    )
    # with text, the same selection weighs more
    text_rc, text_out, _ = run_cli(
        capsys, str(run_copy), "--dry-run", "--json", "--tokenizer", str(qwen_tokenizer_dir())
    )
    assert text_rc == 0 and json.loads(text_out)["bytes"] > summary["bytes"]
