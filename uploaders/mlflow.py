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
import io
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_OP, KIND_PARSER, KIND_TOOL, KIND_TRAJECTORY
from rlreplay.model import KEY_ATTRIBUTES, Span, Trajectory
from rlreplay.uploaders.base import (
    LEDGER_DIR,
    Prepared,
    RequestTimeout,
    SendResult,
    UploadError,
    public_url,
    scrub,
    secrets_of_url,
    within,
)
from rlreplay.uploaders.otlp_proto import encode_trajectory as encode_otlp
from rlreplay.uploaders.otlp_proto import otel_trace_id, set_any_value  # noqa: F401 - public here too

ENV_URI = "MLFLOW_TRACKING_URI"
LOCAL_DB = "mlflow.db"
MAX_LINKS = 100  # MLflow's limit of trace ids per link_traces_to_run call
MAX_TAG_CHARS = 250  # SQL column limits on Postgres/MySQL
TAG_KEYS = (*KEY_ATTRIBUTES, "worker")
REQUEST_TIMEOUT_S = 60.0  # default overall deadline of one request
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


def default_uri(run_dir: Path) -> str:
    """``$MLFLOW_TRACKING_URI``, else a sqlite store inside the run directory."""
    uri = os.environ.get(ENV_URI)
    if uri:
        return uri
    return f"sqlite:///{(Path(run_dir) / LEDGER_DIR / LOCAL_DB).resolve()}"


def trace_id_for(trajectory_id: str, experiment: str) -> str:
    """The MLflow trace id (``tr-<32 hex>``) of a trajectory uploaded to ``experiment``."""
    return f"tr-{otel_trace_id(trajectory_id, experiment)}"


def _tag_value(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text[:MAX_TAG_CHARS]


def _root_io(traj: Trajectory) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the trace's request and response show: its coordinates, and reward, status, text."""
    inputs = asdict(traj.key)
    outputs: dict[str, Any] = {"status": traj.status, "reward": traj.reward}
    for agent in traj.by_kind(KIND_AGENT)[:1]:
        if isinstance(agent.output, dict):
            for key in ("response_text", "conversation"):
                if key in agent.output:
                    outputs[key] = agent.output[key]
    return inputs, outputs


def encode_trajectory(traj: Trajectory, experiment: str) -> bytes:
    """One trajectory, bound for ``experiment``, as a serialized OTLP ``ExportTraceServiceRequest``."""
    hex_id = otel_trace_id(traj.id, experiment)
    request_id = f"tr-{hex_id}"
    tags = {key: value for key, value in traj.attributes.items() if key in TAG_KEYS and value is not None}
    tags["trajectory_id"] = traj.id

    def attributes(span: Span, is_root: bool) -> dict[str, Any]:
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
            attrs.update({f"rlreplay.{name}": n for name, n in traj.counts.items()})
            for key, value in tags.items():
                attrs[ATTR_TAG_PREFIX + key] = _tag_value(value)
        return attrs

    return encode_otlp(traj, hex_id, attributes)


class MlflowUploader:
    """MLflow traces with their span trees ($MLFLOW_TRACKING_URI, else a sqlite store in the run)."""

    backend = "mlflow"
    requires = ("mlflow",)  # modules it imports when it runs: checked before anything is read
    options = ()
    can_upsert = True

    def __init__(
        self,
        project: str | None = None,
        *,
        uri: str | None = None,
        run_dir: Path | None = None,
        run_name: str | None = None,
        timeout: float | None = REQUEST_TIMEOUT_S,
    ) -> None:
        """Traces go to experiment ``project`` at ``uri`` and are linked to run ``run_name``.

        ``uri`` defaults to ``$MLFLOW_TRACKING_URI``, else a sqlite store in ``run_dir``;
        ``project`` to the run directory's name; ``run_name`` to ``project``.
        """
        if uri is None and not os.environ.get(ENV_URI) and run_dir is None:
            raise UploadError(f"no MLflow tracking URI: set {ENV_URI} (e.g. http://127.0.0.1:5000)")
        self.uri = uri or default_uri(Path(run_dir or "."))
        # the default sqlite store keeps its artifacts in the run; a server picks its own default
        default_store = uri is None and not os.environ.get(ENV_URI) and run_dir is not None
        self.local_dir = Path(run_dir) / LEDGER_DIR if default_store else None
        self.public_uri = public_url(self.uri)
        self._secrets = secrets_of_url(self.uri)
        self.timeout = timeout
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
            timeout=options.timeout,
        )

    def target(self) -> str:
        return f"mlflow:{self.public_uri}#{self.experiment_name}"

    def describe(self) -> str:
        where = f"MLflow {self.public_uri}, experiment {self.experiment_name!r}, run {self.run_name!r}"
        if self._http and self.experiment_id and self.run_id:
            where += f" ({self.public_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id})"
        return where

    # -- preparing (no network) --------------------------------------------------------------
    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        out = []
        for traj in trajectories:
            body = encode_trajectory(traj, self.experiment_name)
            out.append(Prepared(traj.id, trace_id_for(traj.id, self.experiment_name), body, len(body)))
        return out

    # -- sending ---------------------------------------------------------------------------
    def existing(self, trajectory_ids: Sequence[str]) -> set[str] | None:
        """Those of ``trajectory_ids`` whose trace is in the experiment (looked up by trace id)."""
        from mlflow.exceptions import MlflowException

        self.connect()
        found = set()
        for tid in trajectory_ids:
            trace_id = trace_id_for(tid, self.experiment_name)
            try:
                info = within(self.timeout, self._where(), self._store.get_trace_info, trace_id)
            except MlflowException:  # not there
                continue
            if info is not None and str(getattr(info, "experiment_id", "")) == str(self.experiment_id):
                found.add(tid)
        return found

    def _where(self) -> str:
        return f"MLflow at {self.public_uri}"

    def connect(self) -> None:
        """Reach the tracking store; find or create the experiment and the run (one deadline)."""
        if self._client is not None:
            return
        within(self.timeout, self._where(), self._connect)

    def _connect(self) -> None:
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
                    f"MLflow experiment {self.experiment_name!r} is deleted at {self.public_uri}; "
                    "restore it or pass --project NAME"
                )
            else:
                experiment_id = experiment.experiment_id
            self.run_id = self._find_or_create_run(client, experiment_id)
        except MlflowException as exc:
            raise UploadError(f"{self._where()}: {self._line(exc.message)}") from exc
        except (OSError, ImportError, ValueError) as exc:  # an unusable database path, a missing driver
            raise UploadError(f"{self._where()}: {self._line(exc)}") from exc
        self.experiment_id = experiment_id
        self._client = client

    def _probe(self) -> None:
        from mlflow.utils.rest_utils import http_request

        timeout = self.timeout or REQUEST_TIMEOUT_S
        try:
            http_request(self._store.get_host_creds(), "/health", "GET", max_retries=0, timeout=timeout)
        except Exception as exc:  # requests' ConnectionError, or an MlflowException wrapping it
            if "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower():
                raise RequestTimeout(f"no answer from {self._where()} within {timeout:g}s") from exc
            raise UploadError(
                f"cannot reach the MLflow server at {self.public_uri} ({self._line(exc)})"
            ) from exc

    def _find_or_create_run(self, client: Any, experiment_id: str) -> str:
        quoted = self.run_name.replace("'", "\\'")
        found = client.search_runs(
            [experiment_id], filter_string=f"attributes.run_name = '{quoted}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        # MLflow prints the run's address (with the URI's credentials) to stdout: drop it;
        # describe() says where the traces are
        with contextlib.redirect_stdout(io.StringIO()):
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
        where = self._where()
        try:
            body = b"".join(p.body for p in part)
            within(self.timeout, where, self._post if self._http else self._log_local, body)
            trace_ids = [p.backend_id for p in part]
            for i in range(0, len(trace_ids), MAX_LINKS):
                within(
                    self.timeout,
                    where,
                    self._client.link_traces_to_run,
                    trace_ids[i : i + MAX_LINKS],
                    self.run_id,
                )
        except RequestTimeout:
            raise
        except Exception as exc:
            message = self._line(exc)
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
            timeout=self.timeout or REQUEST_TIMEOUT_S,
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

    def _line(self, exc: BaseException | str) -> str:
        return scrub(_one_line(exc), self._secrets)

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
