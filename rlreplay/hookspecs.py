"""The plug-in interfaces, in one module: a framework adapter, an uploader backend, an audit check.

A plug-in is a ``"module:attribute"`` entry point in its kind's group (:data:`GROUPS`); rlreplay's
own are registered the same way in ``pyproject.toml``, and ``rlreplay.plugins`` loads them all:

- ``rlreplay.adapters``: a :class:`FrameworkAdapter` class or instance (one per RL framework);
- ``rlreplay.uploaders``: an :class:`Uploader` class (one per tracing backend);
- ``rlreplay.checks``: a :class:`Check` value (one per problem ``rlreplay audit`` looks for).

Nothing is imported at run time but the standard library: the types the interfaces name are
imported for type checkers only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rlreplay.model import Span, Trajectory
    from rlreplay.text.conversation import BatchDecoder, Turn
    from rlreplay.uploaders.base import BackendOption, Prepared, SendResult

#: Entry-point groups per kind of plug-in; a later group wins. ``rlreplay.recorders`` is the
#: adapters' former group, still read for one release.
GROUPS: dict[str, tuple[str, ...]] = {
    "adapters": ("rlreplay.recorders", "rlreplay.adapters"),
    "uploaders": ("rlreplay.uploaders",),
    "checks": ("rlreplay.checks",),
}


# ---- framework adapter -------------------------------------------------------------------------


@runtime_checkable
class FrameworkAdapter(Protocol):
    """Everything rlreplay knows about one RL framework: how to hook it into a recording process,
    how its traced methods map to span kinds, which recorded fields hold token ids, how a trajectory
    becomes turns and chat messages, what its calls say about themselves, and how a replay serves
    them. ``rlreplay.adapters.generic.GenericAdapter`` implements all of it; a framework's adapter
    subclasses it and overrides what differs. A run names its framework in ``run.json``."""

    #: the name ``--framework`` and ``run.json`` give it
    name: str

    def install(self) -> None:
        """Hook the framework into this process (``rlreplay record --framework NAME``)."""
        ...

    def span_kind(self, qualname: str) -> str:
        """The span kind (``rlreplay.format.kinds``) of a traced method, from its qualified name."""
        ...

    def token_fields(self, kind: str) -> dict[str, tuple[str, ...]]:
        """The ``inputs``/``output`` fields of a span of ``kind`` that hold token ids."""
        ...

    def turns(self, traj: Trajectory) -> list[Turn]:
        """The trajectory as a conversation: the prompt, then assistant and tool turns."""
        ...

    def messages(self, traj: Trajectory, decoder: BatchDecoder | None) -> list[dict[str, Any]]:
        """The trajectory as OpenAI chat messages."""
        ...

    def call_ids(self, span: Span) -> tuple[list[int] | None, list[int] | None]:
        """(prompt ids, response ids) of a model call, None where not recorded."""
        ...

    def stop_reason(self, span: Span) -> str | None:
        """Why a model call stopped, when recorded."""
        ...

    def max_tokens(self, span: Span) -> int | None:
        """The most tokens a model call was allowed to generate, when its request said."""
        ...

    def tool_error(self, span: Span) -> str | None:
        """What went wrong in a tool call; None when nothing did. The listing's ``tool_errors``
        counts by ``rlreplay.format.tool_errors`` (the generic adapter's answer): an adapter that
        answers otherwise makes ``audit`` disagree with the listing."""
        ...

    def parse_error(self, span: Span) -> str | None:
        """What went wrong in a tool-call parser's call; None when nothing did."""
        ...

    def rebuild_output(self, name: str, kind: str, output: Any, output_type: dict[str, str] | None) -> Any:
        """What the op returned, from its recorded output's JSON form and type record
        (``rlreplay.format.payload.from_json``; None for spans recorded before outputs had one),
        for a replay to serve: the framework's own types rebuilt where the record names them.
        Raises ``payload.NotExact`` (or any error) when it cannot give the value back exactly: the
        call is then not served."""
        ...

    def volatile_keys(self) -> frozenset[str]:
        """Keys (at any depth of inputs and outputs) whose values differ between two runs of the
        same rollout (per-call ids, wall times): replay's matching and ``compare`` leave them out."""
        ...

    def tokenizer_from_argv(self, argv: list[str]) -> str | None:
        """The tokenizer a training command line names, if any."""
        ...

    def experiment_from_argv(self, argv: list[str]) -> str | None:
        """The experiment a training command line names, if any."""
        ...


# ---- uploader ----------------------------------------------------------------------------------


@runtime_checkable
class Uploader(Protocol):
    """What a backend class provides (class attributes, a factory, and the instance methods).

    - ``backend``: its name (the entry point's name);
    - ``options``: the ``BackendOption`` s it takes beyond the common ones;
    - ``requires``: the modules it imports when it runs (a missing one names the extra to install);
    - ``can_upsert``: sending a trace again replaces it (same ids), so a rerun that can now
      decode may replace traces sent without text, and ``--force`` may re-send;
    - ``from_options(BackendOptions)``: the uploader for a run (classmethod; without it the
      class is called with the project);
    - ``existing(trajectory_ids)``: which of them the server already holds (``None``: cannot tell).

    The shared machinery (selection, token2text, batching, retries, deadlines, ledger, progress)
    is ``rlreplay.uploaders.pipeline``; a backend never sees it, and it never sees a wire format.
    """

    backend: str
    options: ClassVar[tuple[BackendOption, ...]]
    requires: ClassVar[tuple[str, ...]]
    can_upsert: ClassVar[bool]

    def target(self) -> str:
        """Where uploads go (e.g. ``mlflow:http://host:5000#experiment``); keys the ledger."""
        ...

    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        """Convert trajectories (text already decoded) into wire payloads; no network."""
        ...

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        """Send one batch; one result per prepared item. Raise UploadError only for fatal errors."""
        ...

    def existing(self, trajectory_ids: Sequence[str]) -> set[str] | None:
        """The trajectories among ``trajectory_ids`` the server already has; None if it cannot tell."""
        ...

    def close(self) -> None: ...


# ---- audit check -------------------------------------------------------------------------------

#: What a check reads: the listing (the run index, one row per trajectory) or each trajectory's spans.
OVER_LISTING, OVER_TRAJECTORIES = "listing", "trajectories"
#: What one finding is about.
LEVEL_TRAJECTORY, LEVEL_GROUP, LEVEL_STEP = "trajectory", "group", "step"
ERROR, WARNING = "error", "warning"


@dataclass
class Finding:
    """One problem found: a trajectory (``trajectory_id`` set), a group or a step range (null id)."""

    check: str
    trajectory_id: str | None
    step: Any
    sample_index: Any
    rollout_n: Any
    validate: bool | None
    severity: str
    detail: str
    turn: int | None = None
    position: int | None = None
    #: how bad, to order examples (larger is worse); not part of the record
    score: float = field(default=0.0, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("score")
        return out


@dataclass(frozen=True)
class Check:
    """A check: ``run(listing, context)`` over the listing, or ``run(trajectory, context)`` over
    each trajectory; either yields ``Finding``s. ``help`` says what it flags (``audit --help``)."""

    name: str
    over: str
    level: str
    help: str
    run: Callable[..., Iterable[Finding]]
    #: the thresholds it reads, with their defaults
    thresholds: dict[str, float] = field(default_factory=dict)
    #: needs a tokenizer to decode text (skipped with a note without one)
    needs_tokenizer: bool = False
    #: a trajectory check that reads only spans of these kinds: it may be given trajectories
    #: holding only those spans, without children or attributes, their token ids lists or numpy
    #: arrays (None: whole trajectories)
    span_kinds: tuple[str, ...] | None = None


@dataclass
class Context:
    """What a check gets besides its data: thresholds, the run's framework adapter, a decoder, and
    the run (a listing check that reads a few flagged trajectories' spans)."""

    thresholds: dict[str, float]
    adapter: FrameworkAdapter | None = None
    decoder: Any = None
    run: Any = None
    #: ``--engine ray``: ``pieces(listing, limits)`` gives the mismatch report's step pieces and
    #: counts made on a cluster (``rlreplay.mismatch.report.compute``'s); None: read here
    pieces: Any = None

    def __getitem__(self, key: str) -> float:
        return self.thresholds[key]
