"""Replay: run the agent loop (or training) again with recorded ops of a source run served, not run.

``with rlreplay.replay(source_run, serve=("llm",)):`` serves, inside each trajectory whose keys
(step, sample_index, rollout_n, validate) match a selected trajectory of the source run, the ops of
the served kinds from the recording (``rlreplay.recorder.replay`` says how calls are matched). The
new run is recorded as usual; each trajectory's root span carries ``replay`` (``served``,
``diverged`` or ``live``) and ``replay_of`` (the source trajectory's id), each served span
``{"replay": "served"}``. ``rlreplay replay`` does the same in every process of a job, through the
environment variables below.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import orjson

from rlreplay.adapters.registry import MANIFEST_KEY, adapter_for_run
from rlreplay.errors import ReplayError, RlreplayError
from rlreplay.format import manifest
from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_TOOL
from rlreplay.model import key_value
from rlreplay.read.filters import Filters
from rlreplay.read.open import open_run
from rlreplay.read.replays import replay_rows, served_count
from rlreplay.read.run import Run
from rlreplay.read.selection import Selection
from rlreplay.recorder import api
from rlreplay.recorder.replay import (
    DIVERGED,
    ON_DIVERGE,
    Cassette,
    RecordedOp,
    RecordedTrajectory,
    normal_keys,
)

#: What ``serve`` may name, and the span kind each serves.
SERVE_KINDS = {"llm": KIND_LLM, "tool": KIND_TOOL, "agent": KIND_AGENT}
ENV_SOURCE = "RLREPLAY_REPLAY_SOURCE"
ENV_SERVE = "RLREPLAY_REPLAY_SERVE"
ENV_ON_DIVERGE = "RLREPLAY_REPLAY_ON_DIVERGE"
ENV_SELECT = "RLREPLAY_REPLAY_SELECT"


def parse_serve(serve: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``"llm,tool"`` or ``("llm", "tool")`` as span kinds; raises ReplayError for an unknown one."""
    names = serve.split(",") if isinstance(serve, str) else list(serve)
    names = [n.strip() for n in names]
    unknown = [n for n in names if n not in SERVE_KINDS]
    if unknown or not names:
        raise ReplayError(
            f"--serve: unknown kind {', '.join(unknown) or '(none)'!r} (kinds: llm, tool, agent)"
        )
    return tuple(SERVE_KINDS[n] for n in names)


def as_selection(select: Selection | dict[str, Any] | None) -> Selection:
    if select is None:
        return Selection()
    if isinstance(select, Selection):
        return select
    return Selection(**select)


def open_source(source: str | os.PathLike[str] | Run) -> Run:
    """The source run; raises ReplayError when it is missing or unreadable."""
    if isinstance(source, Run):
        return source
    try:
        run = open_run(source)
        run.index()
    except RlreplayError as exc:
        raise ReplayError(f"source run {source}: {exc}") from None
    except OSError as exc:
        raise ReplayError(f"source run {source}: cannot be read ({exc.strerror or exc})") from None
    return run


def source_framework(run: Run) -> str:
    return str((run.manifest or {}).get(MANIFEST_KEY) or "generic").strip().lower()


def selected(run: Run, select: Selection | dict[str, Any] | None) -> Any:
    """The source's selected listing; raises ReplayError when it holds no trajectory."""
    table = as_selection(select).trajectories(run)
    if table.num_rows == 0:
        raise ReplayError(f"the selection matches no trajectory of the source run {run.path}")
    return table


def recorded_trajectories(run: Run, table: Any, kinds: tuple[str, ...]) -> dict[Any, RecordedTrajectory]:
    """The listed trajectories' ops of ``kinds``, in call order, by keys (the first of equal keys)."""
    out: dict[Any, RecordedTrajectory] = {}
    rows = table.select(["id", "step", "sample_index", "rollout_n", "validate"]).to_pylist()
    strs = table.select(["step_str", "sample_index_str", "rollout_n_str"]).to_pylist()
    by_step: dict[Any, list[tuple[Any, str]]] = {}
    for row, text in zip(rows, strs):
        keys = normal_keys(
            key_value(row["step"], text["step_str"]),
            key_value(row["sample_index"], text["sample_index_str"]),
            key_value(row["rollout_n"], text["rollout_n_str"]),
            row["validate"],
        )
        by_step.setdefault(keys[0], []).append((keys, row["id"]))
    wanted = set(kinds)
    for step, items in by_step.items():
        loaded = {
            t.id: t
            for t in run.load([i for _, i in items], Filters(step=step) if isinstance(step, int) else None)
        }
        for keys, traj_id in items:
            traj = loaded.get(traj_id)
            if traj is None or keys in out:
                continue
            ops: dict[str, list[RecordedOp]] = {}
            for span in sorted(traj.spans, key=lambda s: (s.start_ns, s.span_id)):
                if span.kind in wanted and span.status == "ok":
                    ops.setdefault(span.kind, []).append(
                        RecordedOp(span.span_id, span.name, span.inputs, span.output)
                    )
            out[keys] = RecordedTrajectory(traj_id, ops)
    return out


def cassette(
    source: str | os.PathLike[str] | Run,
    serve: str | tuple[str, ...] | list[str] = ("llm",),
    select: Selection | dict[str, Any] | None = None,
    on_diverge: str = "live",
    lazy: bool = False,
) -> Cassette:
    """A :class:`Cassette` of ``source``'s selected trajectories; ``lazy``: read them on first use."""
    kinds = parse_serve(serve)
    if on_diverge not in ON_DIVERGE:
        raise ReplayError(f"--on-diverge must be live or fail, not {on_diverge!r}")
    if lazy:
        served_from = Cassette(kinds, on_diverge)

        def load() -> dict[Any, RecordedTrajectory]:
            run = open_source(source)
            served_from.rebuild = getattr(adapter_for_run(run), "rebuild_output", None)
            return recorded_trajectories(run, selected(run, select), kinds)

        served_from.load = load
        return served_from
    run = open_source(source)
    rebuild = getattr(adapter_for_run(run), "rebuild_output", None)
    return Cassette(
        kinds, on_diverge, recorded_trajectories(run, selected(run, select), kinds), rebuild=rebuild
    )


@contextlib.contextmanager
def replay(
    source_run: str | os.PathLike[str] | Run,
    serve: str | tuple[str, ...] | list[str] = ("llm",),
    select: Selection | dict[str, Any] | None = None,
    on_diverge: str = "live",
) -> Iterator[Cassette]:
    """Serve ``source_run``'s recorded ops of the ``serve`` kinds in this process (recording must be
    on: ``rlreplay.init`` or ``$RLREPLAY_DIR``); yields the :class:`Cassette` (served, diverged)."""
    if api.get_recorder() is None:
        raise ReplayError("replay records the new run: call rlreplay.init(dir) first or set $RLREPLAY_DIR")
    served_from = cassette(source_run, serve, select, on_diverge)
    mark_replay(api.get_recorder().config.run_dir, source_run, serve, on_diverge)
    previous = api.set_replay(served_from)
    try:
        yield served_from
    finally:
        api.set_replay(previous)


def mark_replay(run_dir: Any, source: Any, serve: Any, on_diverge: str) -> None:
    """Name the source in the new run's manifest: its listing then carries ``replay``/``replay_of``."""
    path = source.path if isinstance(source, Run) else source
    kinds = serve.split(",") if isinstance(serve, str) else list(serve)
    with contextlib.suppress(OSError):
        manifest.update_manifest(
            run_dir, replay={"source": str(os.path.abspath(path)), "serve": kinds, "on_diverge": on_diverge}
        )


def env_vars(source: str, serve: str, on_diverge: str, select: Selection | None) -> dict[str, str]:
    """What carries a replay into every process of a job."""
    fields = {k: v for k, v in (select.__dict__ if select else {}).items() if v is not None}
    return {
        ENV_SOURCE: source,
        ENV_SERVE: serve,
        ENV_ON_DIVERGE: on_diverge,
        ENV_SELECT: orjson.dumps(fields).decode(),
    }


def start_from_env() -> Cassette | None:
    """In a process of ``rlreplay replay``'s job: serve from the source named by the environment (read
    on the first trajectory that opens)."""
    source = os.environ.get(ENV_SOURCE)
    if not source:
        return None
    select = orjson.loads(os.environ.get(ENV_SELECT) or "{}")
    served_from = cassette(
        source,
        os.environ.get(ENV_SERVE) or "llm",
        select or None,
        os.environ.get(ENV_ON_DIVERGE) or "live",
        lazy=True,
    )
    api.set_replay(served_from)
    return served_from


def replay_summary(new_run: Run, source: Run, select: Selection | dict[str, Any] | None) -> dict[str, Any]:
    """Served spans, diverged trajectories (source ids), source trajectories never asked for."""
    rows = replay_rows(new_run)
    diverged = sorted(r["replay_of"] for r in rows.values() if r["replay"] == DIVERGED and r["replay_of"])
    asked = {r["replay_of"] for r in rows.values() if r["replay_of"]}
    table = as_selection(select).trajectories(source)
    never = [i for i in table["id"].to_pylist() if i not in asked]
    return {"served": served_count(new_run), "diverged": diverged, "never_asked": never}
