"""Trackio backend: what verl's trackio rollout-trace backend logs, from the recording, into
Trackio's local store (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``).

verl 0.9.1 (``verl/utils/rollout_trace.py``, ``_log_trackio_trace``) logs, for every traced op
call, ``trackio.Trace(messages, metadata)`` under the key ``rollout_trace/<op name>`` at the
trajectory's step, in the run named after the experiment in the project. The messages are the
call's ``messages`` input, else a system line naming the op and the inputs as JSON; then the
answer (``response_text``, else ``answer``, else the output as JSON, or the exception). The
metadata holds the op, the inputs, the output or exception type, the status and the trace
attributes (``step``, ``sample_index``, ``rollout_n``, ``validate``). rlreplay logs the same,
adds ``trajectory_id``, ``span_id`` and the reward to the metadata, gives agent spans the whole
decoded conversation as their messages, and logs per-step statistics of the run as metrics
(``rollout/<split>/reward_mean``, ...).

Writes go through Trackio's storage (``SQLiteStorage.bulk_log``) with a log id per span, which
Trackio inserts once: sending again adds nothing (and replaces nothing: no upsert).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from rlreplay.format.schema import KIND_AGENT, KIND_SIGNALS, KIND_TRAJECTORY, STATUS_ERROR
from rlreplay.model import Span, Trajectory
from rlreplay.uploaders import chat
from rlreplay.uploaders.base import Prepared, SendResult, UploadError, within

#: The metric key verl gives an op's traces (``_trackio_trace_key``).
KEY_PREFIX = "rollout_trace/"
STATS_PREFIX = "rollout"


def trace_key(op_name: str) -> str:
    return KEY_PREFIX + "".join(c if c.isalnum() or c in "._-" else "_" for c in op_name)


def _json_content(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _metadata_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _metadata_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_metadata_value(v) for v in value]
    return str(value)


def _exception(span: Span) -> tuple[str, str] | None:
    if span.status != STATUS_ERROR:
        return None
    out = span.output
    if isinstance(out, dict) and out.get("__type__") == "exception":
        return str(out.get("type") or "Exception"), str(out.get("message") or "")
    kind, sep, message = (span.error or "Exception").partition(": ")
    return (kind, message) if sep else ("Exception", kind)


def span_trace(
    traj: Trajectory, span: Span, experiment: str | None, conversation: list[dict[str, Any]] | None = None
) -> tuple[list[dict], dict[str, Any]]:
    """(messages, metadata) of one span, as verl's ``_log_trackio_trace`` builds them."""
    inputs = (
        span.inputs
        if isinstance(span.inputs, dict)
        else ({} if span.inputs is None else {"value": span.inputs})
    )
    output = span.output
    attributes = {k: v for k, v in asdict(traj.key).items() if k != "experiment"}
    metadata: dict[str, Any] = {
        "op": span.name,
        "backend": "trackio",
        "experiment_name": experiment,
        "inputs": _metadata_value({k: v for k, v in inputs.items() if k != "messages"}),
        **{k: _metadata_value(v) for k, v in attributes.items()},
    }
    exc = _exception(span)
    if exc is not None:
        metadata["status"] = "error"
        metadata["exception_type"] = exc[0]
    else:
        metadata["status"] = "success"
        metadata["output"] = _metadata_value(output)
    metadata["trajectory_id"] = traj.id
    metadata["span_id"] = span.span_id
    if span.kind in (KIND_AGENT, KIND_TRAJECTORY) and traj.reward is not None:
        metadata["reward"] = traj.reward

    messages: list[dict[str, Any]] = []
    given = inputs.get("messages")
    if isinstance(given, list):
        messages = [dict(m) for m in given if isinstance(m, dict) and isinstance(m.get("role"), str)]
    if span.kind == KIND_AGENT and not messages and conversation and span.status != STATUS_ERROR:
        return conversation, metadata
    if not messages:
        messages = [
            {"role": "system", "content": f"verl rollout trace operation: {span.name}"},
            {"role": "user", "content": _json_content({"inputs": inputs})},
        ]
    out = output if isinstance(output, dict) else None
    if exc is not None:
        messages.append(
            {"role": "assistant", "content": _json_content({"exception_type": exc[0], "exception": exc[1]})}
        )
    elif out is not None and out.get("response_text"):
        messages.append({"role": "assistant", "content": str(out["response_text"])})
    elif out is not None and out.get("answer"):
        messages.append({"role": "assistant", "content": str(out["answer"])})
    else:
        messages.append({"role": "assistant", "content": _json_content({"output": output})})
    return messages, metadata


def step_stats(run: Any) -> dict[tuple[Any, bool], dict[str, float]]:
    """Per (step, validate): statistics of the run's trajectories, the metrics logged beside traces."""
    import numpy as np

    table = run.trajectories()
    cols = {name: table[name].to_pylist() for name in table.column_names}
    groups: dict[tuple[Any, bool], list[int]] = {}
    for i, (step, validate) in enumerate(zip(cols["step"], cols["validate"])):
        groups.setdefault((step, bool(validate)), []).append(i)

    def values(name: str, rows: list[int]) -> np.ndarray:
        return np.array([cols[name][i] for i in rows if cols[name][i] is not None], dtype=float)

    out = {}
    for key, rows in groups.items():
        stats: dict[str, float] = {"trajectories": float(len(rows))}
        stats["error_rate"] = sum(cols["status"][i] != "ok" for i in rows) / len(rows)
        for name in ("reward", "advantage", "response_tokens", "model_calls", "tool_calls", "duration_s"):
            if name not in cols:
                continue
            found = values(name, rows)
            if found.size:
                stats[f"{name}_mean"] = float(found.mean())
                if name == "reward":
                    stats["reward_min"], stats["reward_max"] = float(found.min()), float(found.max())
        out[key] = stats
    return out


def _traced(traj: Trajectory) -> list[Span]:
    """The spans verl's decorators trace (every op call; not rlreplay's own trajectory row)."""
    return [s for s in traj.spans if s.kind not in (KIND_TRAJECTORY, KIND_SIGNALS)]


class TrackioUploader:
    """Trackio's local store: verl's rollout traces (trackio.Trace per op) plus per-step stats."""

    backend = "trackio"
    requires = ("trackio",)  # modules it imports when it runs: checked before anything is read
    options = ()
    can_upsert = False  # Trackio keeps the first trace logged under a log id

    def __init__(
        self,
        project: str,
        run_name: str,
        *,
        run: Any = None,
        config: dict[str, Any] | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        self.project = project
        self.run_name = run_name
        self.timeout = timeout
        self._recorded = run
        self._config = {"framework": "verl", "uploaded_by": "rlreplay", **(config or {})}
        self.decoder: Any = None  # set by the pipeline: decodes the conversation of agent spans
        self._run: Any = None
        self._stats: dict[tuple[Any, bool], dict[str, float]] | None = None
        self._stats_logged: set[tuple[Any, bool]] = set()

    @classmethod
    def from_options(cls, options: Any) -> TrackioUploader:
        """``--project`` (default: the run's experiment); the Trackio run is named after the experiment."""
        fallback = Path(options.run_dir).name if options.run_dir else "rlreplay"
        project = options.project or options.experiment or fallback
        return cls(project, options.experiment or fallback, run=options.run, timeout=options.timeout)

    @staticmethod
    def store_dir() -> str:
        if os.environ.get("TRACKIO_DIR"):
            return os.environ["TRACKIO_DIR"]
        from trackio.utils import TRACKIO_DIR

        return str(TRACKIO_DIR)

    def target(self) -> str:
        return f"trackio:{self.store_dir()}#{self.project}/{self.run_name}"

    def describe(self) -> str:
        return f"Trackio {self.store_dir()}, project {self.project!r}, run {self.run_name!r}"

    @staticmethod
    def log_id(trajectory_id: str, span_id: str) -> str:
        return f"rlreplay:{trajectory_id}:{span_id}"

    # -- prepare (no network) --

    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        from trackio import Trace

        out = []
        for traj in trajectories:
            entries = []
            conversation = chat.messages(traj, self.decoder)
            for span in _traced(traj):
                messages, metadata = span_trace(traj, span, traj.experiment, conversation)
                payload = Trace(messages=messages, metadata=metadata)._to_dict(
                    project=self.project,
                    run=self.run_name,
                    step=traj.step if isinstance(traj.step, int) else 0,
                )
                entries.append(
                    {
                        "metrics": {trace_key(span.name): payload},
                        "step": traj.step if isinstance(traj.step, int) else None,
                        "log_id": self.log_id(traj.id, span.span_id),
                        "split": (traj.step, bool(traj.validate)),
                    }
                )
            nbytes = sum(len(orjson.dumps(e["metrics"], default=str)) for e in entries)
            out.append(Prepared(traj.id, traj.id, entries, nbytes))
        return out

    # -- send --

    def _connect(self) -> None:
        if self._run is not None:
            return
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):  # trackio prints where it logs
            try:
                self._run = trackio.init(
                    project=self.project, name=self.run_name, config=self._config, resume="allow", embed=False
                )
            except Exception as exc:
                raise UploadError(
                    f"Trackio project {self.project!r}: {' '.join(str(exc).split())[:300]}"
                ) from exc

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        within(self.timeout, f"Trackio's store at {self.store_dir()}", self._connect)
        entries = [e for p in batch for e in p.body]
        entries += self._stats_entries({e["split"] for e in entries})
        if entries:
            from trackio.sqlite_storage import SQLiteStorage

            within(
                self.timeout,
                f"Trackio's store at {self.store_dir()}",
                SQLiteStorage.bulk_log,
                project=self.project,
                run=self.run_name,
                run_id=self._run.id,
                metrics_list=[e["metrics"] for e in entries],
                steps=[e["step"] for e in entries],
                log_ids=[e["log_id"] for e in entries],
            )
        return [SendResult(p.trajectory_id, p.backend_id, True, p.nbytes) for p in batch]

    def _stats_entries(self, splits: set[tuple[Any, bool]]) -> list[dict[str, Any]]:
        if self._recorded is None:
            return []
        if self._stats is None:
            self._stats = step_stats(self._recorded)
        out = []
        for split in sorted(splits - self._stats_logged, key=str):
            stats = self._stats.get(split)
            self._stats_logged.add(split)
            if not stats or not isinstance(split[0], int):
                continue
            prefix = f"{STATS_PREFIX}/{'val' if split[1] else 'train'}/"
            out.append(
                {
                    "metrics": {prefix + name: value for name, value in stats.items()},
                    "step": split[0],
                    "log_id": f"rlreplay:stats:{self.run_name}:{split[0]}:{int(split[1])}",
                    "split": split,
                }
            )
        return out

    def existing(self, trajectory_ids: Sequence[str]) -> set[str] | None:
        """Those of ``trajectory_ids`` with traces in the store (found by their log ids)."""
        import sqlite3

        from trackio.sqlite_storage import SQLiteStorage

        path = SQLiteStorage.get_project_db_path(self.project)
        if not path.exists():
            return set()
        wanted = set(trajectory_ids)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            rows = conn.execute("SELECT log_id FROM traces WHERE log_id LIKE 'rlreplay:%'").fetchall()
        found = {row[0].split(":")[1] for row in rows if row[0] and row[0].count(":") >= 2}
        return found & wanted

    def close(self) -> None:
        if self._run is None:
            return
        import trackio

        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
            trackio.finish()
        self._run = None
