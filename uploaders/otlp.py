"""OTLP backend: trajectories as OpenTelemetry traces to any collector (Phoenix, Langfuse, Jaeger, ...).

Wire form: OTLP/HTTP protobuf, gzip, POSTed to ``--endpoint`` (a base URL gets ``/v1/traces``),
built by :mod:`rlreplay.uploaders.otlp_proto` like the MLflow backend's. Span attributes follow
the OpenInference conventions that Phoenix and Langfuse render: ``openinference.span.kind``
(AGENT, LLM, TOOL, CHAIN), ``input.value`` / ``output.value``, ``llm.input_messages.*`` /
``llm.output_messages.*`` (the conversation, decoded), ``llm.token_count.*``, ``tool.name``;
plus the trajectory keys, reward and advantage (``rlreplay.*`` and ``metadata``). The trace id
is derived from the trajectory id and the project, the span ids are the recorded ones, the
span ids are derived from the project and the recorded span ids (``rlreplay.span_id`` holds the
recorded one: Phoenix keys spans by span id alone, so one run can go to two projects), the times
are the recorded times: sending again adds nothing new to a collector that keys spans by id
(Phoenix ignores a span id it has). Headers (tokens) come from ``--header K=V`` or
``OTEL_EXPORTER_OTLP_HEADERS`` and are never written anywhere.
"""

from __future__ import annotations

import gzip
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_TOOL, KIND_TRAJECTORY
from rlreplay.model import Span, Trajectory
from rlreplay.uploaders import chat
from rlreplay.uploaders.base import (
    BackendOption,
    Prepared,
    RequestTimeout,
    SendResult,
    UploadError,
    public_url,
    scrub,
    secrets_of_url,
    within,
)
from rlreplay.uploaders.otlp_proto import encode_trajectory, otel_trace_id

ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
ENV_TRACES_HEADERS = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
TRACES_PATH = "/v1/traces"
MAX_REQUEST_BYTES = 4 << 20  # uncompressed, per request: the common collector default
DEFAULT_PROJECT = "default"
MAX_TEXT = 100_000  # characters of one input/output value

SPAN_KINDS = {
    KIND_TRAJECTORY: "CHAIN",
    KIND_AGENT: "AGENT",
    KIND_LLM: "LLM",
    KIND_TOOL: "TOOL",
}
_RETRYABLE = {408, 425, 429, 502, 503, 504}


def parse_headers(text: str | None) -> dict[str, str]:
    """``k1=v1,k2=v2`` (values URL-encoded), as ``OTEL_EXPORTER_OTLP_HEADERS`` holds them."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out


def traces_url(endpoint: str) -> str:
    """The traces URL of a collector: a base URL (no path) gets ``/v1/traces``."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UploadError(f"--endpoint must be an http(s) URL, got {public_url(endpoint)!r}")
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def _json(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT]


def _text(value: Any) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else _json(value)


def _message_attributes(prefix: str, messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for i, message in enumerate(messages):
        base = f"{prefix}.{i}.message"
        attrs[f"{base}.role"] = str(message.get("role", ""))
        content = message.get("content")
        if content:
            attrs[f"{base}.content"] = _text(content)
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            attrs[f"{base}.tool_calls.{j}.tool_call.function.name"] = str(function.get("name", ""))
            attrs[f"{base}.tool_calls.{j}.tool_call.function.arguments"] = str(function.get("arguments", ""))
        if message.get("tool_call_id"):
            attrs[f"{base}.tool_call_id"] = str(message["tool_call_id"])
    return attrs


def _ids_len(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def _key(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def span_attributes(traj: Trajectory, messages: list[dict[str, Any]]) -> Any:
    """The OpenInference attribute function of one trajectory, for ``otlp_proto.encode_trajectory``."""
    llm_spans = sorted(traj.by_kind(KIND_LLM), key=lambda s: s.start_ns)
    assistant_at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    turn_of = {s.span_id: k for k, s in enumerate(llm_spans)}
    aligned = len(assistant_at) == len(llm_spans)
    keys = {
        "rlreplay.trajectory_id": traj.id,
        **{f"rlreplay.{name}": _key(value) for name, value in asdict(traj.key).items()},
    }
    reward = traj.reward
    with_advantage = [s for s in traj.spans if getattr(s, "advantage", None) is not None]
    advantage = max(with_advantage, key=lambda s: s.end_ns).advantage if with_advantage else None
    first_user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    last_assistant = next(
        (m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), None
    )

    def attributes(span: Span, is_root: bool) -> dict[str, Any]:
        kind = SPAN_KINDS.get(span.kind, "CHAIN")
        attrs: dict[str, Any] = {
            "openinference.span.kind": kind,
            "rlreplay.kind": span.kind,
            "rlreplay.span_id": span.span_id,
        }
        inputs, output = span.inputs, span.output
        if span.kind == KIND_LLM:
            k = turn_of[span.span_id]
            if aligned:
                before, reply = messages[: assistant_at[k]], [messages[assistant_at[k]]]
            else:
                prompt = inputs.get("prompt_text") if isinstance(inputs, dict) else None
                response = output.get("response_text") if isinstance(output, dict) else None
                before = [{"role": "user", "content": prompt}] if prompt else []
                reply = [{"role": "assistant", "content": response}] if response else []
            attrs.update(_message_attributes("llm.input_messages", before))
            attrs.update(_message_attributes("llm.output_messages", reply))
            prompt_n = _ids_len(inputs.get("prompt_ids")) if isinstance(inputs, dict) else None
            completion_n = _ids_len(output.get("token_ids")) if isinstance(output, dict) else None
            if prompt_n is not None:
                attrs["llm.token_count.prompt"] = prompt_n
            if completion_n is not None:
                attrs["llm.token_count.completion"] = completion_n
            if prompt_n is not None and completion_n is not None:
                attrs["llm.token_count.total"] = prompt_n + completion_n
            if reply and reply[0].get("content"):
                attrs["output.value"] = _text(reply[0]["content"])
                attrs["output.mime_type"] = "text/plain"
            if before:
                attrs["input.value"] = _json(before)
                attrs["input.mime_type"] = "application/json"
        elif span.kind in (KIND_AGENT, KIND_TRAJECTORY) and messages:
            if first_user is not None:
                attrs["input.value"] = _text(first_user)
                attrs["input.mime_type"] = "text/plain"
            if last_assistant is not None:
                attrs["output.value"] = _text(last_assistant)
                attrs["output.mime_type"] = "text/plain"
        if span.kind == KIND_TOOL:
            name = inputs.get("name") if isinstance(inputs, dict) else None
            attrs["tool.name"] = str(name or span.name.rsplit(".", 1)[0])
            if isinstance(inputs, dict) and isinstance(inputs.get("parameters"), dict):
                attrs["tool.parameters"] = _json(inputs["parameters"])
        if "input.value" not in attrs and inputs is not None:
            attrs["input.value"] = _json(inputs)
            attrs["input.mime_type"] = "application/json"
        if "output.value" not in attrs and output is not None:
            attrs["output.value"] = _json(output)
            attrs["output.mime_type"] = "application/json"
        if span.reward is not None:
            attrs["rlreplay.reward"] = span.reward
        if is_root:
            attrs.update({k: v for k, v in keys.items() if v is not None})
            if reward is not None:
                attrs["rlreplay.trajectory_reward"] = reward
            if advantage is not None:
                attrs["rlreplay.advantage"] = advantage
            counts = traj.counts
            attrs.update({f"rlreplay.{name}": n for name, n in counts.items()})
            metadata = {k.removeprefix("rlreplay."): v for k, v in keys.items()}
            metadata.update(reward=reward, advantage=advantage, status=traj.status, **counts)
            attrs["metadata"] = _json(metadata)
        return attrs

    return attributes


class OtlpUploader:
    """OTLP/HTTP protobuf to any collector, with OpenInference attributes (Phoenix, Langfuse, ...)."""

    backend = "otlp"
    requires = ("opentelemetry.proto",)  # modules it imports when it runs: checked before anything is read
    options = (
        BackendOption(
            "--endpoint",
            f"Collector URL (a base URL gets {TRACES_PATH}); default ${ENV_ENDPOINT}.",
            metavar="URL",
        ),
        BackendOption(
            "--header",
            f"HTTP header K=V (e.g. an auth token); also from ${ENV_HEADERS}; never written to disk.",
            metavar="K=V",
            multiple=True,
        ),
    )
    can_upsert = True

    def __init__(
        self,
        endpoint: str,
        *,
        project: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = 60.0,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self.url = traces_url(endpoint)
        self.public_url = public_url(self.url)
        self.project = project or DEFAULT_PROJECT
        self.timeout = timeout
        self.max_request_bytes = max_request_bytes
        self.decoder: Any = None  # set by the pipeline: decodes messages for llm.*_messages
        self._headers = dict(headers or {})
        self._secrets = [*secrets_of_url(self.url), *(v for v in self._headers.values() if len(v) >= 6)]
        self._answered = False

    def __repr__(self) -> str:  # never shows the headers
        return f"OtlpUploader({self.public_url!r}, project={self.project!r})"

    @classmethod
    def from_options(cls, options: Any) -> OtlpUploader:
        values = options.values
        endpoint = (
            values.get("endpoint") or os.environ.get(ENV_TRACES_ENDPOINT) or os.environ.get(ENV_ENDPOINT)
        )
        if not endpoint:
            raise UploadError(f"the otlp backend needs --endpoint URL (or ${ENV_ENDPOINT})")
        headers = {
            **parse_headers(os.environ.get(ENV_HEADERS)),
            **parse_headers(os.environ.get(ENV_TRACES_HEADERS)),
        }
        for item in values.get("header") or []:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UploadError("--header takes K=V")
            headers[key.strip()] = value.strip()
        project = (
            options.project or options.experiment or (Path(options.run_dir).name if options.run_dir else None)
        )
        return cls(endpoint, project=project, headers=headers, timeout=options.timeout)

    def target(self) -> str:
        return f"otlp:{self.public_url}#{self.project}"

    def describe(self) -> str:
        return f"OTLP {self.public_url}, project {self.project!r}"

    def trace_id(self, trajectory_id: str) -> str:
        return otel_trace_id(trajectory_id, self.project)

    # -- prepare (no network) --

    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        resource = {"openinference.project.name": self.project, "service.name": "rlreplay"}
        out = []
        for traj in trajectories:
            hex_id = self.trace_id(traj.id)
            attributes = span_attributes(traj, chat.messages(traj, self.decoder))
            body = encode_trajectory(traj, hex_id, attributes, resource, span_namespace=self.project)
            out.append(Prepared(traj.id, hex_id, body, len(body)))
        return out

    # -- send --

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        results: list[SendResult] = []
        part: list[Prepared] = []
        size = 0
        for item in batch:
            if part and size + item.nbytes > self.max_request_bytes:
                results += self._send_part(part)
                part, size = [], 0
            part.append(item)
            size += item.nbytes
        if part:
            results += self._send_part(part)
        return results

    def _send_part(self, part: list[Prepared]) -> list[SendResult]:
        body = gzip.compress(b"".join(p.body for p in part), compresslevel=5)
        try:
            within(self.timeout, f"the OTLP collector at {self.public_url}", self._post, body)
        except _Failed as exc:
            return [
                SendResult(p.trajectory_id, p.backend_id, False, 0, str(exc), exc.retryable) for p in part
            ]
        return [SendResult(p.trajectory_id, p.backend_id, True, p.nbytes) for p in part]

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(self.url, data=body, method="POST")
        request.add_header("Content-Type", "application/x-protobuf")
        request.add_header("Content-Encoding", "gzip")
        for key, value in self._headers.items():
            request.add_header(key, value)
        timeout = self.timeout or 60.0
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            self._answered = True
            reason = self._line(exc.read()[:300].decode(errors="replace") or exc.reason)
            if exc.code in (401, 403):
                raise UploadError(
                    f"the OTLP collector at {self.public_url} refused the request ({exc.code} {reason}); "
                    "check --header / $OTEL_EXPORTER_OTLP_HEADERS"
                ) from None
            if exc.code == 404:
                raise UploadError(
                    f"the OTLP collector at {self.public_url} answered 404: not an OTLP/HTTP traces endpoint"
                ) from None
            raise _Failed(
                f"collector answered {exc.code} {reason}", exc.code in _RETRYABLE or exc.code >= 500
            ) from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise RequestTimeout(
                    f"no answer from the OTLP collector at {self.public_url} within {timeout:g}s"
                ) from None
            message = f"cannot reach the OTLP collector at {self.public_url} ({self._line(str(reason))})"
            if not self._answered:
                raise UploadError(message) from None
            raise _Failed(message, True) from None
        self._answered = True
        self._check_partial(answer)

    def _check_partial(self, answer: bytes) -> None:
        """A collector may accept a request and still reject some spans (``partial_success``)."""
        if not answer:
            return
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        response = ExportTraceServiceResponse()
        try:
            response.ParseFromString(answer)
        except DecodeError:
            return  # not protobuf (some collectors answer JSON or nothing): accepted
        rejected = response.partial_success.rejected_spans
        if rejected:
            message = response.partial_success.error_message or "no reason given"
            raise _Failed(f"collector rejected {rejected} spans: {self._line(message)}", False)

    def existing(self, trajectory_ids: Sequence[str]) -> set[str] | None:
        """An OTLP collector cannot be asked what it has."""
        return None

    def _line(self, text: str) -> str:
        return scrub(" ".join(str(text).split())[:300], self._secrets)

    def close(self) -> None:
        pass


class _Failed(Exception):
    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
