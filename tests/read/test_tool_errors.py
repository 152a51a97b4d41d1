"""One count of tool errors everywhere: the listing (``ls``), the ``show`` header, ``stats``, the
UI's tool error rate and trajectory page, and ``audit``'s ``tool_error`` check agree, for runs
recorded now and runs recorded before the recorder wrote why a tool call failed. The expected
counts are read from the span files, by the rule written out here."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import run_cli

import rlreplay

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
_FAILED_TEXT = re.compile(r"\s*(error|exception|traceback)\b", re.IGNORECASE)


def _failed(status: str, output: Any) -> bool:
    """The definition: raised, or a result whose mapping (or a tuple's mapping) has a true
    ``error`` or ``ok``/``success`` false, or whose text begins with error/exception/traceback."""
    if status == "error":
        return True
    parts = (
        [output]
        if isinstance(output, dict)
        else [p for p in output if isinstance(p, dict)]
        if (isinstance(output, list))
        else []
    )
    if any(p.get("error") or p.get("ok") is False or p.get("success") is False for p in parts):
        return True
    first = output[0] if isinstance(output, list) and output else output
    text = first.get("text", first.get("content")) if isinstance(first, dict) else first
    return isinstance(text, str) and _FAILED_TEXT.match(text) is not None


def expected_errors(run: Path) -> dict[str, int]:
    """Per trajectory id: its failed tool calls, from the span files alone."""
    files = sorted(glob.glob(str(run / "spans" / "*" / "*" / "*.parquet")))
    spans = pa.concat_tables(
        [pq.read_table(f, columns=["trajectory_id", "kind", "status", "output"]) for f in files]
    )
    counts: dict[str, int] = {}
    for row in spans.to_pylist():
        counts.setdefault(row["trajectory_id"], 0)
        if row["kind"] == "tool":
            output = orjson.loads(row["output"]) if row["output"] is not None else None
            counts[row["trajectory_id"]] += _failed(row["status"], output)
    return counts


def cli(capsys: pytest.CaptureFixture[str], *args: Any) -> str:
    rc, out, err = run_cli(capsys, *args)
    assert rc in (0, 1), err  # audit exits 1 when it finds something
    return out


def assert_every_surface_counts(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = expected_errors(run)
    assert any(truth.values()) and not all(truth.values())  # both kinds, or the test proves little
    rows = [json.loads(line) for line in cli(capsys, "ls", run, "--json").splitlines()]
    assert {r["id"]: r["tool_errors"] for r in rows} == {
        i: n for i, n in truth.items() if i in {r["id"] for r in rows}
    }
    assert {r["id"] for r in rows} == set(truth)

    # audit's tool_error findings: one per failed call
    findings = [
        json.loads(line)
        for line in cli(capsys, "audit", run, "--checks", "tool_error", "--json").splitlines()
    ]
    found: dict[str, int] = {}
    for f in findings:
        found[f["trajectory_id"]] = found.get(f["trajectory_id"], 0) + 1
    assert found == {i: n for i, n in truth.items() if n}

    # stats: per step and split, failed calls over calls
    by_split: dict[tuple[Any, bool], list[int]] = {}
    for r in rows:
        errors_calls = by_split.setdefault((r["step"], r["validate"]), [0, 0])
        errors_calls[0] += truth[r["id"]]
        errors_calls[1] += r["tool_calls"]
    stats = [json.loads(line) for line in cli(capsys, "stats", run, "--json").splitlines()]
    for s in stats:
        errors, calls = by_split[(s["step"], s["validate"])]
        assert s["tool_error_rate"] == pytest.approx(errors / calls if calls else None)

    # show's header, for trajectories with and without failed calls
    with_errors = [i for i, n in truth.items() if n][:3]
    without = [i for i, n in truth.items() if not n][:2]
    for traj_id in with_errors + without:
        assert f"tool_errors={truth[traj_id]}" in cli(capsys, "show", run, traj_id, "--no-text")
        shown = json.loads(cli(capsys, "show", run, traj_id, "--json", "--no-text"))
        assert shown["tool_errors"] == truth[traj_id]

    # the UI: the overview's tool error rate and the trajectory page's count
    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    folder = run.parent
    with TestClient(create_app(folder, poll_ms=60_000)) as client:
        page = client.get(f"/r/{run.name}/")
        assert page.status_code == 200, page.text
        shown: dict[tuple[str, bool], str] = {}
        for split, section in re.findall(
            r'<section class="split" id="(\w+)-stats">(.*?)</section>', page.text, re.S
        ):
            for step, cells in re.findall(r'<tr data-step="([^"]*)">(.*?)</tr>', section, re.S):
                shown[step, split == "val"] = re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)[8]
        assert len(shown) == len(stats)
        for s in stats:
            rate = s["tool_error_rate"]
            assert shown[str(s["step"]), s["validate"]] == ("–" if rate is None else f"{rate:.3g}")
        for traj_id in with_errors + without:
            body = client.get(f"/r/{run.name}/t/{traj_id}").text
            calls = next(r["tool_calls"] for r in rows if r["id"] == traj_id)
            assert f"({calls} calls, {truth[traj_id]} errors)" in body


def test_the_shipped_tool_run_counts_its_failed_calls_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "runs" / SAMPLE.name
    shutil.copytree(SAMPLE, run)
    assert_every_surface_counts(run, capsys)


# ---- a run of the generic API with every way a tool call fails, and look-alikes that do not ----


@rlreplay.trace_op(name="Tools.execute", kind="tool")
async def execute(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result


FAILING = [
    ValueError("bad input"),  # raised
    {"ok": False, "value": None},  # ok false
    {"success": False},
    {"error": "division by zero"},
    "Error: no such file",
    "  Traceback (most recent call last): ...",
    "exception raised by the tool",
    [{"text": "fine-looking text", "image": None}, 0.0, {"ok": False}],  # verl's tuple, metrics say so
    [{"text": "error: '(' was never closed", "image": None}, 0.0, {}],
    ({"content": "Exception: timeout"}, 1.0),
]
PASSING = [
    {"ok": True, "value": 3},
    {"error": None, "value": 4},
    {"errors": [], "value": 5},
    "no error here",
    "Errorless output",
    "the tool raised nothing",
    [{"text": "42", "image": None}, 0.0, {"ok": True}],
    [1, 2, 3],
    None,
]


def _record(run: Path) -> None:
    rlreplay.init(run, experiment="tool-errors", worker="w0")

    async def go() -> None:
        for n, result in enumerate(FAILING + PASSING):
            async with rlreplay.trajectory(step=n % 3, sample_index=n, rollout_n=0):
                with contextlib.suppress(ValueError):
                    await execute(result)
                if n % 2:
                    await execute({"ok": True})  # a second call that went well

    asyncio.run(go())
    rlreplay.close()


@pytest.fixture(scope="module")
def generic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tool-errors") / "runs" / "generic"
    _record(run)
    return run


def test_every_form_of_failure_counts_and_look_alikes_do_not(
    generic_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = expected_errors(generic_run)
    assert sum(truth.values()) == len(FAILING)
    assert_every_surface_counts(generic_run, capsys)


def test_a_run_recorded_before_reasons_were_written_counts_alike(
    generic_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The span files as an older recorder left them: no reason in a returned failure's ``error``,
    and index files that counted raised calls only."""
    from rlreplay.format import index as tindex

    run = tmp_path / "runs" / "old"
    shutil.copytree(generic_run, run)
    shutil.rmtree(run / "_run_index", ignore_errors=True)
    for shard in run.glob("spans/*/*/*.parquet"):
        table = pq.read_table(shard)
        returned = pa.array(
            [
                k == "tool" and s == "ok"
                for k, s in zip(table["kind"].to_pylist(), table["status"].to_pylist())
            ]
        )
        error = pa.array(
            [None if r else e for r, e in zip(returned.to_pylist(), table["error"].to_pylist())], pa.string()
        )
        table = table.set_column(table.schema.get_field_index("error"), "error", error)
        pq.write_table(table, shard, compression="zstd")
        old = tindex.build(table.select(tindex.SPAN_COLUMNS))
        raised = [
            k == "tool" and s == "error"
            for k, s in zip(table["kind"].to_pylist(), table["status"].to_pylist())
        ]
        counts: dict[str, int] = {}
        for tid, hit in zip(table["trajectory_id"].to_pylist(), raised):
            counts[tid] = counts.get(tid, 0) + hit
        old = old.set_column(
            old.schema.get_field_index("tool_errors"),
            "tool_errors",
            pa.array([counts[i] for i in old["id"].to_pylist()], pa.int64()),
        )
        path = tindex.index_path(shard)
        pq.write_table(
            old.replace_schema_metadata(
                {tindex.INDEX_KEY: b"2", tindex.SHARD_BYTES_KEY: str(shard.stat().st_size).encode()}
            ),
            path,
        )
    assert_every_surface_counts(run, capsys)


def otlp_root_attributes(bodies: list[bytes]) -> dict[str, dict[str, Any]]:
    """Per trajectory id: the attributes of the root span OTLP requests carried (values decoded)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = {}
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for span in (s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans):
            if span.parent_span_id:
                continue
            attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}
            out[attrs["rlreplay.trajectory_id"]] = attrs
    return out


def test_diff_and_what_uploads_send_count_the_same_tool_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: the counts are the same in ``diff``, ``--json`` and uploads (OTLP to a loopback
    collector; MLflow's OTLP request, which its uploader posts to the tracking server)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
    from test_export_values import Collector

    from rlreplay.uploaders.mlflow import encode_trajectory as mlflow_request

    truth = expected_errors(SAMPLE)
    rows = [json.loads(line) for line in cli(capsys, "ls", SAMPLE, "--json").splitlines()]
    failed = next(r for r in rows if truth[r["id"]])
    fine = next(r for r in rows if not truth[r["id"]])
    pair = json.loads(cli(capsys, "diff", SAMPLE, failed["id"], fine["id"], "--json"))
    assert (pair["a"]["tool_errors"], pair["b"]["tool_errors"]) == (truth[failed["id"]], 0)
    group = json.loads(cli(capsys, "diff", SAMPLE, failed["id"], "--group", "--json"))
    assert len(group["rollouts"]) > 1
    assert {r["id"]: r["tool_errors"] for r in group["rollouts"]} == {
        r["id"]: truth[r["id"]] for r in group["rollouts"]
    }

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)  # the upload's ledger goes into the run
    collector = Collector()
    try:
        args = ["upload", run, "-b", "otlp", "--endpoint", collector.url, "--project", "errors"]
        cli(capsys, *args, "--step", str(failed["step"]))
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    sent = otlp_root_attributes(collector.bodies)
    assert len(sent) == sum(r["step"] == failed["step"] for r in rows)
    assert any(truth[i] for i in sent) and not all(truth[i] for i in sent)
    for trajectory_id, attrs in sent.items():
        assert attrs["rlreplay.tool_errors"] == truth[trajectory_id]
        assert json.loads(attrs["metadata"])["tool_errors"] == truth[trajectory_id]

    opened = rlreplay.open_run(SAMPLE)
    for traj in opened.load(list(truth)):
        [attrs] = otlp_root_attributes([mlflow_request(traj, "errors")]).values()
        assert attrs["rlreplay.tool_errors"] == truth[traj.id]
