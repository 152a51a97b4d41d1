"""A loopback stand-in for Weave's hosted trace server, for offline tests.

weave 0.54 ships no trace server, so tests drive weave's real HTTP client
(`RemoteHTTPTraceServer`) against this one. Every request body is validated with
the request types the installed weave ships (`weave.vendor.weave_server_sdk.types`,
checked through pydantic's `TypeAdapter`, as weave's own client does in
`weave.trace.call_request_validation`), plus the few checks the hosted server adds:

- 422 `{"detail": [...]}` (FastAPI's shape) when a body fails the request type, or a
  timestamp does not parse, or a `summary.status_counts` key is not a trace status;
- 400 `{"reason": ...}` for the server's field rules (weave 0.53 `weave/shared/validation.py`):
  ids must be lowercase UUIDs (or 16/32-hex OTel ids), `op_name` a valid op ref or at
  most 128 characters, `display_name` at most 1024 characters; and, a rule of this
  fixture only, every call in a v2 request must belong to the project in its path;
- 401 without `Authorization: Basic base64("api:<key>")`, 404 for unknown routes,
  413 over `max_request_bytes`.

Accepted calls are kept in memory and read back with `calls/stream_query` (JSON lines).
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python
from typing_extensions import TypedDict
from weave.trace.constants import MAX_DISPLAY_NAME_LENGTH, MAX_OP_NAME_LENGTH, TraceStatus
from weave.trace.refs import OpRef, Ref
from weave.trace_server_bindings.http_utils import REMOTE_REQUEST_BYTES_LIMIT
from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer
from weave.utils.ids import generate_id
from weave.vendor.weave_server_sdk.types import (
    CallEndParams,
    CallReadParams,
    CallStartParams,
    CallStreamQueryParams,
    call_upsert_batch_params,
    v2_call_complete_params,
)
from weave.vendor.weave_server_sdk.types.call_read_response import Call

JSON = dict[str, Any]
CallKey = tuple[str, str]  # (project_id, call id)

# What the server fills in as the writer; the hosted one uses the key's user id.
LOOPBACK_USER_ID = "VXNlcjox"


class _CompleteBody(TypedDict):
    batch: list[v2_call_complete_params.Batch]


class _UpsertBatchBody(TypedDict):
    batch: list[call_upsert_batch_params.Batch]


_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    "complete": TypeAdapter(_CompleteBody),
    "upsert_batch": TypeAdapter(_UpsertBatchBody),
    "start": TypeAdapter(CallStartParams),
    "end": TypeAdapter(CallEndParams),
    "read": TypeAdapter(CallReadParams),
    "stream_query": TypeAdapter(CallStreamQueryParams),
}
_DATETIME = TypeAdapter(datetime.datetime)
_STATUSES = {s.value for s in TraceStatus}
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")

# (method, route pattern, handler name); v2 routes carry the project in the path.
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/health"), "_health"),
    ("GET", re.compile(r"/server_info"), "_server_info"),
    ("POST", re.compile(r"/v2/(?P<entity>[^/]+)/(?P<project>[^/]+)/calls/complete"), "_calls_complete"),
    ("POST", re.compile(r"/v2/(?P<entity>[^/]+)/(?P<project>[^/]+)/call/start"), "_call_start"),
    ("POST", re.compile(r"/v2/(?P<entity>[^/]+)/(?P<project>[^/]+)/call/end"), "_call_end"),
    ("POST", re.compile(r"/call/start"), "_call_start"),
    ("POST", re.compile(r"/call/end"), "_call_end"),
    ("POST", re.compile(r"/call/upsert_batch"), "_upsert_batch"),
    ("POST", re.compile(r"/call/read"), "_call_read"),
    ("POST", re.compile(r"/calls/stream_query"), "_stream_query"),
]
_PUBLIC = {"_health", "_server_info"}


class HTTPError(Exception):
    """An error answer: status and JSON body."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


@dataclass
class LoggedRequest:
    method: str
    path: str
    status: int
    bytes_received: int
    headers: dict[str, str]
    body: Any = None  # parsed JSON, when the body was JSON


@dataclass
class _Fault:
    status: int
    store: bool
    retry_after_s: float | None


@dataclass
class _Answer:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def _json_answer(status: int, body: Any) -> _Answer:
    return _Answer(status, json.dumps(body).encode())


def _validation_error(e: ValidationError, prefix: tuple[Any, ...] = ()) -> HTTPError:
    errors = json.loads(e.json(include_url=False))
    for err in errors:
        err["loc"] = ["body", *prefix, *err["loc"]]
    return HTTPError(422, {"detail": errors})


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError as e:
        err = {"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {e}"}
        raise HTTPError(422, {"detail": [err]}) from None


def _validate(kind: str, body: Any) -> Any:
    """Validate with weave's own request type; lazy iterables are drained too."""
    try:
        return _materialize(_ADAPTERS[kind].validate_python(body))
    except ValidationError as e:
        raise _validation_error(e) from None


def _materialize(value: Any, loc: tuple[Any, ...] = ()) -> Any:
    if isinstance(value, dict):
        return {k: _materialize(v, (*loc, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_materialize(v, (*loc, i)) for i, v in enumerate(value)]
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, Iterable):  # pydantic's lazy ValidatorIterator
        try:
            return [_materialize(v, (*loc, i)) for i, v in enumerate(value)]
        except ValidationError as e:  # its locations start at the item index
            raise _validation_error(e, loc) from None
    return value


def _parse_time(value: Any, loc: tuple[Any, ...]) -> datetime.datetime:
    try:
        dt = _DATETIME.validate_python(value)
    except ValidationError as e:
        raise _validation_error(e, loc) from None
    if dt.tzinfo is None:
        return dt.replace(tzinfo=datetime.timezone.utc)
    return dt.astimezone(datetime.timezone.utc)


def _check_summary(summary: Any, loc: tuple[Any, ...]) -> None:
    counts = summary.get("status_counts") if isinstance(summary, dict) else None
    for key in counts or {}:
        if key not in _STATUSES:
            err = {
                "type": "enum",
                "loc": ["body", *loc, "status_counts", key],
                "msg": f"Input should be one of {sorted(_STATUSES)}",
                "input": key,
            }
            raise HTTPError(422, {"detail": [err]})


def _require_id(value: str | None, what: str, hex_re: re.Pattern[str]) -> None:
    if value is None or hex_re.fullmatch(value):
        return
    try:
        ok = str(uuid.UUID(value)) == value
    except ValueError:
        ok = False
    if not ok:
        raise HTTPError(400, {"reason": f"Invalid {what}: {value}. Must be a lowercase UUID"})


def _check_project(project_id: str, path_project: str | None) -> None:
    entity, _, project = project_id.partition("/")
    if not entity or not project or "/" in project:
        raise HTTPError(400, {"reason": f"Invalid project_id: {project_id!r}, expected 'entity/project'"})
    if path_project is not None and project_id != path_project:
        raise HTTPError(
            400, {"reason": f"project_id {project_id!r} does not match the path {path_project!r}"}
        )


def _check_call_fields(call: JSON, path_project: str | None) -> None:
    """The hosted server's field rules (weave 0.53 weave/shared/validation.py)."""
    _check_project(call["project_id"], path_project)
    _require_id(call.get("id"), "call id", _HEX16)
    _require_id(call.get("parent_id"), "parent id", _HEX16)
    _require_id(call.get("trace_id"), "trace id", _HEX32)
    op_name = call.get("op_name")
    if op_name is not None:
        if op_name.startswith(("weave:///", "weave-trace-internal:///")):
            try:
                ref = Ref.parse_uri(op_name)
            except (ValueError, TypeError, IndexError):
                ref = None
            if not isinstance(ref, OpRef) or ref.uri != op_name:
                raise HTTPError(400, {"reason": f"Invalid ref: {op_name}. Must be a round-tripping op ref"})
        elif len(op_name) > MAX_OP_NAME_LENGTH:
            raise HTTPError(
                400, {"reason": f"String too long: {op_name}. Max length is {MAX_OP_NAME_LENGTH}"}
            )
    display_name = call.get("display_name")
    if display_name is not None and len(display_name) > MAX_DISPLAY_NAME_LENGTH:
        raise HTTPError(400, {"reason": f"String too long. Max length is {MAX_DISPLAY_NAME_LENGTH}"})


# fmt: off
_START_FIELDS = ("project_id", "id", "trace_id", "parent_id", "thread_id", "turn_id", "op_name",
                 "display_name", "started_at", "attributes", "inputs", "wb_run_id", "wb_run_step")
_END_FIELDS = ("ended_at", "exception", "output", "summary", "wb_run_step_end")
_ROW_FIELDS = ("id", "project_id", "op_name", "display_name", "trace_id", "parent_id", "thread_id",
               "turn_id", "started_at", "ended_at", "attributes", "inputs", "output", "exception",
               "summary", "wb_user_id", "wb_run_id", "wb_run_step", "wb_run_step_end", "deleted_at")
# fmt: on


def _derived_summary(row: JSON) -> JSON:
    """summary as the hosted server returns it: the stored one plus `weave` fields."""
    summary = json.loads(json.dumps(row.get("summary") or {}))
    weave: JSON = {
        k: v
        for k, v in (summary.pop("weave", None) or {}).items()
        if k not in ("status", "trace_name", "latency_ms", "display_name")
    }
    started, ended = row.get("started_at"), row.get("ended_at")
    if row.get("exception"):
        weave["status"] = TraceStatus.ERROR.value
    elif ended is None:
        weave["status"] = TraceStatus.RUNNING.value
    elif (summary.get("status_counts") or {}).get(TraceStatus.ERROR.value, 0) > 0:
        weave["status"] = TraceStatus.DESCENDANT_ERROR.value
    else:
        weave["status"] = TraceStatus.SUCCESS.value
    if started is not None and ended is not None:
        weave["latency_ms"] = (ended - started) // datetime.timedelta(milliseconds=1)
    op_name = row.get("op_name") or ""
    if row.get("display_name"):
        weave["display_name"] = row["display_name"]
    elif op_name.startswith("weave:///"):
        weave["trace_name"] = Ref.parse_uri(op_name).name  # type: ignore[attr-defined]
    else:
        weave["trace_name"] = op_name
    summary["weave"] = weave
    return summary


class WeaveLoopback:
    """Threaded HTTP server on 127.0.0.1 speaking Weave's trace-server wire protocol.

    `calls` holds the latest row per (project_id, id); `duplicates` counts every extra
    write of a call already stored (a re-sent complete call, a second start or end).
    """

    def __init__(
        self, api_key: str = "loopback-key", *, max_request_bytes: int = REMOTE_REQUEST_BYTES_LIMIT
    ) -> None:
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.calls: dict[CallKey, JSON] = {}
        self.duplicates: Counter[CallKey] = Counter()
        self.request_log: list[LoggedRequest] = []
        self._faults: dict[str, deque[_Fault]] = {}
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> WeaveLoopback:
        handler = type("_BoundHandler", (_Handler,), {"loopback": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> WeaveLoopback:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- test helpers ------------------------------------------------------------

    def client(self, api_key: str | None = None) -> RemoteHTTPTraceServer:
        """weave's real HTTP client, unbatched, pointed here (no weave.init, no network)."""
        return RemoteHTTPTraceServer(self.url, should_batch=False, password=api_key or self.api_key)

    def inject(
        self,
        endpoint_suffix: str,
        statuses: Iterable[int],
        *,
        store: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        """Answer the next requests whose path ends with `endpoint_suffix` with `statuses`.

        With `store=True` the request is still processed (and stored) before the error
        answer goes out: a write the server kept although the client saw a failure.
        `retry_after_s` sets a Retry-After header, which weave's client obeys (0 < s <= 60).
        """
        with self._lock:
            queue = self._faults.setdefault(endpoint_suffix, deque())
            queue.extend(_Fault(s, store, retry_after_s) for s in statuses)

    @property
    def bytes_received(self) -> int:
        with self._lock:
            return sum(r.bytes_received for r in self.request_log)

    def requests_to(self, endpoint_suffix: str) -> list[LoggedRequest]:
        with self._lock:
            return [r for r in self.request_log if r.path.endswith(endpoint_suffix)]

    def stored(self, project_id: str | None = None) -> list[JSON]:
        """Stored rows as `calls/stream_query` returns them, oldest first."""
        with self._lock:
            rows = [r for (p, _), r in self.calls.items() if project_id in (None, p) and _readable(r)]
            return [self._row_out(r) for r in sorted(rows, key=_sort_key("started_at"))]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.duplicates.clear()
            self.request_log.clear()
            self._faults.clear()

    # -- request handling ------------------------------------------------------------

    def _take_fault(self, path: str) -> _Fault | None:
        with self._lock:
            for suffix, queue in self._faults.items():
                if queue and path.endswith(suffix):
                    return queue.popleft()
        return None

    def _answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[_Answer, Any]:
        fault = self._take_fault(path)
        body: Any = None
        try:
            if fault is not None and not fault.store:
                raise HTTPError(fault.status, {"reason": f"injected {fault.status}"})
            if len(raw) > self.max_request_bytes:
                raise HTTPError(413, {"reason": "Request too large"})
            route = next(
                ((name, m) for meth, pat, name in _ROUTES if meth == method and (m := pat.fullmatch(path))),
                None,
            )
            if route is None:
                raise HTTPError(404, {"detail": "Not Found"})
            name, match = route
            if name not in _PUBLIC and headers.get("authorization") != self._expected_auth():
                raise HTTPError(401, {"reason": "Unauthorized: expected Basic api:<key>"})
            if method == "POST":
                body = _parse_json(raw)
            path_project = f"{match['entity']}/{match['project']}" if "entity" in match.groupdict() else None
            try:
                answer = getattr(self, name)(body, path_project)
            except HTTPError:
                raise
            except Exception as e:  # a fixture bug: say so instead of hanging the client
                raise HTTPError(500, {"reason": f"loopback error: {e!r}"}) from e
            if fault is not None:
                raise HTTPError(fault.status, {"reason": f"injected {fault.status} after storing"})
        except HTTPError as e:
            answer = _json_answer(e.status, e.body)
            if fault is not None and fault.retry_after_s is not None:
                answer.headers["Retry-After"] = str(fault.retry_after_s)
        return answer, body

    def _expected_auth(self) -> str:
        return "Basic " + base64.b64encode(f"api:{self.api_key}".encode()).decode()

    # -- routes -----------------------------------------------------------------------

    def _health(self, body: Any, path_project: str | None) -> _Answer:
        return _json_answer(200, {})

    def _server_info(self, body: Any, path_project: str | None) -> _Answer:
        return _json_answer(
            200, {"min_required_weave_python_version": "0.0.1", "trace_server_version": "loopback"}
        )

    def _calls_complete(self, body: Any, path_project: str | None) -> _Answer:
        req = _validate("complete", body)
        rows = []
        for i, call in enumerate(req["batch"]):
            loc = ("batch", i)
            _check_call_fields(call, path_project)
            _check_summary(call["summary"], (*loc, "summary"))
            row = {k: call.get(k) for k in _START_FIELDS + _END_FIELDS}
            row["started_at"] = _parse_time(call["started_at"], (*loc, "started_at"))
            row["ended_at"] = _parse_time(call["ended_at"], (*loc, "ended_at"))
            rows.append(row)
        with self._lock:  # all or nothing, as one insert
            for row in rows:
                self._store(row, replace=True)
        return _json_answer(200, {})

    def _call_start(self, body: Any, path_project: str | None) -> _Answer:
        start = _validate("start", body)["start"]
        _check_call_fields(start, path_project)
        start_at = _parse_time(start["started_at"], ("start", "started_at"))
        row = {k: start.get(k) for k in _START_FIELDS}
        row["id"] = row["id"] or generate_id()
        row["trace_id"] = row["trace_id"] or generate_id()
        row["started_at"] = start_at
        with self._lock:
            self._store(row, replace=False)
        return _json_answer(200, {"id": row["id"], "trace_id": row["trace_id"]})

    def _call_end(self, body: Any, path_project: str | None) -> _Answer:
        end = _validate("end", body)["end"]
        self._end(end, path_project, ("end",))
        return _json_answer(200, {})

    def _end(self, end: JSON, path_project: str | None, loc: tuple[Any, ...]) -> None:
        _check_call_fields(end, path_project)
        _check_summary(end["summary"], (*loc, "summary"))
        row = {k: end.get(k) for k in _END_FIELDS if k in end}
        row.update(
            project_id=end["project_id"],
            id=end["id"],
            ended_at=_parse_time(end["ended_at"], (*loc, "ended_at")),
        )
        with self._lock:
            self._store(row, replace=False)

    def _upsert_batch(self, body: Any, path_project: str | None) -> _Answer:
        req = _validate("upsert_batch", body)
        res = []
        for i, item in enumerate(req["batch"]):
            if "start" in item["req"]:
                answer = self._call_start(item["req"], None)
                res.append(json.loads(answer.body))
            else:
                self._end(item["req"]["end"], None, ("batch", i, "req", "end"))
                res.append({})
        return _json_answer(200, {"res": res})

    def _call_read(self, body: Any, path_project: str | None) -> _Answer:
        req = _validate("read", body)
        with self._lock:
            row = self.calls.get((req["project_id"], req["id"]))
            row = row if row is not None and _readable(row) else None
            return _json_answer(200, {"call": None if row is None else self._row_out(row)})

    def _stream_query(self, body: Any, path_project: str | None) -> _Answer:
        req = _validate("stream_query", body)
        if req.get("query"):
            raise HTTPError(400, {"reason": "loopback: `query` expressions are not supported; use `filter`"})
        with self._lock:
            rows = [r for (p, _), r in self.calls.items() if p == req["project_id"] and _readable(r)]
            rows = [r for r in rows if _matches(r, req.get("filter") or {})]
            for sort in reversed(req.get("sort_by") or [{"field": "started_at", "direction": "asc"}]):
                if sort["field"] not in _ROW_FIELDS:
                    raise HTTPError(400, {"reason": f"loopback: cannot sort by {sort['field']!r}"})
                rows.sort(key=_sort_key(sort["field"]), reverse=sort["direction"] == "desc")
            offset = req.get("offset") or 0
            limit = req.get("limit")
            rows = rows[offset : None if limit is None else offset + limit]
            lines = [json.dumps(self._row_out(r)) + "\n" for r in rows]
        return _Answer(200, "".join(lines).encode(), "application/jsonl")

    # -- storage ------------------------------------------------------------------

    def _store(self, row: JSON, *, replace: bool) -> None:
        """Store a complete call (`replace`) or merge a start or an end part."""
        key = (row["project_id"], row["id"])
        old = self.calls.get(key)
        if old is not None:
            part = "ended_at" if "ended_at" in row and not replace else "started_at"
            if replace or old.get(part) is not None:
                self.duplicates[key] += 1
        new = {f: None for f in _ROW_FIELDS} if replace or old is None else dict(old)
        new.update(row, wb_user_id=LOOPBACK_USER_ID)
        self.calls[key] = new

    def _row_out(self, row: JSON) -> JSON:
        out = {k: row.get(k) for k in _ROW_FIELDS}
        out["attributes"] = out["attributes"] or {}
        out["inputs"] = out["inputs"] or {}
        out["summary"] = _derived_summary(row)
        out = to_jsonable_python(out)
        Call.model_validate(out)  # what weave's client parses each line into
        return out


def _readable(row: JSON) -> bool:
    """An end part whose start has not arrived yet is not returned."""
    return row.get("started_at") is not None and row.get("op_name") is not None


def _matches(row: JSON, flt: JSON) -> bool:
    checks = {
        "call_ids": "id",
        "trace_ids": "trace_id",
        "parent_ids": "parent_id",
        "op_names": "op_name",
        "thread_ids": "thread_id",
        "turn_ids": "turn_id",
        "wb_run_ids": "wb_run_id",
    }
    for key, col in checks.items():
        wanted = flt.get(key)
        if wanted is not None and row.get(col) not in wanted:
            return False
    return not (flt.get("trace_roots_only") and row.get("parent_id") is not None)


def _sort_key(column: str) -> Callable[[JSON], tuple[bool, Any]]:
    def key(row: JSON) -> tuple[bool, Any]:
        value = row.get(column)
        return (value is None, value if value is not None else 0)

    return key


class _Handler(BaseHTTPRequestHandler):
    loopback: WeaveLoopback
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = _read_exactly(self.rfile, length)
        path = self.path.split("?", 1)[0]
        headers = {k.lower(): v for k, v in self.headers.items()}
        answer, body = self.loopback._answer(method, path, headers, raw)
        logged = {k: v for k, v in headers.items() if k.startswith(("x-weave", "x-stainless-retry"))}
        with self.loopback._lock:
            self.loopback.request_log.append(
                LoggedRequest(method, path, answer.status, len(raw), logged, body)
            )
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Content-Length", str(len(answer.body)))
        for name, value in answer.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(answer.body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def _read_exactly(stream: Any, length: int) -> bytes:
    chunks: list[bytes] = []
    while length > 0:
        chunk = stream.read(min(length, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
    return b"".join(chunks)
