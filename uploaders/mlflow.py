"""MLflow backend: each trajectory becomes one MLflow trace with its original span tree.

Wire form: OTLP protobuf (``ExportTraceServiceRequest``), one per trajectory, built once in
:meth:`MlflowUploader.prepare` so that its size is exact. Deterministic OpenTelemetry ids
(the trace id derived from the trajectory id and the experiment, span ids = the recorded span
ids) make sending again an upsert on (trace id, span id) that adds nothing; the trace tag
``trajectory_id`` names the recorded trajectory. A batch goes in one request (up to
``MAX_REQUEST_BYTES``): to a server, a POST to its OTLP endpoint ``/v1/traces``; to a database
URI (``sqlite:///...``), the same spans through the store's ``log_spans``, as the server would.
Traces are then linked to an MLflow run named after the experiment, so they show in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlreplay.schema import (
    KIND_AGENT,
    KIND_LLM,
    KIND_OP,
    KIND_PARSER,
    KIND_TOOL,
    KIND_TRAJECTORY,
    STATUS_ERROR,
)
from rlreplay.store import Span, Trajectory
from rlreplay.uploaders.base import LEDGER_DIR, Prepared, SendResult, UploadError

ENV_URI = "MLFLOW_TRACKING_URI"
LOCAL_DB = "mlflow.db"
MAX_LINKS = 100  # MLflow's limit of trace ids per link_traces_to_run call
MAX_TAG_CHARS = 250  # SQL column limits on Postgres/MySQL
TAG_KEYS = ("step", "sample_index", "rollout_n", "validate", "experiment_name", "worker")
REQUEST_TIMEOUT_S = 120
MAX_REQUEST_BYTES = 16 << 20  # per request, below common proxy limits for uploads

SPAN_TYPES = {
    KIND_TRAJECTORY: "CHAIN",
    KIND_AGENT: "AGENT",
    KIND_LLM: "LLM",
    KIND_TOOL: "TOOL",
    KIND_PARSER: "PARSER",
    KIND_OP: "UNKNOWN",
}

# MLflow span attribute keys (mlflow.tracing.constant.SpanAttributeKey), spelt out so that
# preparing payloads does not import mlflow.
ATTR_REQUEST_ID = "mlflow.traceRequestId"
ATTR_INPUTS = "mlflow.spanInputs"
ATTR_OUTPUTS = "mlflow.spanOutputs"
ATTR_SPAN_TYPE = "mlflow.spanType"
ATTR_TAG_PREFIX = "mlflow.traceTag."
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT, _FLOAT = {int}, {float}


def default_uri(run_dir: Path) -> str:
    """``$MLFLOW_TRACKING_URI``, else a sqlite store inside the run directory."""
    uri = os.environ.get(ENV_URI)
    if uri:
        return uri
    return f"sqlite:///{(Path(run_dir) / LEDGER_DIR / LOCAL_DB).resolve()}"


def otel_trace_id(trajectory_id: str, experiment: str) -> str:
    """128-bit trace id (32 hex) derived from the trajectory id and the experiment's name.

    MLflow trace ids are unique per tracking server, whatever the experiment: with the bare
    trajectory id, uploading a run to a second experiment would silently leave its traces in
    the first. Mixing in the experiment keeps re-uploads idempotent and experiments apart.
    """
    return hashlib.blake2b(f"{experiment}\n{trajectory_id}".encode(), digest_size=16).hexdigest()


def trace_id_for(trajectory_id: str, experiment: str) -> str:
    """The MLflow trace id (``tr-<32 hex>``) of a trajectory uploaded to ``experiment``."""
    return f"tr-{otel_trace_id(trajectory_id, experiment)}"


def _tag_value(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text[:MAX_TAG_CHARS]


_DOUBLE = struct.Struct("<d")  # AnyValue.double_value (field 4) is a little-endian fixed64
_INT_ITEMS: dict[int, bytes] = {}  # small non-negative int → its serialized ArrayValue item


def _int_item(value: int) -> bytes:
    """An ``ArrayValue.values`` item (field 1) holding ``AnyValue{int_value (field 3): value}``."""
    varint = bytearray()
    rest = value
    while rest > 0x7F:
        varint.append((rest & 0x7F) | 0x80)
        rest >>= 7
    varint.append(rest)
    item = b"\x0a" + bytes([len(varint) + 1]) + b"\x18" + bytes(varint)
    if value < 1 << 21:
        _INT_ITEMS[value] = item
    return item


def set_any_value(pb: Any, value: Any) -> None:
    """Python value → OTLP ``AnyValue`` (what MLflow's server turns back into the same JSON)."""
    cls = type(value)
    if cls is str:
        pb.string_value = value
    elif cls is bool:
        pb.bool_value = value
    elif cls is int:
        if _INT64[0] <= value <= _INT64[1]:
            pb.int_value = value
        else:
            pb.string_value = str(value)
    elif cls is float:
        pb.double_value = value
    elif value is None:
        pass
    elif cls is list or cls is tuple:
        arr = pb.array_value
        arr.SetInParent()
        kinds = set(map(type, value))
        if kinds == _INT and min(value) >= 0 and max(value) <= _INT64[1]:
            # token ids: serialized here, then parsed in C (15x faster than building AnyValues)
            items = _INT_ITEMS
            arr.MergeFromString(b"".join([items.get(v) or _int_item(v) for v in value]))
        elif kinds == _FLOAT:  # log-probs
            pack = _DOUBLE.pack
            arr.MergeFromString(b"".join([b"\x0a\x09\x21" + pack(v) for v in value]))
        else:
            for item in value:
                set_any_value(arr.values.add(), item)
    elif cls is dict:
        kvs = pb.kvlist_value
        kvs.SetInParent()
        for key, item in value.items():
            kv = kvs.values.add()
            kv.key = str(key)
            set_any_value(kv.value, item)
    else:
        pb.string_value = str(value)


def _root_io(traj: Trajectory) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the trace's request and response show: its coordinates, and reward, status, text."""
    inputs = {
        "step": traj.step,
        "sample_index": traj.sample_index,
        "rollout_n": traj.rollout_n,
        "validate": traj.validate,
        "experiment": traj.experiment,
    }
    outputs: dict[str, Any] = {"status": traj.status, "reward": traj.reward}
    for agent in traj.by_kind(KIND_AGENT)[:1]:
        if isinstance(agent.output, dict):
            for key in ("response_text", "conversation"):
                if key in agent.output:
                    outputs[key] = agent.output[key]
    return inputs, outputs


def _exception(span: Span) -> dict[str, str] | None:
    out = span.output
    if isinstance(out, dict) and out.get("__type__") == "exception":
        return {
            "exception.type": str(out.get("type", "")),
            "exception.message": str(out.get("message", "")),
            "exception.stacktrace": str(out.get("traceback", "")),
        }
    if span.error:
        kind, _, message = span.error.partition(": ")
        return {"exception.type": kind, "exception.message": message or span.error}
    return None


def encode_trajectory(traj: Trajectory, experiment: str) -> bytes:
    """One trajectory, bound for ``experiment``, as a serialized OTLP ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    scope.scope.name = "rlreplay"
    hex_id = otel_trace_id(traj.id, experiment)
    trace_id = bytes.fromhex(hex_id)
    request_id = f"tr-{hex_id}"
    known = {s.span_id for s in traj.spans}
    tags = {key: value for key, value in traj.attributes.items() if key in TAG_KEYS and value is not None}
    tags["trajectory_id"] = traj.id
    for span in traj.spans:
        pb = scope.spans.add()
        pb.trace_id = trace_id
        pb.span_id = bytes.fromhex(span.span_id)
        is_root = span.parent_id is None or span.parent_id not in known
        if not is_root:
            pb.parent_span_id = bytes.fromhex(span.parent_id)
        pb.name = span.name
        pb.start_time_unix_nano = span.start_ns
        pb.end_time_unix_nano = span.end_ns
        attrs: dict[str, Any] = {
            ATTR_REQUEST_ID: request_id,
            ATTR_SPAN_TYPE: SPAN_TYPES.get(span.kind, "UNKNOWN"),
            "rlreplay.kind": span.kind,
        }
        inputs, output = span.inputs, span.output
        if is_root and span.kind == KIND_TRAJECTORY and inputs is None and output is None:
            inputs, output = _root_io(traj)
        if inputs is not None:
            attrs[ATTR_INPUTS] = inputs
        if output is not None:
            attrs[ATTR_OUTPUTS] = output
        if span.reward is not None:
            attrs["rlreplay.reward"] = span.reward
        if span.num_tokens is not None:
            attrs["rlreplay.num_tokens"] = span.num_tokens
        for key, value in (span.attributes or {}).items():
            attrs.setdefault(str(key), value)
        if is_root:
            attrs["rlreplay.trajectory_id"] = traj.id
            for key, value in tags.items():
                attrs[ATTR_TAG_PREFIX + key] = _tag_value(value)
        for key, value in attrs.items():
            kv = pb.attributes.add()
            kv.key = key
            set_any_value(kv.value, value)
        if span.status == STATUS_ERROR:
            pb.status.code = Status.STATUS_CODE_ERROR
            pb.status.message = (span.error or "error")[:1000]
            exc = _exception(span)
            if exc:
                event = pb.events.add()
                event.name = "exception"
                event.time_unix_nano = span.end_ns
                for key, value in exc.items():
                    kv = event.attributes.add()
                    kv.key = key
                    kv.value.string_value = value
        else:
            pb.status.code = Status.STATUS_CODE_OK
    return request.SerializeToString()


class MlflowUploader:
    """Sends trajectories to MLflow as traces (see the module docstring)."""

    backend = "mlflow"

    def __init__(
        self,
        project: str | None = None,
        *,
        uri: str | None = None,
        run_dir: Path | None = None,
        run_name: str | None = None,
    ) -> None:
        """Traces go to experiment ``project`` at ``uri`` and are linked to run ``run_name``.

        ``uri`` defaults to ``$MLFLOW_TRACKING_URI``, else a sqlite store in ``run_dir``;
        ``project`` to the run directory's name; ``run_name`` to ``project``.
        """
        if uri is None and not os.environ.get(ENV_URI) and run_dir is None:
            raise UploadError(f"no MLflow tracking URI: set {ENV_URI} (e.g. http://127.0.0.1:5000)")
        self.uri = uri or default_uri(Path(run_dir or "."))
        self.local_dir = Path(run_dir) / LEDGER_DIR if run_dir is not None and uri is None else None
        self.experiment_name = project or (
            Path(run_dir).resolve().name if run_dir is not None else "rlreplay"
        )
        self.run_name = run_name or self.experiment_name
        self._client: Any = None
        self._store: Any = None
        self._http = self.uri.startswith(("http://", "https://"))
        self.experiment_id: str | None = None
        self.run_id: str | None = None

    @classmethod
    def from_options(cls, options: Any) -> MlflowUploader:
        """From ``pipeline.BackendOptions``: experiment ``--project``, else the run's experiment."""
        return cls(
            options.project or options.experiment,
            run_dir=options.run_dir,
            run_name=options.experiment,
        )

    def target(self) -> str:
        return f"mlflow:{self.uri}#{self.experiment_name}"

    def describe(self) -> str:
        where = f"MLflow {self.uri}, experiment {self.experiment_name!r}, run {self.run_name!r}"
        if self._http and self.experiment_id and self.run_id:
            where += f" ({self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id})"
        return where

    # -- preparing (no network) --------------------------------------------------------------
    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        out = []
        for traj in trajectories:
            body = encode_trajectory(traj, self.experiment_name)
            out.append(Prepared(traj.id, trace_id_for(traj.id, self.experiment_name), body, len(body)))
        return out

    # -- sending ---------------------------------------------------------------------------
    def connect(self) -> None:
        """Reach the tracking store; find or create the experiment and the run."""
        if self._client is not None:
            return
        from mlflow.exceptions import MlflowException
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient

        try:
            self._store = TracingClient(self.uri).store
            if self._http:
                self._probe()
            elif self.uri.startswith("sqlite:///"):
                Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            client = MlflowClient(self.uri)
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                artifacts = (
                    (self.local_dir / "mlflow-artifacts").resolve().as_uri() if self.local_dir else None
                )
                experiment_id = client.create_experiment(self.experiment_name, artifact_location=artifacts)
            elif experiment.lifecycle_stage != "active":
                raise UploadError(
                    f"MLflow experiment {self.experiment_name!r} is deleted at {self.uri}; "
                    "restore it or pass --project NAME"
                )
            else:
                experiment_id = experiment.experiment_id
            self.run_id = self._find_or_create_run(client, experiment_id)
        except MlflowException as exc:
            raise UploadError(f"MLflow at {self.uri}: {_one_line(exc.message)}") from exc
        except (OSError, ImportError, ValueError) as exc:  # an unusable database path, a missing driver
            raise UploadError(f"MLflow at {self.uri}: {_one_line(exc)}") from exc
        self.experiment_id = experiment_id
        self._client = client

    def _probe(self) -> None:
        from mlflow.utils.rest_utils import http_request

        try:
            http_request(self._store.get_host_creds(), "/health", "GET", max_retries=0, timeout=10)
        except Exception as exc:  # requests' ConnectionError, or an MlflowException wrapping it
            raise UploadError(f"cannot reach the MLflow server at {self.uri} ({_one_line(exc)})") from exc

    def _find_or_create_run(self, client: Any, experiment_id: str) -> str:
        quoted = self.run_name.replace("'", "\\'")
        found = client.search_runs(
            [experiment_id], filter_string=f"attributes.run_name = '{quoted}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        # MLflow prints the run's address to stdout; keep stdout for our summary (and --json)
        with contextlib.redirect_stdout(sys.stderr):
            run = client.create_run(experiment_id, run_name=self.run_name, tags={"rlreplay.uploaded": "true"})
            client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        """One request per ``MAX_REQUEST_BYTES`` of the batch; a failed request fails only its traces."""
        if not batch:
            return []
        self.connect()
        results: list[SendResult] = []
        part: list[Prepared] = []
        size = 0
        for item in batch:
            if part and size + item.nbytes > MAX_REQUEST_BYTES:
                results.extend(self._send_part(part))
                part, size = [], 0
            part.append(item)
            size += item.nbytes
        results.extend(self._send_part(part))
        return results

    def _send_part(self, part: list[Prepared]) -> list[SendResult]:
        try:
            body = b"".join(p.body for p in part)
            if self._http:
                self._post(body)
            else:
                self._log_local(body)
            trace_ids = [p.backend_id for p in part]
            for i in range(0, len(trace_ids), MAX_LINKS):
                self._client.link_traces_to_run(trace_ids[i : i + MAX_LINKS], self.run_id)
        except Exception as exc:
            message = _one_line(exc)
            retryable = not _is_client_error(exc)
            return [SendResult(p.trajectory_id, p.backend_id, False, 0, message, retryable) for p in part]
        return [SendResult(p.trajectory_id, p.backend_id, True, p.nbytes) for p in part]

    def _post(self, body: bytes) -> None:
        from mlflow.tracing.utils.otlp import MLFLOW_EXPERIMENT_ID_HEADER, OTLP_TRACES_PATH
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        response = http_request(
            host_creds=self._store.get_host_creds(),
            endpoint=OTLP_TRACES_PATH,
            method="POST",
            data=body,
            extra_headers={
                "Content-Type": "application/x-protobuf",
                MLFLOW_EXPERIMENT_ID_HEADER: self.experiment_id,
            },
            max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        )
        verify_rest_response(response, OTLP_TRACES_PATH)

    def _log_local(self, body: bytes) -> None:
        from mlflow.entities.span import Span as MlflowSpan
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = [
            MlflowSpan.from_otel_proto(pb)
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for pb in scope_spans.spans
        ]
        self._store.log_spans(self.experiment_id, spans)

    def close(self) -> None:
        self._client = None
        self._store = None


def _is_client_error(exc: Exception) -> bool:
    """A 4xx answer (other than 408/429) will not change on a retry."""
    code = getattr(exc, "error_code", None)
    return code in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED")


def _one_line(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else (str(exc) or type(exc).__name__)
    return " ".join(text.split())[:300]
