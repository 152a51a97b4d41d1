"""``export`` and an upload give back what was recorded, or a marker that cannot be taken for data:
rewards and log-probs over the float edge values (NaN with its payload, ±inf, -0.0, subnormals), and
tool replies over the value class (marker-shaped dicts, NaN, big ints, bytes) reach the tool
messages and an OTLP collector as the tool's data.

Runs are recorded here through the public API; the expected values are the values themselves,
compared by their bits.
"""

from __future__ import annotations

import gzip
import http.server
import json
import math
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import qwen_tokenizer_dir

import rlreplay
from rlreplay.cli.main import main

sys.path.insert(0, str(Path(__file__).parents[1] / "format"))
from test_payload_fidelity import json_text, reference_form


def f64(raw: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", raw))[0]


def bits64(x: float) -> bytes:
    return struct.pack("<d", x)


def bits32(x: float) -> bytes:
    return np.float32(x).tobytes()


NAN = float("nan")
REWARDS = [NAN, -NAN, f64(0x7FF80000DEADBEEF), math.inf, -math.inf, -0.0, 5e-324, 0.25]
#: float32 values (log-probs are kept as float32): NaN, ±inf, -0.0, the smallest subnormal
LOG_PROBS = [NAN, -math.inf, math.inf, -0.0, float(np.float32(1e-45)), -0.5]
#: what each trajectory's tool returns besides its text
SHAPES: list[dict[str, Any]] = [
    {"__type__": "exception", "type": "ValueError", "message": "the tool's data"},
    {"__type__": "tokens", "t": "i32", "o": 0, "n": 3},
    {"__type__": "float", "value": "nan"},
    {"__type__": "truncated", "bytes": 9, "preview": "x"},
    {"score": NAN, "big": 2**70, "blob": b"\x00\xff"},
    {"__type__": "int", "value": "12", "inner": {"__type__": "bytes", "base64": "AA=="}},
    {"ok": True, "neg": -0.0, "inf": -math.inf},
    {},
]


@rlreplay.trace_op(name="CalcTool.execute", kind="tool")
def execute(i: int) -> dict[str, Any]:
    return {**SHAPES[i], "text": f"result={i}"}


@rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
def agent(i: int) -> dict[str, Any]:
    execute(i)
    response = [1, 2, 3, 4, 5, 6]
    return {
        "prompt_ids": [7, 8, 9],
        "response_ids": response,
        "response_mask": [1, 1, 1, 0, 0, 1],
        "response_logprobs": LOG_PROBS,
        "reward_score": REWARDS[i],
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("values") / "run"
    rlreplay.init(run, worker="w0")
    try:
        for i in range(len(REWARDS)):
            with rlreplay.trajectory(step=0, sample_index=i, rollout_n=0):
                agent(i)
    finally:
        rlreplay.close()
    return run


def exported(run_dir: Path, out: Path) -> list[dict[str, Any]]:
    args = ["export", str(run_dir), "--tokenizer", str(qwen_tokenizer_dir()), "--out", str(out)]
    assert main([*args, "--token-ids", "--logprobs"]) == 0
    if out.suffix == ".parquet":
        rows = pq.read_table(out).to_pylist()
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["sample_index"])


def same_float(got: Any, want: float, bits: Any) -> bool:
    """``got`` is ``want`` bit for bit, or the format's float marker that names it exactly."""
    if type(got) is float:
        return bits(got) == bits(want)
    if isinstance(got, dict) and got.get("__type__") == "float":
        value = f64(int(got["bits"], 16)) if "bits" in got else float(got["value"])
        return bits(value) == bits(want)
    return False


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_writes_each_value_as_recorded_or_as_an_unambiguous_marker(
    run_dir: Path, tmp_path: Path, suffix: str
) -> None:
    rows = exported(run_dir, tmp_path / f"export{suffix}")
    assert [r["sample_index"] for r in rows] == list(range(len(REWARDS)))
    for row, reward in zip(rows, REWARDS):
        assert same_float(row["reward"], reward, bits64), (row["reward"], reward)
        assert len(row["rollout_log_probs"]) == len(LOG_PROBS)
        for got, want in zip(row["rollout_log_probs"], LOG_PROBS):
            assert same_float(got, want, bits32), (got, want)
        tool = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert tool == [f"result={row['sample_index']}"], row["messages"]


class Collector:
    """A loopback OTLP/HTTP collector: keeps every span it is sent, answers 200."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.bodies: list[bytes] = []  # each request, uncompressed
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.bodies.append(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    yield found
    found.server.shutdown()
    found.server.server_close()


def attribute(span: Any, key: str) -> Any:
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return None


def test_an_otlp_collector_receives_marker_shaped_tool_replies_as_data(
    run_dir: Path, tmp_path: Path, collector: Collector
) -> None:
    import shutil

    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)  # the upload's ledger goes into the run
    args = ["upload", str(run), "-b", "otlp", "--endpoint", collector.url, "--project", "values"]
    assert main([*args, "--tokenizer", str(qwen_tokenizer_dir())]) == 0
    tools = {}
    for span in collector.spans:
        if attribute(span, "rlreplay.kind") == "tool":
            tools[attribute(span, "output.value")] = span
    assert len(tools) == len(SHAPES)
    for text, span in tools.items():
        assert span.status.code != Status.STATUS_CODE_ERROR and not span.events  # no failure, no exception
        sent = json.loads(text)  # the reply's JSON form: the tool's own dicts wrapped, never markers
        reply = sent["value"] if sent.get("__type__") == "dict" else sent
        i = int(reply["text"].removeprefix("result="))
        assert json_text(sent) == json_text(reference_form({**SHAPES[i], "text": f"result={i}"}))
