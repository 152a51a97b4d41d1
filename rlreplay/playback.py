"""Replay: run the agent loop (or training) again with recorded ops of a source run served, not run.

``with rlreplay.replay(source_run, serve=("llm",)):`` serves, inside each trajectory whose keys
(step, sample_index, rollout_n, validate) match a selected trajectory of the source run, the ops of
the served kinds from the recording (``match_on``: the matchers of ``rlreplay.recorder.matchers``).
The new run is recorded as usual; each trajectory's root span carries ``replay`` (``served``,
``diverged`` or ``live``), ``replay_of`` (the source trajectory's id) and, when it diverged,
``replay_reason``; each served span ``{"replay": "served"}``, the span that diverged
``{"replay": "diverged", "replay_reason": ...}``. A :class:`ReplayConfig` is the whole replay:
``rlreplay replay`` carries it into every process of a job through the environment, and both
write it into the new run's manifest.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from rlreplay import settings
from rlreplay.adapters.registry import MANIFEST_KEY as ADAPTER_KEY
from rlreplay.adapters.registry import adapter_for_run
from rlreplay.errors import ReplayError, RlreplayError
from rlreplay.format import manifest
from rlreplay.format.keys import KEY_STR, KEYS, TrajectoryKey
from rlreplay.format.schema import KIND_AGENT, KIND_LLM, KIND_TOOL
from rlreplay.read.filters import Filters
from rlreplay.read.open import open_run
from rlreplay.read.replays import replay_rows, served_count
from rlreplay.read.run import Run
from rlreplay.read.selection import Selection
from rlreplay.recorder import api
from rlreplay.recorder.matchers import DEFAULT_MATCH_ON, RecordedOp, matchers
from rlreplay.recorder.replay import (
    DIVERGED,
    ON_DIVERGE,
    REASON_KEY,
    SOURCE_KEY,
    STATUS_KEY,
    Cassette,
    RecordedTrajectory,
    Recording,
)
from rlreplay.remote import location

#: What ``serve`` may name, and the span kind each serves.
SERVE_KINDS = {"llm": KIND_LLM, "tool": KIND_TOOL, "agent": KIND_AGENT}
#: The manifest's record of a replay (``run.json``), and the listing columns a replay adds.
MANIFEST_KEY = "replay"
#: How ``Run.warnings`` names a span file it could not read.
SKIPPED = "skipped unreadable file "


def _names(value: str | Iterable[str], option: str) -> tuple[str, ...]:
    names = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(n, str) for n in names):
        raise ReplayError(f"{option}: names, not {value!r}")
    return tuple(n.strip() for n in names)


def parse_serve(serve: str | Iterable[str]) -> tuple[str, ...]:
    """``"llm,tool"`` or ``("llm", "tool")`` as span kinds; raises ReplayError for an unknown one."""
    names = _names(serve, "--serve")
    unknown = [n for n in names if n not in SERVE_KINDS]
    if unknown or not names:
        raise ReplayError(
            f"--serve: unknown kind {', '.join(unknown) or '(none)'!r} (kinds: {', '.join(SERVE_KINDS)})"
        )
    return tuple(SERVE_KINDS[n] for n in names)


def as_selection(select: Selection | Mapping[str, Any] | None) -> Selection:
    if select is None:
        return Selection()
    if isinstance(select, Selection):
        return select
    try:
        return Selection(**select)
    except TypeError as exc:
        raise ReplayError(f"replay selection: {exc}") from None


def _selection_record(selection: Selection) -> dict[str, Any]:
    """The options a selection was given (its fields that are set)."""
    return {f.name: v for f in fields(selection) if (v := getattr(selection, f.name)) is not None}


def _source_text(source: str | os.PathLike[str] | Run) -> str:
    """The source as every process of a job can open it: a URI as given, a local path absolute."""
    if isinstance(source, Run):
        return source.store.uri or str(Path(source.path).resolve())
    return location.as_uri(source) or str(location.local_path(source).resolve())


@dataclass(frozen=True)
class ReplayConfig:
    """A replay: what it serves from and how. The one place that carries it into a job's processes
    (:meth:`env`, :meth:`from_env`) and into the new run's manifest (:meth:`record`,
    :meth:`from_manifest`)."""

    source: str  # the source run: a URI as given, or an absolute path
    serve: tuple[str, ...] = ("llm",)  # names of SERVE_KINDS
    selection: Selection = field(default_factory=Selection)
    on_diverge: str = "live"
    match_on: tuple[str, ...] = DEFAULT_MATCH_ON  # names of rlreplay.recorder.matchers.MATCHERS

    @classmethod
    def of(
        cls,
        source: str | os.PathLike[str] | Run,
        serve: str | Iterable[str] = ("llm",),
        select: Selection | Mapping[str, Any] | None = None,
        on_diverge: str = "live",
        match_on: str | Iterable[str] = DEFAULT_MATCH_ON,
    ) -> ReplayConfig:
        """A checked config; raises ReplayError for an unknown kind, matcher or ``on_diverge``."""
        config = cls(
            _source_text(source),
            _names(serve, "--serve"),
            as_selection(select),
            on_diverge,
            _names(match_on, "--match-on"),
        )
        config.check()
        return config

    def check(self) -> None:
        parse_serve(self.serve)
        if self.on_diverge not in ON_DIVERGE:
            raise ReplayError(f"--on-diverge must be live or fail, not {self.on_diverge!r}")
        try:
            matchers(self.match_on)
        except ValueError as exc:
            raise ReplayError(f"--match-on: {exc}") from None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The span kinds served."""
        return parse_serve(self.serve)

    # -- into a job's processes, and back ------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What carries this replay into every process of a job."""
        return {
            settings.REPLAY_SOURCE.name: self.source,
            settings.REPLAY_SERVE.name: ",".join(self.serve),
            settings.REPLAY_ON_DIVERGE.name: self.on_diverge,
            settings.REPLAY_SELECT.name: orjson.dumps(_selection_record(self.selection)).decode(),
            settings.REPLAY_MATCH_ON.name: ",".join(self.match_on),
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ReplayConfig | None:
        """The replay the environment names; None when it names none. Raises ReplayError."""
        source = settings.REPLAY_SOURCE.get(environ)
        if not source:
            return None
        name = settings.REPLAY_SELECT.name
        try:
            select = orjson.loads(settings.REPLAY_SELECT.get(environ) or "{}")
        except orjson.JSONDecodeError as exc:
            raise ReplayError(f"${name}: not JSON ({exc})") from None
        if not isinstance(select, dict):
            raise ReplayError(f"${name}: not a JSON object")
        return cls.of(
            source,
            settings.REPLAY_SERVE.get(environ),
            select,
            settings.REPLAY_ON_DIVERGE.get(environ),
            settings.REPLAY_MATCH_ON.get(environ) or DEFAULT_MATCH_ON,
        )

    # -- into the new run's manifest, and back --------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The manifest's ``replay`` record."""
        return {
            "source": self.source,
            "serve": list(self.serve),
            "on_diverge": self.on_diverge,
            "match_on": list(self.match_on),
            "select": _selection_record(self.selection),
        }

    def write_manifest(self, run_dir: str | os.PathLike[str]) -> None:
        """Name this replay in the run's manifest: its listing then carries the replay columns."""
        with contextlib.suppress(OSError):
            manifest.update_manifest(Path(run_dir), **{MANIFEST_KEY: self.record()})

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any]) -> ReplayConfig | None:
        """The replay a run's manifest records (older records name fewer fields); None when it
        records none or one that is not readable."""
        found = data.get(MANIFEST_KEY)
        if not isinstance(found, dict) or not isinstance(found.get("source"), str):
            return None
        try:
            return cls(
                found["source"],
                _names(found.get("serve") or ("llm",), "serve"),
                as_selection(found.get("select") or None),
                str(found.get("on_diverge") or "live"),
                _names(found.get("match_on") or DEFAULT_MATCH_ON, "match_on"),
            )
        except (ReplayError, TypeError, AttributeError):
            return None

    # -- the cassette --------------------------------------------------------------------------

    def cassette(self, run: Run | None = None, lazy: bool = False) -> Cassette:
        """A :class:`Cassette` of the source's selected trajectories (``run``: the source, opened);
        ``lazy``: read on the first trajectory that opens."""

        def recording() -> Recording:
            source = run if run is not None else open_source(self.source)
            adapter = adapter_for_run(source)
            seen = len(source.warnings)
            table = selected(source, self.selection)
            found, unreadable = recorded_trajectories(source, table, self.kinds)
            problem = unreadable_files(source, seen)
            return Recording(
                found,
                adapter.volatile_keys(),
                adapter.rebuild_output,
                unreadable,
                None
                if problem is None
                else f"the source run {source.address} was not read in full: {problem}",
            )

        return Cassette(self.kinds, recording if lazy else recording(), self.on_diverge, self.match_on)


def open_source(source: str | os.PathLike[str] | Run) -> Run:
    """The source run; raises ReplayError when it is missing or unreadable."""
    if isinstance(source, Run):
        return source
    try:
        run = open_run(source)
    except RlreplayError as exc:
        raise ReplayError(f"source run {location.redact(os.fspath(source))}: {exc}") from None
    except OSError as exc:
        raise ReplayError(
            f"source run {location.redact(os.fspath(source))}: cannot be read ({exc.strerror or exc})"
        ) from None
    return run


def source_framework(run: Run) -> str:
    return str((run.manifest or {}).get(ADAPTER_KEY) or "generic").strip().lower()


def unreadable_files(run: Run, seen: int = 0) -> str | None:
    """What ``run`` could not read since it had ``seen`` warnings (the span files it skipped), in
    one line naming the first; None when it read everything."""
    skipped = [w.removeprefix(SKIPPED) for w in run.warnings[seen:] if w.startswith(SKIPPED)]
    if not skipped:
        return None
    more = f"; and {len(skipped) - 1} more" if len(skipped) > 1 else ""
    return f"{len(skipped)} span file(s) could not be read ({skipped[0]}{more})"


def selected(run: Run, select: Selection | Mapping[str, Any] | None) -> Any:
    """The source's selected listing; raises ReplayError when it holds no trajectory (naming the
    files that could not be read, when some were not)."""
    seen = len(run.warnings)
    try:
        table = as_selection(select).trajectories(run)
    except OSError as exc:
        raise ReplayError(f"source run {run.address}: cannot be read ({exc.strerror or exc})") from None
    if table.num_rows == 0:
        problem = unreadable_files(run, seen)
        if problem is not None:
            raise ReplayError(f"source run {run.address}: no selected trajectory could be read: {problem}")
        raise ReplayError(f"the selection matches no trajectory of the source run {run.address}")
    return table


def recorded_trajectories(
    run: Run, table: Any, kinds: Iterable[str]
) -> tuple[dict[TrajectoryKey, RecordedTrajectory], dict[TrajectoryKey, str]]:
    """The listed trajectories' ops of ``kinds``, in call order, by key (the first of equal keys);
    and the listed trajectories whose spans could not be read, with why."""
    out: dict[TrajectoryKey, RecordedTrajectory] = {}
    unreadable: dict[TrajectoryKey, str] = {}
    by_step: dict[Any, list[tuple[TrajectoryKey, str]]] = {}
    for row in table.select(["id", "validate", *KEYS, *KEY_STR.values()]).to_pylist():
        key = TrajectoryKey.from_row(row).without_experiment()
        by_step.setdefault(key.step, []).append((key, row["id"]))
    wanted = set(kinds)
    for step, items in by_step.items():
        seen = len(run.warnings)
        loaded = {
            t.id: t
            for t in run.load([i for _, i in items], Filters(step=step) if isinstance(step, int) else None)
        }
        problem = unreadable_files(run, seen)
        for key, traj_id in items:
            traj = loaded.get(traj_id)
            if key in out:
                continue
            if traj is None:
                why = problem or "its spans are missing"
                unreadable.setdefault(key, f"source trajectory {traj_id} could not be read: {why}")
                continue
            ops: dict[str, list[RecordedOp]] = {}
            for span in sorted(traj.spans, key=lambda s: (s.start_ns, s.span_id)):
                if span.kind in wanted and span.status == "ok":
                    same_kind = ops.setdefault(span.kind, [])
                    same_kind.append(
                        RecordedOp(
                            span.span_id,
                            span.name,
                            span.inputs,
                            span.output,
                            len(same_kind),
                            span.output_type,
                        )
                    )
            out[key] = RecordedTrajectory(traj_id, ops)
            unreadable.pop(key, None)
    return out, unreadable


@contextlib.contextmanager
def replay(
    source_run: str | os.PathLike[str] | Run,
    serve: str | tuple[str, ...] | list[str] = ("llm",),
    select: Selection | dict[str, Any] | None = None,
    on_diverge: str = "live",
    match_on: str | tuple[str, ...] | list[str] = DEFAULT_MATCH_ON,
) -> Iterator[Cassette]:
    """Serve ``source_run``'s recorded ops of the ``serve`` kinds in this process (recording must be
    on: ``rlreplay.init`` or ``$RLREPLAY_DIR``); yields the :class:`Cassette` (served, divergences).

    ``match_on``: the matchers a call must pass to be served (``rlreplay.recorder.matchers``)."""
    recorder = api.get_recorder()
    if recorder is None:
        raise ReplayError("replay records the new run: call rlreplay.init(dir) first or set $RLREPLAY_DIR")
    config = ReplayConfig.of(source_run, serve, select, on_diverge, match_on)
    served_from = config.cassette(open_source(source_run))
    config.write_manifest(recorder.config.run_dir)
    previous = api.set_replay(served_from)
    try:
        yield served_from
    finally:
        api.set_replay(previous)


def start_from_env() -> Cassette | None:
    """In a process of ``rlreplay replay``'s job: serve from the source named by the environment (read
    on the first trajectory that opens)."""
    config = ReplayConfig.from_env()
    if config is None:
        return None
    served_from = config.cassette(lazy=True)
    api.set_replay(served_from)
    return served_from


def replay_summary(new_run: Run, config: ReplayConfig, source: Run | None = None) -> dict[str, Any]:
    """What a replay did, from the new run: ``served`` spans; ``diverged`` (source ids) and
    ``divergences`` (source id -> why); ``unserved``: trajectories that diverged because the source
    could not be read (why -> how many); ``never_asked``: the selected source trajectories no
    trajectory asked for (None when the source cannot be listed now, ``source_problem`` says why)."""
    rows = replay_rows(new_run)
    divergences: dict[str, str] = {}
    unserved: dict[str, int] = {}
    for r in rows.values():
        if r[STATUS_KEY] != DIVERGED:
            continue
        if r[SOURCE_KEY]:
            divergences[r[SOURCE_KEY]] = r[REASON_KEY]
        else:
            why = str(r[REASON_KEY])
            unserved[why] = unserved.get(why, 0) + 1
    asked = {r[SOURCE_KEY] for r in rows.values() if r[SOURCE_KEY]}
    never: list[str] | None = None
    problem = None
    try:
        read = source if source is not None else open_source(config.source)
        seen = len(read.warnings)
        never = [i for i in config.selection.trajectories(read)["id"].to_pylist() if i not in asked]
        problem = unreadable_files(read, seen)
    except (RlreplayError, OSError) as exc:
        problem = f"the source run cannot be listed now ({_first_line(exc)})"
    return {
        "served": served_count(new_run),
        "diverged": sorted(divergences),
        "divergences": divergences,
        "unserved": unserved,
        "never_asked": never,
        "source_problem": problem,
    }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
