"""Whole-run questions over parts of a run: ``--engine local`` answers in this process, ``--engine
ray`` on a Ray cluster.

A part is a run of consecutive steps of the selection (in the order the commands read steps),
sized by the bytes of their span files. A Ray task opens the run where it is (an object store
through its node's read cache, or a folder every node sees), reads its part with rlreplay's own
reader (checksums verified as always) and sends back only what the command keeps of it:

- ``audit``: the trajectory checks' findings (the listing checks run on the driver);
- ``mismatch``: one :class:`rlreplay.mismatch.report.Piece` per step or piece of a step
  (per-response sums, per response and bucket sums, the largest |Δ| its step's percentile may
  read, the worst tokens), folded in step order as the local command folds its one piece a step:
  a step's figures are made once its pieces are all in, from its responses' sums in order;
- ``ls --grep``: whether each trajectory's text matches;
- ``export``: the records, written by the driver in the selection's order.

The driver merges in part order, so every answer is the local one, value for value: the local
command is the same code over one part. The warnings of every task (damaged or unreadable files)
become the driver's, so the exit code and the "not in full" line are the same too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlreplay import settings
from rlreplay.errors import EngineError, RlreplayError, install_hint

ENGINES = ("local", "ray")
#: Tasks in flight per CPU of the cluster (their answers wait on the driver in part order).
IN_FLIGHT_PER_CPU = 2
#: Times Ray runs a task again when its node or worker is lost.
TASK_RETRIES = 3
#: Seconds to reach a cluster's address before saying it is not there.
CONNECT_TIMEOUT_S = 10.0


def part_bytes() -> int:
    """Bytes of span files a part reads (whole steps, or a piece of a larger step)."""
    return settings.PART_BYTES.get()


@dataclass
class Part:
    """A task's share of the listing: its row numbers (numpy int64, ascending); ``owner`` is None
    for whole steps, else the part is a piece of one step (its reads keep to its trajectories'
    row groups) and True for the step's first piece (see ``Run.keep_to``)."""

    rows: Any
    owner: bool | None = None


def plan(run: Any, listing: Any, target: int | None = None, cut: bool = True) -> list[Part]:
    """The parts of the listing: consecutive steps in the order they first appear, up to
    ``target`` bytes of span files a part; a step larger than that is cut (with ``cut``) into
    pieces of about ``target`` bytes each, between groups (the rollouts of one sample stay in one
    piece, and a piece's rows are consecutive in the listing); a step that is not an integer is a
    part of its own."""
    import numpy as np

    from rlreplay.read.scan import step_rows

    target = target or part_bytes()
    sealed, live = run.span_files()  # one listing of the run's files, not one a step
    stored: dict[str, int] = {}
    for path, nbytes in [*((p, run.store.stamp(p)[0]) for p in sealed), *((p, _size(p)) for p in live)]:
        step = next((part[5:] for part in Path(path).parts if part.startswith("step=")), "")
        stored[step] = stored.get(step, 0) + nbytes
    parts: list[Part] = []
    current: list[Any] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            parts.append(Part(np.sort(np.concatenate(current))))
        current, size = [], 0

    for step, rows in step_rows(listing):
        here = stored.get(str(step), 0) if type(step) is int else 0
        pieces = _pieces(listing, rows, here, target) if cut and type(step) is int and here > target else []
        if type(step) is not int or len(pieces) > 1:
            close()
            if pieces:
                parts += [Part(p, k == 0) for k, p in enumerate(pieces)]
            else:
                parts.append(Part(rows))
            continue
        if current and size + here > target:
            close()
        current.append(rows)
        size += here
    close()
    return parts


def _pieces(listing: Any, rows: Any, stored: int, target: int) -> list[Any]:
    """One step's rows (ascending) cut into runs of about ``target`` bytes (``stored``: the step's,
    shared evenly by its rows), only where no sample's rollouts lie on both sides."""
    import numpy as np

    from rlreplay.format import arrow_ops as ops

    n = len(rows)
    per = max(1, int(target * n // max(stored, 1)))  # rows a piece
    if n <= per:
        return [rows]
    taken = ops.take(listing.select(["sample_index", "sample_index_str"]), _int64(rows))
    keys = list(zip(taken["sample_index"].to_pylist(), taken["sample_index_str"].to_pylist()))
    group: dict[Any, int] = {}
    gid = np.fromiter((group.setdefault(k, len(group)) for k in keys), np.int64, n)
    last = np.zeros(len(group), np.int64)
    last[gid] = np.arange(n)  # the last row of each group (later rows overwrite)
    reach = np.maximum.accumulate(last[gid])  # the last row of any group begun so far
    allowed = np.flatnonzero(reach[:-1] <= np.arange(n - 1)) + 1  # cut before these rows
    cuts, start = [], 0
    while n - start > per:
        below = int(np.searchsorted(allowed, start + per, side="right")) - 1
        if below >= 0 and allowed[below] > start:
            start = int(allowed[below])
        else:
            after = int(np.searchsorted(allowed, start, side="right"))
            if after == len(allowed):
                break
            start = int(allowed[after])
        cuts.append(start)
    return np.split(rows, cuts)


def _int64(rows: Any) -> Any:
    import pyarrow as pa

    return pa.array(rows, pa.int64())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ---- what runs on a part ------------------------------------------------------------------------


@dataclass
class Answer:
    """What a task sends back: the command's value for its part, what the read said about the
    run's files, and what it cost."""

    value: Any
    warnings: list[str]
    unreadable: dict[str, str]
    files_read: set[str]
    unverified: set[str]
    seconds: float = 0.0
    bytes_read: int = 0
    #: the worker's peak resident memory while it ran the task (Linux; else the process's peak)
    peak_rss: int = 0
    node: str = ""
    #: the worker's resident memory when the task began (what earlier tasks and imports left)
    rss_before: int = 0


def run_part(address: str, job: Callable[[Any, Any], Any], listing: Any, owner: bool | None = None) -> Answer:
    """Open the run at ``address`` and run ``job(run, listing)`` (a part's rows): the Ray task;
    ``owner``: see :class:`Part`."""
    import resource

    from rlreplay.read.open import open_run

    started = time.perf_counter()
    fresh = _reset_peak()
    before = _status("VmRSS:")
    run = open_run(address)
    if owner is not None:
        run.keep_to(listing["id"].to_pylist(), owner)
    value = job(run, listing)
    read = sum(run.store.stamp(run.path / rel)[0] for rel in run.files_read)
    return Answer(
        value,
        list(run.warnings),
        dict(run.unreadable),
        set(run.files_read),
        set(run.unverified),
        time.perf_counter() - started,
        read,
        (_status("VmHWM:") if fresh else 0) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        settings.HOST.get() or os.uname().nodename,
        before,
    )


def _reset_peak() -> bool:
    """Start this process's peak resident memory afresh (Linux), so a reused worker's figure is
    its task's; False where it cannot be (the figure is then the process's peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status(field: str) -> int:
    """A memory figure of this process's /proc status (bytes; 0: not known): ``VmHWM:``, its peak
    resident memory since :func:`_reset_peak`, or ``VmRSS:``, its resident memory now."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def absorb(run: Any, answer: Answer) -> None:
    """The driver's run takes a task's warnings and what it read (the local read would have)."""
    for message in answer.warnings:
        run.warn(message)
    for rel, why in answer.unreadable.items():
        run.unreadable.setdefault(rel, why)
    run.files_read |= answer.files_read
    run.unverified |= answer.unverified


@dataclass
class AuditJob:
    """The trajectory checks named, over a part (``engine.audit`` of the listing checks' rest)."""

    checks: list[str]
    thresholds: dict[str, float]
    tokenizer: str | None

    def __call__(self, run: Any, listing: Any) -> tuple[list[Any], dict[str, str], dict[str, str]]:
        from rlreplay.audit import engine

        chosen = engine.choose(self.checks, engine.available())
        report = engine.audit(run, listing, chosen, self.thresholds, self.tokenizer)
        return report.findings, report.skipped, report.failed


@dataclass
class MismatchJob:
    """The mismatch pieces of a part's steps (rows numbered in the part)."""

    by: str
    token_ids: bool
    limits: tuple[float, float]
    #: None: the part holds whole steps; else it is a piece of a step (``mismatch.report.digest``)
    keep: int | None = None

    def __call__(self, run: Any, listing: Any) -> tuple[list[Any], Any]:
        from rlreplay.adapters.registry import adapter_for_run
        from rlreplay.mismatch.report import digest
        from rlreplay.mismatch.tokens import Counts

        counts = Counts()
        fields = getattr(adapter_for_run(run), "fields", None)
        made = digest(run, listing, self.by, fields, counts, self.token_ids, self.limits, self.keep)
        return list(made), counts


@dataclass
class SearchJob:
    """Whether each row of a part matches a regular expression (``ls --grep``)."""

    regex: str
    tokenizer: str | None

    def __call__(self, run: Any, listing: Any) -> Any:
        from rlreplay.read.search import TextSearch

        return TextSearch.for_run(run, self.tokenizer).matches(listing, self.regex).to_numpy(False)


@dataclass
class ExportJob:
    """The export records of a part's chosen trajectories, in the order given."""

    ids: list[str]
    tokenizer: str | None
    with_ids: bool
    with_logprobs: bool

    def __call__(self, run: Any, listing: Any) -> list[dict[str, Any]]:
        from rlreplay.export import records
        from rlreplay.text.token2text import Decoder, resolve_tokenizer

        decoder = Decoder.load(resolve_tokenizer(run, self.tokenizer))
        out: list[dict[str, Any]] = []
        for batch in records(run, listing, self.ids, decoder, self.with_ids, self.with_logprobs):
            out.extend(batch)
        return out


# ---- engines ------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """A connected Ray cluster that runs parts as tasks; ``answers`` keeps every task's
    :class:`Answer` less its value (for benchmarks and tests)."""

    address: str
    cpus: int
    progress: bool = field(default_factory=lambda: sys.stderr.isatty())
    answers: list[Answer] = field(default_factory=list)
    #: stay connected once the parts are in (a caller that maps again: see :meth:`held`)
    stay: bool = False

    def map(
        self, run: Any, work: Sequence[tuple[Callable[[Any, Any], Any], Any, bool | None]], what: str
    ) -> Iterator[Any]:
        """Each (job, listing of a part, its ``Part.owner``) of ``work`` as a Ray task: the values
        in order, each task's warnings absorbed into ``run`` as its value comes. At most
        ``IN_FLIGHT_PER_CPU`` tasks a CPU are in flight: answers wait on the driver only that far
        ahead."""
        from collections import deque

        import ray

        if not ray.is_initialized():
            _init(ray, self.address)
        task = ray.remote(run_part).options(
            num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False, scheduling_strategy="SPREAD"
        )
        where = run_location(run)
        todo = iter(work)
        pending: deque[Any] = deque()

        def submit() -> None:
            for job, listing, owner in todo:
                pending.append(task.remote(where, job, listing, owner))
                return

        # Ray's driver prints what the cluster says (a node lost, a worker killed) on stdout:
        # while it is connected, that goes to stderr, and it is disconnected once the parts are in
        with contextlib.redirect_stdout(sys.stderr):
            try:
                for _ in range(max(1, self.cpus * IN_FLIGHT_PER_CPU)):
                    submit()
                done = 0
                while pending:
                    answer = _get(pending.popleft())
                    submit()
                    done += 1
                    self._show(what, done, len(work))
                    absorb(run, answer)
                    value, answer.value = answer.value, None
                    self.answers.append(answer)
                    yield value
            finally:
                if not self.stay:
                    ray.shutdown()
                if self.progress and work:
                    sys.stderr.write("\n")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Connected throughout: the maps made inside share the one connection (a command that
        maps more than once connects once), disconnected at the end unless an outer ``held``
        holds it still. What Ray prints meanwhile goes to stderr, as in :meth:`map`."""
        stay, self.stay = self.stay, True
        with contextlib.redirect_stdout(sys.stderr):
            try:
                yield
            finally:
                self.stay = stay
                if not stay:
                    import ray

                    ray.shutdown()

    def _show(self, what: str, done: int, total: int) -> None:
        if self.progress:
            width = 30
            filled = width * done // max(total, 1)
            sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} parts")
            sys.stderr.flush()


def _get(ref: Any) -> Answer:
    """A task's answer; an error the task met as the error it is (a one-line error stays one)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RlreplayError):
            raise cause from None
        if isinstance(cause, ModuleNotFoundError):
            raise EngineError(
                f"--engine ray: the cluster's workers cannot import {cause.name or 'rlreplay'}: install "
                "rlreplay (the driver's version, with its extras) on every node"
            ) from None
        raise EngineError(f"--engine ray: a task failed: {_one_line(cause or exc)}") from None
    except (ray.exceptions.RayError, ConnectionError) as exc:
        raise EngineError(f"--engine ray: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def run_location(run: Any) -> str:
    """Where a task opens the run: its URI, or its folder as an absolute path (a folder every node
    must see: a shared filesystem)."""
    uri = getattr(run.store, "uri", None)
    return uri if uri else str(Path(run.path).resolve())


def connect(address: str | None) -> Cluster:
    """The Ray cluster at ``address`` (else ``$RAY_ADDRESS``; ``auto`` inside a Ray job), its
    workers able to run rlreplay; a one-line :class:`EngineError` otherwise."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise EngineError(
            "--engine ray: no Ray cluster named: pass --ray-address HOST:PORT (auto inside a Ray job) "
            "or set RAY_ADDRESS"
        )
    try:
        import ray
    except ImportError:
        raise EngineError(f"--engine ray needs Ray: {install_hint('ray')}") from None
    _reachable(address)
    with contextlib.redirect_stdout(sys.stderr):
        _init(ray, address)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        _probe(ray)
    return Cluster(address, cpus)


def _init(ray: Any, address: str) -> None:
    import logging

    try:
        ray.init(
            address=address,
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=True,
            include_dashboard=False,
        )
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError or ValueError here
        raise EngineError(f"--engine ray: no Ray cluster reachable at {address}: {_one_line(exc)}") from None


def _reachable(address: str) -> None:
    """Refuse at once an address where nothing listens (Ray itself would retry for a minute)."""
    import socket

    target = address.removeprefix("ray://")
    if target == "auto" or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            return
    except (OSError, ValueError) as exc:
        raise EngineError(f"--engine ray: no Ray cluster reachable at {address}: {_one_line(exc)}") from None


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rlreplay")
    except PackageNotFoundError:
        return "unknown"


def _probe(ray: Any) -> None:
    """The cluster's workers run this rlreplay: one small task says which they have."""
    try:
        theirs = _get(ray.remote(version).options(num_cpus=0, max_retries=TASK_RETRIES).remote())
    except EngineError as exc:
        raise EngineError(
            f"--engine ray: the cluster's workers cannot import rlreplay: install rlreplay {version()} "
            f"(with its extras) on every node ({str(exc).removeprefix('--engine ray: ')[:200]})"
        ) from None
    if theirs != version():
        raise EngineError(
            f"--engine ray: the cluster's workers have rlreplay {theirs}, this is {version()}: install "
            "the same version on every node"
        )


# ---- the four commands --------------------------------------------------------------------------


def audit(
    run: Any,
    listing: Any,
    checks: Sequence[Any],
    thresholds: dict[str, float] | None,
    tokenizer: str | None,
    cluster: Cluster,
) -> Any:
    """``rlreplay.audit.engine.audit`` with its trajectory checks run on the cluster, a part a
    task: the listing checks here (the mismatch check's step pieces made on the cluster), the
    parts' findings after them in step order (as locally)."""
    from rlreplay.audit import engine as audit_engine
    from rlreplay.audit.finding import OVER_LISTING

    over_listing = [c for c in checks if c.over == OVER_LISTING]
    over_spans = [c for c in checks if c.over != OVER_LISTING]

    def pieces(rows: Any, limits: tuple[float, float]) -> tuple[Iterator[Any], Any]:
        return mismatch_pieces(run, rows, "step", False, limits, cluster)

    with cluster.held():  # the mismatch check's pieces and the parts: one connection
        report = audit_engine.audit(run, listing, over_listing, thresholds, None, pieces)
        report.checks = list(checks)
        if not over_spans or not listing.num_rows:
            return report
        found = list(report.findings)
        job = AuditJob([c.name for c in over_spans], dict(thresholds or {}), tokenizer)
        work = [(job, _rows(listing, p.rows), p.owner) for p in plan(run, listing)]
        for findings, skipped, failed in cluster.map(run, work, "audit"):
            found.extend(findings)
            for name, why in skipped.items():
                report.skipped.setdefault(name, why)
            for name, why in failed.items():
                report.failed.setdefault(name, why)
    report.findings = [f for f in found if f.check not in report.failed]
    return report


def mismatch_pieces(
    run: Any, listing: Any, by: str, token_ids: bool, limits: tuple[float, float], cluster: Cluster
) -> tuple[Iterator[Any], Any]:
    """(the pieces of the listing's steps, made on the cluster, rows numbered in ``listing``; the
    counts they add to, filled as the pieces come) for ``mismatch.report.compute``. A step larger
    than a part comes in pieces cut between samples; its pieces are given once all are in, and
    should they have kept too few of their largest |Δ| for the step's percentile, they are made
    again keeping enough (so the figures are the whole step's, always)."""
    from rlreplay.mismatch.report import kept_too_few, same_step
    from rlreplay.mismatch.tokens import Counts

    counts = Counts()
    parts = plan(run, listing)
    work = [(_mismatch_job(by, token_ids, limits, p), _rows(listing, p.rows), p.owner) for p in parts]

    def complete(held: list[tuple[int, Any]]) -> Iterator[Any]:
        need = kept_too_few([piece for _, piece in held])
        if need:
            redo = sorted({k for k, _ in held})
            again = [
                (_mismatch_job(by, token_ids, limits, parts[k], need), work[k][1], parts[k].owner)
                for k in redo
            ]
            fresh = {k: made for k, (made, _) in zip(redo, cluster.map(run, again, "mismatch"))}
            for k, piece in held:  # a piece of a step is a part of its own: one piece
                piece.splits = fresh[k][0].splits
        for _, piece in held:
            yield piece

    def pieces() -> Iterator[Any]:
        # connected until the last step's pieces are complete (they may be made again)
        with cluster.held():
            held: list[tuple[int, Any]] = []  # the pieces of the step not given yet
            for k, (made, seen) in enumerate(cluster.map(run, work, "mismatch")):
                counts.merge(seen)
                for piece in made:
                    piece.rows = parts[k].rows[piece.rows]
                    if held and not same_step(held[-1][1].step, piece.step):
                        yield from complete(held)
                        held = []
                    held.append((k, piece))
            yield from complete(held)

    return pieces(), counts


def _mismatch_job(
    by: str, token_ids: bool, limits: tuple[float, float], part: Part, keep: int = 0
) -> MismatchJob:
    """The job of a part: whole steps keep what their percentile reads, a piece at least ``keep``."""
    return MismatchJob(by, token_ids, limits, None if part.owner is None else keep)


class Search:
    """``ls --grep``'s text search on the cluster: ``matches`` as ``TextSearch.matches`` answers,
    a part a task (each node keeps its decoded texts in its own cache)."""

    def __init__(self, run: Any, tokenizer: str | None, cluster: Cluster) -> None:
        from rlreplay.read.search import TextSearch

        TextSearch.for_run(run, tokenizer)  # no tokenizer known: the same one-line error, here
        self.run, self.tokenizer, self.cluster = run, tokenizer, cluster

    def matches(self, listing: Any, regex: str) -> Any:
        import numpy as np
        import pyarrow as pa

        mask = np.zeros(listing.num_rows, np.bool_)
        if not listing.num_rows:
            return pa.array(mask)
        plans = plan(self.run, listing)
        job = SearchJob(regex, self.tokenizer)
        work = [(job, _rows(listing, p.rows), p.owner) for p in plans]
        for p, hit in zip(plans, self.cluster.map(self.run, work, "grep")):
            mask[p.rows] = hit
        return pa.array(mask)


def export_batches(
    run: Any,
    listing: Any,
    ids: list[str],
    tokenizer: str | None,
    with_ids: bool,
    with_logprobs: bool,
    cluster: Cluster,
) -> Iterator[list[dict[str, Any]]]:
    """The export records of ``ids`` in their order, made on the cluster a part a task."""
    import numpy as np

    plans = plan(run, listing)
    part_of = np.empty(listing.num_rows, np.int64)
    for k, p in enumerate(plans):
        part_of[p.rows] = k
    row_of = {i: r for r, i in enumerate(listing["id"].to_pylist())}
    chosen: list[list[str]] = [[] for _ in plans]  # per part: its ids, in the order given
    for i in ids:
        chosen[part_of[row_of[i]]].append(i)
    used = [k for k in range(len(plans)) if chosen[k]]
    jobs = {k: ExportJob(chosen[k], tokenizer, with_ids, with_logprobs) for k in used}
    work = [(jobs[k], _rows(listing, plans[k].rows), plans[k].owner) for k in used]
    made = cluster.map(run, work, "export")
    fetched = -1  # parts come in order; ids given out of it wait in ``ready``
    ready: dict[str, dict[str, Any]] = {}
    for i in ids:
        needed = used.index(int(part_of[row_of[i]]))
        while fetched < needed:
            ready.update((record["id"], record) for record in next(made))
            fetched += 1
        if i in ready:  # a trajectory the read did not find is left out, as locally
            yield [ready.pop(i)]


def _rows(listing: Any, rows: Any) -> Any:
    """The listing's rows ``rows`` (numbers), in that order."""
    import pyarrow as pa

    from rlreplay.format import arrow_ops as ops

    return ops.take(listing, pa.array(rows, pa.int64()))
