"""Upload trajectories to Weave as traces, through weave's own HTTP client.

Each trajectory becomes one trace: a root call (the trajectory) whose children are the
recorded spans, linked by ``parent_id``, with the recorded start and end times (µs), the
inputs and outputs (with decoded text when the pipeline added it), exceptions in weave's
own JSON form, and verl's attributes (``step``, ``sample_index``, ``rollout_n``,
``validate``, ``experiment_name``) at the top level so Weave's filters work as they do
for verl's built-in backend.

Call ids are derived from the recorded ids (UUIDv5), so a re-sent trajectory replaces
itself rather than adding a new trace. Requests go to ``POST /v2/{entity}/{project}/
calls/complete`` with ``RemoteHTTPTraceServer.calls_complete``; weave's client retries
429/5xx itself, this module keeps each request under the size limit, splits on 413 and
shortens a call the server still finds too large.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

from rlreplay.format.schema import STATUS_ERROR
from rlreplay.model import KEY_ATTRIBUTES, Span, Trajectory
from rlreplay.uploaders.base import Prepared, RequestTimeout, SendResult, UploadError, within

#: weave's own request limit ("32 MiB real limit - 1 MiB buffer", weave http_utils).
MAX_REQUEST_BYTES = 31 * 1024 * 1024
#: The hosted server replaces fields of a call larger than about 3.5 MiB; stay under it.
MAX_CALL_BYTES = 3 * 1024 * 1024 + 448 * 1024
#: Below this a call that the server still refuses is given up.
MIN_CALL_BYTES = 16 * 1024
PREVIEW_CHARS = 1000
MAX_OP_NAME = 128  # weave.trace.constants.MAX_OP_NAME_LENGTH
ROOT_OP_NAME = "rlreplay.trajectory"

#: Fixed namespace of rlreplay's Weave call ids; changing it would duplicate every upload.
ID_NAMESPACE = uuid.UUID("6f0c1f1e-58a3-5d3c-9b7e-2f7a4c1d0e55")

#: verl's trace attributes (verl/utils/rollout_trace.py, rollout_trace_attr).
VERL_ATTRIBUTES = KEY_ATTRIBUTES
#: Span kinds that are also weave op kinds (weave.trace.op_protocol.OpKind).
WEAVE_KINDS = ("agent", "llm", "tool")

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+)(?:, in (?P<func>.*))?$')
_CARETS = re.compile(r"^\s*[\^~]+\s*$")
_RETRYABLE = {408, 409, 425, 429}
_OPTIONAL = ("parent_id", "display_name", "output", "exception")


# -- ids, times, exceptions ----------------------------------------------------------------------


def root_call_id(trajectory_id: str) -> str:
    """The Weave id of a trajectory's root call (also its trace id)."""
    return str(uuid.uuid5(ID_NAMESPACE, trajectory_id))


def span_call_id(trajectory_id: str, span_id: str) -> str:
    return str(uuid.uuid5(ID_NAMESPACE, f"{trajectory_id}/{span_id}"))


def iso_us(ns: int) -> str:
    """Nanoseconds since the epoch as an ISO timestamp in UTC with microseconds."""
    return (_EPOCH + datetime.timedelta(microseconds=ns // 1000)).isoformat(timespec="microseconds")


def parse_traceback(text: str) -> list[dict[str, Any]]:
    """Frames of the last exception in a formatted traceback, as weave's exception_to_dict lists them."""
    frames: list[dict[str, Any]] = []
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            frames = []  # a chained exception: keep the frames of the one raised last
            continue
        m = _FRAME.match(line)
        if m:
            frames.append(
                {
                    "filename": m["file"],
                    "line_number": int(m["line"]),
                    "function_name": m["func"] or "<module>",
                    "text": None,
                }
            )
        elif frames and frames[-1]["text"] is None and line.startswith("    ") and not _CARETS.match(line):
            frames[-1]["text"] = line.strip()
    return frames


def exception_json(span: Span) -> str | None:
    """weave's exception string, ``{"type", "message", "traceback": [frames]}``, for a failed span."""
    if span.status != STATUS_ERROR:
        return None
    out = span.output
    if isinstance(out, dict) and out.get("__type__") == "exception":
        exc: dict[str, Any] = {
            "type": str(out.get("type") or "Exception"),
            "message": str(out.get("message")),
        }
        tb = out.get("traceback")
        if isinstance(tb, str) and tb:
            exc["traceback"] = parse_traceback(tb)
    else:
        kind, sep, message = (span.error or "Exception").partition(": ")
        exc = {"type": kind if sep else "Exception", "message": message if sep else kind}
    return orjson.dumps(exc).decode()


# -- shortening calls over the per-call limit --------------------------------------------------------


def _size(value: Any) -> int:
    return len(orjson.dumps(value))


def truncated_marker(value: Any, nbytes: int) -> dict[str, Any]:
    """The visible stand-in for a value too large to send (rlreplay's ``truncated`` convention)."""
    if isinstance(value, str):
        preview = value[:PREVIEW_CHARS]
    else:
        preview = orjson.dumps(value)[:PREVIEW_CHARS].decode(errors="ignore")
    return {"__type__": "truncated", "bytes": nbytes, "preview": preview}


_MARKER_BYTES = _size(truncated_marker("x" * PREVIEW_CHARS, 10**9)) + 16


def _children(value: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(value, dict):
        yield from value.items()
    elif isinstance(value, list):
        yield from enumerate(value)


def shorten_call(call: dict[str, Any], limit: int) -> int:
    """Replace the largest parts of ``call`` (in place) with markers until its JSON fits ``limit``.

    Descends into the largest field while a part of it alone can bring the call under the
    limit, so the marker replaces as little as possible. Returns the final size.
    """
    size = _size(call)
    while size > limit:
        excess = size - limit
        fields = [(k, _size(call[k])) for k in ("inputs", "output", "attributes") if call.get(k) is not None]
        fields = [(k, s) for k, s in fields if s > _MARKER_BYTES]
        if not fields:
            break
        key, field_size = max(fields, key=lambda f: f[1])
        parent: Any = call
        node = call[key]
        while True:
            parts = [(k, v, _size(v)) for k, v in _children(node)]
            biggest = max(parts, key=lambda p: p[2], default=None)
            if biggest is None or biggest[2] < excess + _MARKER_BYTES:
                break
            parent, key, node, field_size = node, biggest[0], biggest[1], biggest[2]
        parent[key] = truncated_marker(node, field_size)
        size = _size(call)
    return size


# -- building the calls of one trajectory -------------------------------------------------------------


def display_name(traj: Trajectory) -> str:
    """``step 5 · sample 12 · rollout 3 (validate)``: which trajectory a trace is."""
    parts = [
        f"{label} {value}"
        for label, value in (("step", traj.step), ("sample", traj.sample_index), ("rollout", traj.rollout_n))
        if value is not None
    ]
    name = " · ".join(parts) or f"trajectory {traj.id[:12]}"
    return f"{name} (validate)" if traj.validate else name


def _attributes(
    traj_attrs: dict[str, Any], tags: dict[str, Any], tid: str, span: Span, is_root: bool
) -> dict[str, Any]:
    """verl's tags on every call (as weave.attributes puts them); rlreplay's ids to find the span again."""
    own: dict[str, Any] = {"span_id": span.span_id, "kind": span.kind}
    if is_root:
        return {**traj_attrs, "rlreplay": {"trajectory_id": tid, **own}}
    attrs = {**tags, "rlreplay": own}
    if span.kind in WEAVE_KINDS:
        attrs["weave"] = {"kind": span.kind}  # what @weave.op(kind=...) records: the UI's call icons
    return attrs


def _as_inputs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def trajectory_calls(traj: Trajectory, project_id: str) -> list[dict[str, Any]]:
    """The Weave calls of one trajectory, root first, each a ``calls/complete`` batch item."""
    tid = traj.id
    root_id = root_call_id(tid)
    traj_attrs = traj.attributes
    tags = {key: traj_attrs.get(key) for key in VERL_ATTRIBUTES}
    roots = traj.roots
    single_root = roots[0] if len(roots) == 1 else None
    spans = traj.spans
    if single_root is not None:  # the root call goes first
        spans = [single_root, *(s for s in spans if s is not single_root)]
    call_ids = {s.span_id: span_call_id(tid, s.span_id) for s in spans}
    if single_root is not None:
        call_ids[single_root.span_id] = root_id

    calls: list[dict[str, Any]] = []
    if single_root is None:  # several roots (or orphans): one synthetic trajectory call above them
        calls.append(
            {
                "project_id": project_id,
                "id": root_id,
                "trace_id": root_id,
                "parent_id": None,
                "op_name": ROOT_OP_NAME,
                "display_name": display_name(traj),
                "started_at": iso_us(traj.start_ns),
                "ended_at": iso_us(traj.end_ns),
                "attributes": {**traj_attrs, "rlreplay": {"trajectory_id": tid}},
                "inputs": {},
                "output": None,
                "exception": None,
                "summary": {},
            }
        )
    for span in spans:
        is_root = span is single_root
        error = exception_json(span)
        calls.append(
            {
                "project_id": project_id,
                "id": call_ids[span.span_id],
                "trace_id": root_id,
                "parent_id": None if is_root else call_ids.get(span.parent_id or "", root_id),
                "op_name": span.name[:MAX_OP_NAME] or span.kind,
                "display_name": display_name(traj) if is_root else None,
                "started_at": iso_us(span.start_ns),
                "ended_at": iso_us(span.end_ns),
                "attributes": _attributes(traj_attrs, tags, tid, span, is_root),
                "inputs": _as_inputs(span.inputs),
                "output": None if error is not None else span.output,
                "exception": error,
                "summary": {},
            }
        )
    index = {call["id"]: i for i, call in enumerate(calls)}
    _roll_up_status(calls, [index.get(call["parent_id"]) if call["parent_id"] else None for call in calls])
    reward = traj.reward
    if reward is not None:
        calls[0]["summary"]["reward"] = reward
    for call in calls:  # optional fields: absent reads back as null, and costs no bytes
        for key in _OPTIONAL:
            if call[key] is None:
                del call[key]
    return calls


def _roll_up_status(calls: list[dict[str, Any]], parents: list[int | None]) -> None:
    """status_counts as weave's client computes them: each call counts itself and its descendants."""
    counts = [[0, 0] for _ in calls]
    for i, call in enumerate(calls):
        bucket = 1 if call.get("exception") else 0
        j: int | None = i
        while j is not None:
            counts[j][bucket] += 1
            j = parents[j]
    for call, (ok, failed) in zip(calls, counts):
        call["summary"]["status_counts"] = {"success": ok, "error": failed}


# -- the uploader -----------------------------------------------------------------------------------


def trace_server_url() -> str:
    """Where weave sends traces: ``WF_TRACE_SERVER_URL``, else derived from ``WANDB_BASE_URL``."""
    from weave.trace.env import weave_trace_server_url

    return weave_trace_server_url().rstrip("/")


def api_key_from_env() -> str | None:
    """The W&B API key as weave finds it: ``WANDB_API_KEY``, else ``~/.netrc`` for the W&B host."""
    import netrc

    from weave.trace.env import weave_wandb_api_key

    try:
        return weave_wandb_api_key()
    except (netrc.NetrcParseError, OSError):
        # the parser's message may quote the file's content: do not repeat it
        raise UploadError("could not read the W&B API key from ~/.netrc (malformed file)") from None


class _Failed(Exception):
    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class WeaveUploader:
    """Weave traces in one project (--project ENTITY/PROJECT; WANDB_API_KEY)."""

    backend = "weave"
    requires = ("weave",)  # modules it imports when it runs: checked before anything is read
    options = ()
    can_upsert = True

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        api_key: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_call_bytes: int = MAX_CALL_BYTES,
        timeout: float | None = 60.0,
    ) -> None:
        entity, sep, name = (project or "").strip().strip("/").partition("/")
        if not sep or not entity or not name or "/" in name:
            got = f", got {project!r}" if project else ""
            raise UploadError(f"Weave needs --project ENTITY/PROJECT (e.g. my-team/verl-rollouts){got}")
        self.project_id = f"{entity}/{name}"
        self.url = (url or trace_server_url()).rstrip("/")
        self.max_request_bytes = max_request_bytes
        self.max_call_bytes = max_call_bytes
        self._api_key = api_key
        self._server: Any = None
        self._down: _Failed | None = None
        self.timeout = timeout

    @classmethod
    def from_options(cls, options: Any) -> WeaveUploader:
        """From ``pipeline.BackendOptions``: ``--project ENTITY/PROJECT``, the request deadline."""
        return cls(options.project, timeout=options.timeout)

    def __repr__(self) -> str:  # never shows the key
        return f"WeaveUploader({self.project_id!r}, url={self.url!r})"

    def target(self) -> str:
        return f"weave:{self.url}#{self.project_id}"

    def describe(self) -> str:
        return f"Weave {self.url}, project {self.project_id}"

    # -- prepare (no network) --

    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        prepared = []
        for traj in trajectories:
            calls = trajectory_calls(traj, self.project_id)
            nbytes = 0
            for i, call in enumerate(calls):
                size = _size(call)
                if size > self.max_call_bytes:
                    call = orjson.loads(orjson.dumps(call))  # shorten a copy, not the trajectory's data
                    calls[i] = call
                    size = shorten_call(call, self.max_call_bytes)
                nbytes += size + 1  # and the comma between batch items
            prepared.append(Prepared(traj.id, calls[0]["id"], calls, nbytes))
        return prepared

    # -- send --

    def _client(self) -> Any:
        if self._server is None:
            key = self._api_key or api_key_from_env()
            if not key:
                raise UploadError(
                    "no W&B API key: set WANDB_API_KEY or run `wandb login` (it writes ~/.netrc)"
                )
            from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

            self._api_key = key
            self._probe()
            self._server = RemoteHTTPTraceServer(self.url, should_batch=False, password=key)
        return self._server

    def _probe(self) -> None:
        """One GET of ``/server_info`` without retries: a down server is one clear line, at once."""
        import httpx

        timeout = self.timeout or 60.0
        try:
            within(timeout, f"Weave at {self.url}", httpx.get, f"{self.url}/server_info", timeout=timeout)
        except httpx.TimeoutException:
            raise RequestTimeout(f"no answer from Weave at {self.url} within {timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise UploadError(f"cannot reach Weave at {self.url} ({self._scrub(str(exc))})") from None

    def existing(self, trajectory_ids: Sequence[str]) -> set[str] | None:
        """Those of ``trajectory_ids`` whose root call the project holds."""
        server = self._client()
        by_call = {root_call_id(tid): tid for tid in trajectory_ids}
        calls = within(
            self.timeout,
            f"Weave at {self.url}",
            lambda: list(
                server.calls_query_stream(
                    {"project_id": self.project_id, "filter": {"call_ids": list(by_call)}}
                )
            ),
        )
        return {by_call[c.id] for c in calls if c.id in by_call}

    def _requests(self, batch: Sequence[Prepared]) -> Iterator[list[tuple[int, Any, int]]]:
        """(trajectory index, call, size) in requests under the byte limit.

        A trajectory goes whole into one request when it fits in one, so that a failed
        request never leaves part of a trajectory stored.
        """
        empty = len(b'{"batch":[]}')
        chunk: list[tuple[int, Any, int]] = []
        total = empty
        for i, p in enumerate(batch):
            items = [(i, call, _size(call)) for call in p.body]
            whole = sum(size + 1 for _, _, size in items)
            if chunk and total + whole > self.max_request_bytes and empty + whole <= self.max_request_bytes:
                yield chunk
                chunk, total = [], empty
            for item in items:
                if chunk and total + item[2] + 1 > self.max_request_bytes:
                    yield chunk
                    chunk, total = [], empty
                chunk.append(item)
                total += item[2] + 1
        if chunk:
            yield chunk

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        server = self._client()
        failed: dict[int, _Failed] = {}
        self._down = None
        for request in self._requests(batch):
            todo = [item for item in request if item[0] not in failed]
            if self._down is not None:  # unreachable, or still failing after weave's retries
                failed.update((i, self._down) for i, _, _ in todo)
            elif todo:
                self._post(server, todo, failed)
        return [
            SendResult(
                p.trajectory_id,
                p.backend_id,
                ok=i not in failed,
                nbytes=0 if i in failed else p.nbytes,
                error=str(failed[i]) if i in failed else None,
                retryable=failed[i].retryable if i in failed else False,
            )
            for i, p in enumerate(batch)
        ]

    def _post(self, server: Any, items: list[tuple[int, Any, int]], failed: dict[int, _Failed]) -> None:
        """One calls/complete request; failures land in ``failed`` by trajectory index."""
        from weave.vendor.weave_server_sdk import APIConnectionError, APIStatusError

        try:
            within(
                self.timeout,
                f"Weave at {self.url}",
                server.calls_complete,
                {"batch": [call for _, call, _ in items]},
            )
            return
        except APIStatusError as exc:
            status = exc.status_code
            reason = self._reason(exc)
        except (APIConnectionError, OSError) as exc:
            self._down = _Failed(f"cannot reach Weave at {self.url}: {self._scrub(str(exc))}", retryable=True)
            failed.update((i, self._down) for i, _, _ in items)
            return
        if status in (401, 403):
            raise UploadError(
                f"Weave refused the API key for {self.project_id} at {self.url} ({status} {reason}); "
                "check WANDB_API_KEY or ~/.netrc"
            )
        if status == 404:
            raise UploadError(
                f"Weave answered 404 for project {self.project_id} at {self.url}: "
                "unknown entity/project, or not a Weave trace server"
            )
        trajectories = {i for i, _, _ in items}
        if status == 413 or (status in (400, 422) and len(trajectories) > 1):
            self._split(server, items, failed, status)
            return
        retryable = status >= 500 or status in _RETRYABLE
        error = _Failed(f"Weave answered {status} {reason}".rstrip(), retryable)
        if retryable:
            self._down = error
        failed.update((i, error) for i in trajectories)

    def _split(
        self, server: Any, items: list[tuple[int, Any, int]], failed: dict[int, _Failed], status: int
    ) -> None:
        """413: halve the request, or shorten a lone call; 400/422: isolate the trajectory at fault."""
        if len(items) > 1:
            if status == 413:  # the server's limit is below ours: remember it for later requests
                self.max_request_bytes = min(self.max_request_bytes, sum(s + 1 for _, _, s in items) - 1)
            groups = sorted({i for i, _, _ in items})
            if status != 413 or len(groups) > 1:
                half = set(groups[: max(1, len(groups) // 2)])
                halves = [[it for it in items if it[0] in half], [it for it in items if it[0] not in half]]
            else:
                mid = len(items) // 2
                halves = [items[:mid], items[mid:]]
            for part in halves:
                todo = [it for it in part if it[0] not in failed]
                if self._down is not None:
                    failed.update((i, self._down) for i, _, _ in todo)
                elif todo:
                    self._post(server, todo, failed)
            return
        i, call, size = items[0]
        limit = min(size, self.max_call_bytes) // 2
        if limit < MIN_CALL_BYTES:
            failed[i] = _Failed(f"Weave refused a call of {size} bytes as too large (413)", retryable=False)
            return
        smaller = orjson.loads(orjson.dumps(call))
        new_size = shorten_call(smaller, limit)
        if new_size >= size:
            failed[i] = _Failed(f"Weave refused a call of {size} bytes as too large (413)", retryable=False)
            return
        self.max_call_bytes = min(self.max_call_bytes, limit)
        self._post(server, [(i, smaller, new_size)], failed)

    def _reason(self, exc: Any) -> str:
        try:
            body = exc.response.json()
        except Exception:
            body = None
        if isinstance(body, dict):
            reason = body.get("reason") or body.get("detail") or body.get("message") or ""
        else:
            reason = getattr(exc.response, "reason_phrase", "") or ""
        text = reason if isinstance(reason, str) else orjson.dumps(reason).decode()
        return self._scrub(" ".join(text.split()))[:300]

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def close(self) -> None:
        server, self._server = self._server, None
        client = getattr(server, "_stainless_client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
