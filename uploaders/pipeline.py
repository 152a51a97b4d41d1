"""The upload pipeline, the same for every backend: select → load → decode → prepare → send.

A backend is a class implementing ``rlreplay.hookspecs.Uploader``, found through the
entry-point group ``rlreplay.uploaders`` (or :data:`BACKENDS`, for one registered in-process)
and imported only when used. :func:`make_uploader` builds it with
``Class.from_options(BackendOptions)`` when the class has that classmethod, else with
``Class(project)``. :func:`upload` then drives it:

- trajectories are loaded a step at a time, decoded to text when a decoder is given, and
  turned into wire payloads by ``prepare`` (no network), whose sizes are the bytes counted;
- a byte budget keeps whole groups, in upload order, while they fit;
- ``send`` runs on one background thread, overlapping the preparation of the next batch
  (so ``prepare`` and ``send`` of one uploader may run at the same time on two threads);
- failed trajectories are retried with exponential backoff (from ``$RLREPLAY_UPLOAD_BACKOFF_S``,
  at most :data:`MAX_BACKOFF_S`), then reported one by one; successes go to the run's
  :class:`~rlreplay.uploaders.base.Ledger`, so a rerun sends only what is missing. Backends
  use ids derived from the recorded ids, so even a batch sent just before an interruption and
  not yet in the ledger is overwritten, not duplicated.
"""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlreplay import plugins, settings
from rlreplay.errors import RunError, install_hint
from rlreplay.format.payload import readable
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.read.selection import Group

if TYPE_CHECKING:
    from rlreplay.hookspecs import Uploader
    from rlreplay.uploaders.base import Ledger, Prepared

#: Backends registered in-process (``name → "module:Class"``), on top of the entry points.
BACKENDS: dict[str, str] = plugins.REGISTERED["uploaders"]
#: The extra that installs a built-in backend's packages.
EXTRAS = {"mlflow": "mlflow", "weave": "weave", "otlp": "otlp", "trackio": "trackio"}

DEFAULT_BATCH = 100
DEFAULT_RETRIES = 3
MAX_BACKOFF_S = 10.0
# Consecutive batches that fail completely (after retries) before the upload gives up.
GIVE_UP_AFTER = 3
# How long an interrupted upload waits for the request in flight before leaving it.
REQUEST_WAIT_S = 30.0
#: Default overall deadline of one request (``--timeout``).
DEFAULT_TIMEOUT_S = 60.0


@dataclass
class BackendOptions:
    """What a backend may need to know, independent of tokenizers and selection."""

    project: str | None = None  # --project: the backend's project / experiment
    run_dir: Path | None = None  # the recorded run (a place for local state, e.g. a sqlite store)
    experiment: str | None = None  # the run's experiment name (from run.json)
    timeout: float | None = DEFAULT_TIMEOUT_S  # overall deadline of one request, in seconds
    values: dict[str, Any] = field(default_factory=dict)  # the backend's own options, by key
    run: Run | None = None  # the recorded run itself


def installed_backends() -> dict[str, str]:
    """Every backend installed: ``name → "module:Class"`` (entry points, then :data:`BACKENDS`)."""
    return plugins.specs("uploaders")


def backend_class(name: str) -> type:
    """The uploader class registered for ``name`` (imported now)."""
    installed = installed_backends()
    spec = installed.get(name)
    if spec is None:
        raise RunError(
            f"--backend must be one of: {', '.join(sorted(installed)) or '(none installed)'} (got {name!r})"
        )
    try:
        cls = plugins.load(spec)
    except ImportError as exc:
        hint = f"; {install_hint(EXTRAS[name])}" if name in EXTRAS else ""
        raise RunError(f"the {name} backend needs packages that are missing ({exc}){hint}") from None
    except Exception as exc:  # a broken plug-in: one line, and the other backends still work
        raise RunError(f"the {name} backend ({spec}) failed to import: {_one_line(exc)}") from None
    missing = missing_modules(getattr(cls, "requires", ()))
    if missing:
        extra = EXTRAS.get(name)
        hint = ""
        if extra:
            hint = f": {install_hint(extra)}"
        raise RunError(f"the {name} backend needs {', '.join(missing)}, which is not installed{hint}")
    return cls


def missing_modules(names: Iterable[str]) -> list[str]:
    """The modules among ``names`` that cannot be imported here (found without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def backend_options(cls: type) -> tuple[Any, ...]:
    """The options a backend class declares (none if it declares none)."""
    return tuple(getattr(cls, "options", ()) or ())


def make_uploader(
    name: str,
    run: Run | None = None,
    project: str | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    values: dict[str, Any] | None = None,
) -> Uploader:
    """Backend ``name`` for ``run``: ``Class.from_options(BackendOptions)``, else ``Class(project)``."""
    cls = backend_class(name)
    factory = getattr(cls, "from_options", None)
    if factory is not None:
        options = BackendOptions(
            project=project,
            run_dir=run.path if run is not None else None,
            experiment=run.experiment if run is not None else None,
            timeout=timeout,
            values=dict(values or {}),
            run=run,
        )
        return factory(options)
    return cls(project)


def load_decoder(run: Run, tokenizer: str | None, warn: Callable[[str], None]) -> Any | None:
    """The token2text decoder for the run (``--tokenizer`` or its manifest), or None.

    A tokenizer the user named must load; one taken from the manifest that cannot load gives
    one warning, and the upload goes on with token ids only.
    """
    try:
        from rlreplay.text import token2text
    except ImportError:
        return None
    name = token2text.resolve_tokenizer(run, tokenizer)
    if not name:
        return None
    try:
        return token2text.Decoder.load(name)
    except RunError as exc:
        if tokenizer:
            raise
        warn(f"{exc}; uploading token ids without text")
        return None


class Progress(Protocol):
    """Receives progress from :func:`upload` (possibly from the sender thread)."""

    def start(self, total: int) -> None: ...

    def set_total(self, total: int) -> None: ...

    def advance(self, trajectories: int, nbytes: int) -> None: ...


class _NoProgress:
    def start(self, total: int) -> None:
        pass

    def set_total(self, total: int) -> None:
        pass

    def advance(self, trajectories: int, nbytes: int) -> None:
        pass


@dataclass
class Failure:
    trajectory_id: str
    error: str
    attempts: int


@dataclass
class UploadSummary:
    backend: str
    target: str
    dry_run: bool
    groups: int = 0  # groups (samples × step × split) kept after the byte budget
    selected: int = 0  # trajectories in those groups
    selected_bytes: int = 0  # their bytes, counting those already uploaded
    already_uploaded: int = 0
    to_send: int = 0
    replaced: int = 0  # of to_send: already uploaded, sent again (with text now, or --resend)
    sent: int = 0
    failed: int = 0
    not_attempted: int = 0  # left after the upload gave up
    bytes: int = 0  # bytes sent (dry run: bytes that would be sent)
    over_budget_groups: int = 0
    over_budget_trajectories: int = 0
    seconds: float = 0.0
    text: str | None = None  # tokenizer used for token2text, if any
    error: str | None = None  # why the upload stopped early
    resumable: bool = False  # stopped by the server (no answer in time): rerun later to resume
    on_server: int | None = None  # dry run with --check-server: selected trajectories the server has
    failures: list[Failure] = field(default_factory=list)
    ids: list[str] | None = None  # dry run: the trajectories that would be sent

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.not_attempted == 0 and self.error is None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["ids"] is None:
            del out["ids"]
        return out


class _Sender:
    """One background thread that sends batches, retries, and records successes in the ledger."""

    def __init__(
        self,
        uploader: Uploader,
        ledger: Ledger,
        summary: UploadSummary,
        progress: Progress,
        retries: int,
        backoff_s: float,
    ) -> None:
        self.uploader = uploader
        self.ledger = ledger
        self.summary = summary
        self.progress = progress
        self.retries = retries
        self.backoff_s = backoff_s
        self.queue: queue.Queue[list[Prepared] | None] = queue.Queue(maxsize=2)
        self.fatal: str | None = None
        self.fatal_resumable = False
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._failed_batches = 0
        self.thread = threading.Thread(target=self._loop, name="rlreplay-upload", daemon=True)
        self.thread.start()

    def submit(self, batch: list[Prepared]) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(batch, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.2)
                break
            except queue.Full:
                continue
        self.thread.join()

    def abort(self) -> None:
        """Stop after the batch in flight (if any): queued batches are dropped, not sent."""
        self.stopping.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)
        self.thread.join(timeout=REQUEST_WAIT_S)

    def _loop(self) -> None:
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            if self.stopping.is_set():
                continue  # counted as not attempted at the end
            try:
                self._send(batch)
            except Exception as exc:  # an UploadError, or a bug in a backend: stop, report
                from rlreplay.uploaders.base import RequestTimeout

                self.fatal = _one_line(exc)
                self.fatal_resumable = isinstance(exc, RequestTimeout)
                self.stopping.set()

    def _send(self, batch: list[Prepared]) -> None:
        from rlreplay.uploaders.base import SendResult, UploadError

        todo = batch
        attempt = 0
        any_ok = False
        while todo:
            attempt += 1
            try:
                results = list(self.uploader.send(todo))
            except UploadError:
                raise
            except Exception as exc:  # the backend did not sort it out: treat as transient
                message = _one_line(exc)
                results = [SendResult(p.trajectory_id, p.backend_id, False, 0, message, True) for p in todo]
            by_id = {r.trajectory_id: r for r in results}
            for p in todo:  # a backend that forgot an item did not send it
                if p.trajectory_id not in by_id:
                    by_id[p.trajectory_id] = SendResult(
                        p.trajectory_id, p.backend_id, False, 0, "no result", True
                    )
            ok = [r for r in by_id.values() if r.ok]
            self.ledger.record(ok, text={p.trajectory_id: p.text for p in todo})
            done_bytes = sum(r.nbytes for r in ok)
            retry, final = [], []
            for p in todo:
                r = by_id[p.trajectory_id]
                if r.ok:
                    continue
                (retry if r.retryable and attempt <= self.retries else final).append((p, r))
            with self._lock:
                self.summary.sent += len(ok)
                self.summary.bytes += done_bytes
                self.summary.failed += len(final)
                self.summary.failures.extend(
                    Failure(p.trajectory_id, r.error or "failed", attempt) for p, r in final
                )
            self.progress.advance(len(ok) + len(final), done_bytes)
            any_ok = any_ok or bool(ok)
            todo = [p for p, _ in retry]
            if todo and self.stopping.wait(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))):
                return  # stopping during a backoff: the rest counts as not attempted
        self._failed_batches = 0 if any_ok else self._failed_batches + 1
        if self._failed_batches >= GIVE_UP_AFTER:
            raise UploadError(
                f"giving up after {GIVE_UP_AFTER} batches failed in a row "
                f"(last error: {self.summary.failures[-1].error if self.summary.failures else 'unknown'})"
            )


def _chunks(groups: Sequence[Group], size: int) -> Iterator[list[Group]]:
    """Runs of consecutive groups of one step, about ``size`` trajectories each (groups stay whole)."""
    chunk: list[Group] = []
    count = 0
    for group in groups:
        if chunk and (group.step != chunk[0].step or count + len(group.ids) > size):
            yield chunk
            chunk, count = [], 0
        chunk.append(group)
        count += len(group.ids)
    if chunk:
        yield chunk


def upload(
    run: Run,
    uploader: Uploader,
    groups: Sequence[Group],
    *,
    decoder: Any = None,
    max_bytes: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    batch_size: int = DEFAULT_BATCH,
    retries: int = DEFAULT_RETRIES,
    backoff_s: float | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> UploadSummary:
    """Send the trajectories of ``groups`` (in order) that the backend does not have yet.

    ``groups`` come from :func:`rlreplay.read.selection.select`. With ``max_bytes``, groups are kept
    while the bytes of everything kept (already uploaded or not) fit. With ``dry_run`` nothing
    is sent and nothing is written; the summary says what would be sent and its bytes.

    A backend that can upsert (``can_upsert``) gets again, under the same ids, what it was sent
    without text when ``decoder`` can now decode it, and everything selected with ``force``.

    A failed trajectory is retried up to ``retries`` times, the first after ``backoff_s`` seconds
    (default: ``$RLREPLAY_UPLOAD_BACKOFF_S``), each next wait twice the last, at most MAX_BACKOFF_S.
    """
    from rlreplay.uploaders.base import Ledger

    if batch_size < 1:
        raise RunError("batch size must be at least 1")
    if backoff_s is None:
        backoff_s = settings.UPLOAD_BACKOFF_S.get()
    progress = progress or _NoProgress()
    warn = warn or (lambda message: None)
    started = time.perf_counter()
    ledger = Ledger.open(run.path, uploader.backend, uploader.target(), create=not dry_run)
    summary = UploadSummary(
        backend=uploader.backend,
        target=uploader.target(),
        dry_run=dry_run,
        text=getattr(decoder, "name", None),
        ids=[] if dry_run else None,
    )
    if hasattr(uploader, "decoder"):  # a backend that builds chat messages decodes with it
        uploader.decoder = decoder
    can_upsert = bool(getattr(uploader, "can_upsert", False))
    if force and not can_upsert:
        raise RunError(f"--resend: the {uploader.backend} backend cannot replace traces it has (no upsert)")
    selected_ids = {i for g in groups for i in g.ids}
    if force:
        redo = ledger.done() & selected_ids
    elif decoder is not None and can_upsert:
        redo = ledger.without_text() & selected_ids
    else:
        redo = set()
    done = ledger.done() - redo
    progress.start(sum(1 for g in groups for i in g.ids if i not in done))
    sender = None if dry_run else _Sender(uploader, ledger, summary, progress, retries, backoff_s)
    pending: list[Prepared] = []
    used = 0
    kept = 0  # groups processed (within the budget)
    over_budget = False
    missing_from_run: list[Failure] = []
    text_failed = False
    try:
        for chunk in _chunks(groups, batch_size):
            if sender is not None and sender.fatal:
                break
            missing = [i for g in chunk for i in g.ids if i not in done]
            trajs = run.load(missing, Filters(step=chunk[0].step)) if missing else []
            if decoder is not None and trajs and not text_failed:
                try:
                    from rlreplay.adapters.registry import adapter_for_run
                    from rlreplay.text.token2text import add_text

                    add_text(trajs, decoder, adapter=adapter_for_run(run))
                except (ValueError, RunError) as exc:
                    text_failed = True
                    warn(f"token2text failed ({_one_line(exc)}); uploading token ids without text")
            for traj in trajs:  # kept bytes (the proxy's wire) as text a person reads
                for span in traj.spans:
                    span.inputs, span.output = readable(span.inputs), readable(span.output)
            prepared = {p.trajectory_id: p for p in uploader.prepare(trajs)}
            with_text = decoder is not None and not text_failed
            for p in prepared.values():
                p.text = with_text
            stop = False
            for group in chunk:
                size = sum(prepared[i].nbytes if i in prepared else ledger.nbytes(i) for i in group.ids)
                if max_bytes is not None and used + size > max_bytes:
                    stop = over_budget = True
                    break
                used += size
                kept += 1
                summary.groups += 1
                summary.selected += len(group.ids)
                for traj_id in group.ids:
                    if traj_id in done:
                        summary.already_uploaded += 1
                    elif traj_id in prepared:
                        summary.to_send += 1
                        summary.replaced += traj_id in redo
                        pending.append(prepared[traj_id])
                        if summary.ids is not None:
                            summary.ids.append(traj_id)
                    else:  # listed but not loadable (a file went away meanwhile, or was refused)
                        why = (
                            "in a span file that could not be read"
                            if run.unreadable
                            else "not found in the run"
                        )
                        missing_from_run.append(Failure(traj_id, why, 0))
            if dry_run:
                summary.bytes += sum(p.nbytes for p in pending)
                pending = []
            while sender is not None and len(pending) >= batch_size:
                sender.submit(pending[:batch_size])
                pending = pending[batch_size:]
            if stop:
                break
        if sender is not None:
            if pending:
                sender.submit(pending)
            sender.finish()
    except BaseException:  # Ctrl-C included: stop after the batch in flight (its ledger lines land)
        if sender is not None:
            sender.abort()
        raise
    rest = groups[kept:]
    if over_budget:
        summary.over_budget_groups = len(rest)
        summary.over_budget_trajectories = sum(len(g.ids) for g in rest)
        progress.set_total(summary.to_send)
    summary.selected_bytes = used
    summary.failed += len(missing_from_run)
    summary.failures.extend(missing_from_run)
    if sender is not None:
        summary.error = sender.fatal
        summary.resumable = sender.fatal_resumable
        tried = summary.sent + sum(1 for f in summary.failures if f.attempts > 0)
        summary.not_attempted = summary.to_send - tried
        if not over_budget:  # stopped early: later groups were never prepared
            summary.not_attempted += sum(1 for g in rest for i in g.ids if i not in done)
    with_close = getattr(uploader, "close", None)
    if with_close is not None and not dry_run:
        with_close()
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _one_line(exc: BaseException) -> str:
    return " ".join((str(exc) or type(exc).__name__).split())[:300]
