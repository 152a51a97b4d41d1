"""What the web app reads: the runs under its root, cached listings, selections, per-step stats.

Every path the app touches comes from listing the root folder, never from a request: a request
names a run by a name found there and a trajectory by its hex id.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlreplay.errors import NotFound, RunError
from rlreplay.format import manifest
from rlreplay.format.keys import parse_int
from rlreplay.model import listing_rows
from rlreplay.read.filters import Filters
from rlreplay.read.open import open_run
from rlreplay.read.run import Run
from rlreplay.read.selection import Selection, listing
from rlreplay.remote.location import as_uri

SPANS_DIR = "spans"
WORKERS_DIR = "_workers"
PAGE_SIZES = (25, 50, 100, 200, 500)
DEFAULT_PAGE_SIZE = 100
SLOW_LISTING_S = 0.5  # re-read a listing that took longer than this in the background
SELECTIONS_KEPT = 4  # a listing's latest selections: paging and prev/next do not query again


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / manifest.MANIFEST).is_file() or (path / SPANS_DIR).is_dir())


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:
        return False


class RunSet:
    """One run, or every run directly inside a folder (runs appear as they are created)."""

    def __init__(self, root: str | os.PathLike[str], tokenizer: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()
        self.uri = as_uri(root)  # one run on an object store
        if self.uri is not None:
            run = open_run(self.uri)
            self.root, self.single, self.name, self.address = run.path, True, run.name, run.address
            self._add_view(run.name, run)
            return
        path = Path(root)
        if not path.is_dir():
            raise RunError(f"no run or folder of runs at {path}")
        self.root = path.resolve()
        self.name = self.root.name
        self.address = str(self.root)  # as shown to a user
        self.single = is_run_dir(self.root)
        if self.single:
            open_run(self.root)  # fails early on an unreadable manifest

    def without_paths(self, text: str) -> str:
        """A message (an error, a warning) as a page shows it: this machine's folders of the runs
        shown become the runs' names, the user's home folder ``~``; no page shows a local path."""
        swaps = [(str(view.run.path), name) for name, view in self._views.items()]
        if self.uri is None:
            swaps += [(f"{self.root}/", f"{self.name}/" if self.single else ""), (str(self.root), self.name)]
        home = os.path.expanduser("~").rstrip("/")
        if home:
            swaps += [(f"{home}/", "~/"), (home, "~")]
        for local, shown in sorted(swaps, key=lambda s: -len(s[0])):
            text = text.replace(local, shown)
        return text

    def names(self) -> list[str]:
        if self.single:
            return [self.name]
        found = []
        for entry in os.scandir(self.root):
            path = Path(entry.path)
            # a symlink leading out of the folder is not one of its runs
            if not entry.name.startswith(".") and _inside(path, self.root) and is_run_dir(path):
                found.append(entry.name)
        return sorted(found)

    def get(self, name: str) -> RunView:
        if name not in self.names():
            raise NotFound(f"no run named {name!r}")
        with self._lock:
            view = self._views.get(name)
            if view is None:
                view = self._add_view(name, open_run(self.root if self.single else self.root / name))
            return view

    def _add_view(self, name: str, run: Run) -> RunView:
        view = self._views[name] = RunView(run, self.tokenizer)
        threading.Thread(target=view.decoder, daemon=True).start()  # load the tokenizer early
        return view


# ---- a run, cached by the files it holds ------------------------------------------------------


#: the runs whose files were looked at in this request (None outside one)
_looked: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("looked", default=None)


@contextlib.contextmanager
def one_look() -> Iterator[None]:
    """Within: each run's files are looked at once, so that a page shows one version of a run
    and does not list a big run's files again for every part of it."""
    token = _looked.set(set())
    try:
        yield
    finally:
        _looked.reset(token)


def run_base(name: str) -> str:
    """The URL prefix of a run's pages."""
    from urllib.parse import quote

    return "/r/" + quote(name, safe="")


class RunView:
    """A run with its listing cached until its files change, and its tokenizer loaded once."""

    def __init__(self, run: Run, tokenizer: str | None = None) -> None:
        self.run = run
        self.tokenizer = tokenizer  # overrides the run's manifest
        self.name = run.path.name
        self.base = run_base(self.name)
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._listing: tuple[tuple[Any, ...], pa.Table] | None = None
        self._build_s = 0.0
        self._refreshing = False
        self._unreadable_why: str | None = None
        self._counters: dict[str, int] | None = None
        self._decoder: Any = None
        self._decoder_error: str | None = None
        self._decoder_loaded = False
        self._findings: tuple[pa.Table, Any] | None = None
        self._mismatch: tuple[pa.Table, dict[str, Any]] | None = None
        self._listing_findings: tuple[pa.Table, list[Any]] | None = None
        self._stats: tuple[pa.Table, list[dict[str, Any]]] | None = None
        self._checks: list[Any] | None = None
        self._prompts: dict[str, str] = {}
        self._texts: Any = None  # the run's searched texts, once a search asked for them
        self._selections: tuple[pa.Table | None, dict[tuple[str, ...], pa.Table]] = (None, {})
        self._version: tuple[tuple[Any, ...] | None, str] = (None, "")

    def version(self) -> str:
        """Changes when the data the pages show changes (the files, once their listing is read)."""
        self.listing()
        sig = self._listing[0] if self._listing is not None else ()
        if self._version[0] is not sig:
            text = f"{len(sig)}-{sum(s[1] for s in sig)}-{max((s[2] for s in sig), default=0)}"
            self._version = (sig, text)
        return self._version[1]

    def manifest(self) -> dict[str, Any]:
        try:
            return manifest.read_manifest(self.run.path)
        except (OSError, ValueError):
            return dict(self.run.manifest)

    def recording(self) -> bool:
        """Whether a recorder holds a lease on the run now (read only: stale leases stay)."""
        from rlreplay.shards.layout import LEASE_DIR
        from rlreplay.shards.lease import is_live

        folder = getattr(self.run, "path", None)
        if not isinstance(folder, Path):
            return False
        return any(is_live(p) for p in (folder / LEASE_DIR).glob("_lease-*.lock"))

    def counters(self) -> dict[str, int]:
        """The run's counters; when they cannot be read (its store cut), those read last."""
        try:
            self._counters = self.run.counters()
        except (RunError, OSError) as exc:
            if self._counters is None:
                raise
            self._unreadable(exc)
        return dict(self._counters)

    def listing(self) -> pa.Table:
        """Every trajectory of the run (the ``ls`` columns), re-read only when files change.

        When re-reading took long (a big run being recorded), pages keep the previous listing
        while a background thread reads the new one; ``version`` changes when it is ready.
        Within :func:`one_look`, the files are looked at once.
        """
        looked = _looked.get()
        if looked is not None and id(self) in looked and self._listing is not None:
            return self._listing[1]
        if looked is not None:
            looked.add(id(self))
        cached = self._listing
        try:
            sig = self.run.file_signature()
        except (RunError, OSError) as exc:
            if cached is None:
                raise
            self._unreadable(exc)  # the store unreachable: the run as it was
            return cached[1]
        if cached is not None and cached[0] == sig:
            return cached[1]
        if cached is not None and self._build_s > SLOW_LISTING_S:
            with self._lock:
                if not self._refreshing:
                    self._refreshing = True
                    threading.Thread(target=self._refresh, args=(sig,), daemon=True).start()
            return cached[1]
        return self._build(sig)

    def _refresh(self, sig: tuple[Any, ...]) -> None:
        """``_build`` in the background. When the run cannot be read (its object store unreachable),
        pages keep the listing they have, the terminal gets one line (once per cause), and the next
        look tries again."""
        try:
            self._build(sig)
            self._unreadable_why = None
        except (RunError, OSError) as exc:
            self._unreadable(exc)

    def _unreadable(self, exc: BaseException) -> None:
        """One line in the terminal (once per cause) when the run cannot be read again."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        if why != self._unreadable_why:
            self._unreadable_why = why
            sys.stderr.write(f"rlreplay ui: could not re-read {self.name}, showing it as it was: {why}\n")

    def _build(self, sig: tuple[Any, ...]) -> pa.Table:
        with self._build_lock:
            try:
                cached = self._listing
                if cached is not None and cached[0] == sig:
                    return cached[1]
                start = time.perf_counter()
                table = listing(self.run)
                # what every page shows from a listing is ready before it is: a page never waits
                # for the per-step stats or the listing checks (seconds on a big run)
                self._stats = (table, step_stats(table))
                self._listing_findings = (table, self._check_listing(table))
                self._build_s = time.perf_counter() - start
                self._listing = (sig, table)
                return table
            finally:
                self._refreshing = False

    def selected(self, q: Selection) -> pa.Table:
        """:func:`select` over the listing, the latest few kept until the listing changes."""
        table = self.listing()
        key = tuple(getattr(q, f.name) for f in fields(Selection))
        with self._lock:
            owner, kept = self._selections
            if owner is not table:
                owner, kept = table, {}
                self._selections = (owner, kept)
            found = kept.pop(key, None)
            if found is not None:
                kept[key] = found  # the latest used last
                return found
        found = select(table, q, self.texts() if q.grep is not None else None)
        with self._lock:
            kept[key] = found
            while len(kept) > SELECTIONS_KEPT:
                kept.pop(next(iter(kept)))
        return found

    def row(self, traj_id: str) -> dict[str, Any] | None:
        table = self.listing()
        found = table.filter(pc.equal(table["id"], traj_id))
        return found.to_pylist()[0] if found.num_rows else None

    def trajectory(self, ref: str) -> Any:
        """One trajectory by id or unique prefix; the cached listing tells its step, so only that
        step's files are read."""
        if not re.fullmatch(r"[0-9a-fA-F]{1,64}", ref or ""):
            raise NotFound(f"not a trajectory id: {ref!r}")
        ref = ref.lower()
        table = self.listing()
        found = table.filter(pc.starts_with(table["id"], ref)).select(["id", "step"]).to_pylist()
        if len(found) == 1 and isinstance(found[0]["step"], int):
            # the step's index tells the row groups that hold it: only these are read
            loaded = self.run.load([found[0]["id"]], Filters(step=found[0]["step"]))
            if loaded:
                return loaded[0]
        try:
            return self.run.trajectory(ref)
        except RunError as exc:
            raise NotFound(str(exc)) from None

    def decoder(self) -> Any:
        """The run's tokenizer, or None (``decoder_error`` says why)."""
        with self._lock:
            if not self._decoder_loaded:
                from rlreplay.text.token2text import Decoder, resolve_tokenizer

                # the manifest as it is now: a live run may name its tokenizer after it was opened
                current = SimpleNamespace(path=self.run.path, manifest=self.manifest())
                name = resolve_tokenizer(current, self.tokenizer)
                if name is None:
                    self._decoder_error = "no tokenizer is named in the run's manifest: showing token ids"
                    return None
                self._decoder_loaded, self._decoder_error = True, None
                try:
                    self._decoder = Decoder.load(name)
                except RunError as exc:
                    self._decoder_error = f"{exc} (showing token ids)"
            return self._decoder

    def findings(self) -> Any:
        """The audit of the whole run (every check), redone when the listing changes."""
        from rlreplay.audit import engine

        table = self.listing()
        cached = self._findings
        if cached is None or cached[0] is not table:
            report = engine.audit(self.run, table, self.checks(), tokenizer=self.tokenizer)
            self._findings = cached = (table, report)
        return cached[1]

    def mismatch(self, by: str = "step") -> Any:
        """``rlreplay mismatch``'s report of the whole run (by ``by``), redone when the listing
        changes; a ``RunError`` when the run keeps no per-token trainer log-probs."""
        from rlreplay.mismatch.report import compute

        table = self.listing()
        if self._mismatch is None or self._mismatch[0] is not table:
            self._mismatch = (table, {})
        kept = self._mismatch[1]
        if by not in kept:
            try:
                kept[by] = compute(self.run, table, by=by, decoder=self.decoder())
            except RunError as exc:
                kept[by] = exc
        found = kept[by]
        if isinstance(found, RunError):
            raise found
        return found

    def stats(self) -> list[dict[str, Any]]:
        """:func:`step_stats` of the listing, redone when the listing changes."""
        table = self.listing()
        if self._stats is None or self._stats[0] is not table:
            self._stats = (table, step_stats(table))
        return self._stats[1]

    def prompts(self, ids: list[str], step: Any) -> dict[str, str]:
        """Each trajectory's first user message (its question, no chat template), by id."""
        from rlreplay.format.schema import KIND_AGENT, KIND_TRAJECTORY
        from rlreplay.ui.views import prompt_text, recorded_prompt

        missing = [i for i in ids if i not in self._prompts]
        decoder = self.decoder() if missing else None
        if decoder is not None:  # without a tokenizer there is no prompt text: nothing to read
            adapter = self.adapter()
            # the agent spans first: the chat messages recorded there are the prompt
            for traj in self.run.load(missing, Filters(step=step), kinds=(KIND_TRAJECTORY, KIND_AGENT)):
                text = recorded_prompt(traj, adapter)
                if text is not None:
                    self._prompts[traj.id] = text
            rest = [i for i in missing if i not in self._prompts]
            for traj in self.run.load(rest, Filters(step=step)):
                self._prompts[traj.id] = prompt_text(traj, decoder, adapter)
        return {i: self._prompts.get(i, "") for i in ids}

    def listing_findings(self) -> list[Any]:
        """What the checks over the listing find (the whole audit's findings once it ran)."""
        table = self.listing()
        if self._findings is not None and self._findings[0] is table:
            return list(self._findings[1].findings)
        if self._listing_findings is None or self._listing_findings[0] is not table:
            self._listing_findings = (table, self._check_listing(table))
        return self._listing_findings[1]

    def counted_findings(self) -> tuple[list[Any], str]:
        """The findings the front page counts now, and what they are: the whole audit's (every
        check, as ``rlreplay audit``) once it ran, else what the checks over the listing find."""
        table = self.listing()
        if self._findings is not None and self._findings[0] is table:
            report = self._findings[1]
            skipped = [f"{name} (skipped: {why})" for name, why in report.skipped.items()]
            what = "every check, as rlreplay audit" + (f"; {', '.join(skipped)}" if skipped else "")
            return list(report.findings), what
        from rlreplay.audit.finding import OVER_LISTING

        names = [c.name for c in self.checks() if c.over == OVER_LISTING]
        what = (
            f"only the checks over the listing: {', '.join(names)}"
            + (" (without its per-step verdicts from per-token log-probs)" if "mismatch" in names else "")
            + "; the findings page runs every check"
        )
        return self.listing_findings(), what

    def _check_listing(self, table: pa.Table) -> list[Any]:
        from rlreplay.audit import engine
        from rlreplay.audit.finding import OVER_LISTING

        over_listing = [c for c in self.checks() if c.over == OVER_LISTING]
        # the per-step mismatch verdicts read every token: the findings page's whole audit has them
        return engine.audit(self.run, table, over_listing, {"mismatch_steps": 0.0}).findings

    def checks(self) -> list[Any]:
        """The installed audit checks, found once (looking up plug-ins takes 0.1-0.3 s)."""
        from rlreplay.audit import engine

        if self._checks is None:
            self._checks = list(engine.available().values())
        return self._checks

    def trajectory_findings(self, traj: Any) -> list[Any]:
        """What the audit checks find in one trajectory: its listing findings (its own and its
        group's) and the trajectory checks run on it now."""
        from rlreplay.audit import engine
        from rlreplay.audit.finding import Context

        checks = self.checks()
        table = self.listing()
        if self._findings is not None and self._findings[0] is table:
            return engine.about(self._findings[1].findings, traj)
        ctx = Context(engine.default_thresholds(checks), self.adapter(), self.decoder())
        return engine.about(self.listing_findings(), traj) + engine.check_trajectory(traj, checks, ctx)

    def adapter(self) -> Any:
        from rlreplay.adapters.registry import adapter_for_run

        return adapter_for_run(self.run)

    def texts(self) -> Any:
        """The run's searched texts (``rlreplay.read.search``), decoded once and kept; a run without
        a tokenizer cannot be searched (``RunError`` saying why)."""
        from rlreplay.read.search import TextSearch

        decoder = self.decoder()
        if decoder is None:
            raise RunError(f"search needs the run's tokenizer: {self.decoder_error or 'none loads'}")
        with self._lock:
            if self._texts is None or self._texts.source != getattr(decoder, "source", None):
                self._texts = TextSearch(self.run, decoder, self.adapter())
            return self._texts

    @property
    def decoder_error(self) -> str | None:
        return self._decoder_error


# ---- selection: the grammar of ``ls`` ----------------------------------------------------------


@dataclass
class ListQuery(Selection):
    """The trajectory list's query string: a selection by the CLI's names (``validate``; the
    older ``split=train|val`` too), and how the list shows it."""

    cols: str = ""  # the list's columns, comma-separated ("" for the default ones)
    page: int = 1
    per: int = DEFAULT_PAGE_SIZE

    @classmethod
    def from_params(cls, params: Any) -> ListQuery:
        shown: dict[str, Any] = {}
        chosen = params.getlist("col") if hasattr(params, "getlist") else []
        if chosen:
            shown["cols"] = ",".join(chosen)
        for name in ("page", "per"):
            raw = params.get(name)
            if raw is None:
                continue
            number = parse_int(str(raw))
            if number is None:
                raise RunError(f"{name} must be a whole number, not {raw!r}")
            shown[name] = max(1, number)
        if params.get("cols") is not None:
            shown["cols"] = str(params.get("cols")).strip()
        selection = Selection.from_params(params)
        q = cls(**{f.name: getattr(selection, f.name) for f in fields(Selection)}, **shown)
        q.per = min(q.per, PAGE_SIZES[-1])
        return q

    def selection(self) -> Selection:
        """The selection alone (what the list shows, not how)."""
        return Selection(**{f.name: getattr(self, f.name) for f in fields(Selection)})

    def params(self, **override: Any) -> dict[str, str]:  # type: ignore[override]
        """The query's parameters that are set (for links), with ``override`` applied."""
        shown = {"cols": self.cols, "page": self.page, "per": self.per}
        shown.update((k, v) for k, v in override.items() if k in shown)
        chosen = replace(self.selection(), **{k: v for k, v in override.items() if k not in shown})
        defaults = ListQuery()
        return {
            **Selection.params(chosen),
            **{k: str(v) for k, v in shown.items() if v not in ("", None) and v != getattr(defaults, k)},
        }


def select(table: pa.Table, q: Selection, texts: Any = None) -> pa.Table:
    """The rows of the listing ``q`` asks for, in its order (not paginated): ``ls``'s selection
    (``texts``: the run's searched texts, for ``grep``)."""
    return q.apply(table, texts=texts)


@dataclass
class Page:
    rows: list[dict[str, Any]]
    total: int
    page: int
    pages: int
    per: int


def paginate(table: pa.Table, q: ListQuery) -> Page:
    pages = max(1, math.ceil(table.num_rows / q.per))
    page = min(q.page, pages)
    rows = listing_rows(table.slice((page - 1) * q.per, q.per))
    return Page(rows, table.num_rows, page, pages, q.per)


# ---- per-step statistics -----------------------------------------------------------------------


_QUANTILES_SQL = """
SELECT step, validate,
    quantile_cont(reward, 0.1) AS reward_p10,
    quantile_cont(reward, 0.9) AS reward_p90,
    quantile_cont(response_tokens, 0.5) AS response_tokens_p50
FROM trajectories GROUP BY step, validate
"""


def step_stats(table: pa.Table) -> list[dict[str, Any]]:
    """Per step and split: the columns of ``rlreplay stats`` (validation after training)."""
    from rlreplay.read.query import stats_of

    if table.num_rows == 0:
        return []
    rows = stats_of(table).to_pylist()
    extra = {(r["step"], bool(r["validate"])): r for r in _quantiles(table)}
    for row in rows:
        row["validate"] = bool(row["validate"])
        more = extra.get((row["step"], row["validate"]), {})
        for key in ("reward_p10", "reward_p90", "response_tokens_p50"):
            row[key] = more.get(key)
    return sorted(rows, key=lambda r: r["validate"])


def _quantiles(table: pa.Table) -> list[dict[str, Any]]:
    from rlreplay.read.query import register_trajectories
    from rlreplay.read.where import run_query, shared_connection

    con = shared_connection()
    register_trajectories(con, table)
    try:
        return run_query(con, _QUANTILES_SQL, "stats").to_pylist()
    finally:
        con.unregister("trajectories")
