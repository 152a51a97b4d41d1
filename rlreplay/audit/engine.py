"""Running checks over a selection of a run: listing checks on the listing, trajectory checks on
the trajectories streamed step by step (one pass over each step's files)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlreplay import plugins
from rlreplay.audit.finding import LEVEL_TRAJECTORY, OVER_LISTING, Check, Context, Finding
from rlreplay.errors import SelectionError
from rlreplay.format.keys import group_key


def available(broken: dict[str, str] | None = None) -> dict[str, Check]:
    """Every installed check that loads, by name, in name order. A plug-in that
    cannot be imported, or is no ``rlreplay.hookspecs.Check``, is left out; ``broken`` (when
    given) gets its name and why, in one line."""
    out: dict[str, Check] = {}
    for name, spec in sorted(plugins.specs("checks").items()):
        try:
            check = plugins.load(spec)
            if not isinstance(check, Check):
                raise TypeError(f"{type(check).__name__} is not an rlreplay.hookspecs.Check")
        except Exception as exc:  # any error of someone else's module: the other checks still run
            if broken is not None:
                broken[name] = f"plug-in {spec} cannot be used: {_one_line(exc)}"
            continue
        out[name] = check
    return out


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]


def choose(
    names: str | Sequence[str] | None, checks: dict[str, Check], broken: dict[str, str] | None = None
) -> list[Check]:
    """The checks named (a comma list, or all of them); an unknown name, or one of the ``broken``
    plug-ins (see :func:`available`): SelectionError."""
    if names is None:
        return list(checks.values())
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unusable = [n for n in wanted if n in (broken or {})]
    if unusable:
        raise SelectionError(f"check {unusable[0]}: {(broken or {})[unusable[0]]}")
    unknown = [n for n in wanted if n not in checks]
    if unknown or not wanted:
        raise SelectionError(
            f"unknown check {', '.join(unknown) or '(none given)'}; checks: {', '.join(checks)}"
        )
    return [checks[n] for n in dict.fromkeys(wanted)]


def default_thresholds(checks: Sequence[Check]) -> dict[str, float]:
    out: dict[str, float] = {}
    for check in checks:
        out.update(check.thresholds)
    return out


def trajectory_checks(checks: dict[str, Check]) -> list[str]:
    """The names --fail-on defaults to: the checks whose findings are trajectories."""
    return [c.name for c in checks.values() if c.level == LEVEL_TRAJECTORY]


@dataclass
class Report:
    checks: list[Check]
    findings: list[Finding] = field(default_factory=list)
    #: checks not run, and why
    skipped: dict[str, str] = field(default_factory=dict)
    #: checks that raised while running (their findings left out), and the error in one line
    failed: dict[str, str] = field(default_factory=dict)
    trajectories: int = 0


def audit(
    run: Any,
    listing: Any,
    checks: Sequence[Check],
    thresholds: dict[str, float] | None = None,
    tokenizer: str | None = None,
    pieces: Any = None,
) -> Report:
    """Run ``checks`` over the trajectories of ``listing`` (rows of ``run.trajectories()``);
    ``pieces``: see ``Context.pieces``."""
    from rlreplay.adapters.registry import adapter_for_run
    from rlreplay.format.arrow_ops import release_unused

    release_unused()  # what reading the listing freed, before the tokenizer takes its share
    report = Report(list(checks), trajectories=listing.num_rows)
    checks = [_guarded(check, report) for check in checks]
    ctx = Context(
        {**default_thresholds(checks), **(thresholds or {})}, adapter_for_run(run), run=run, pieces=pieces
    )
    over_spans = [c for c in checks if c.over != OVER_LISTING]
    if any(c.needs_tokenizer for c in over_spans):
        ctx.decoder = _decoder(run, tokenizer, report, [c for c in over_spans if c.needs_tokenizer])
        over_spans = [c for c in over_spans if c.name not in report.skipped]
    for check in checks:
        if check.over == OVER_LISTING:
            report.findings.extend(check.run(listing, ctx))
    if over_spans:
        report.findings.extend(_over_trajectories(run, listing, over_spans, ctx))
    if report.failed:  # what a check found before it failed is not the whole of it
        report.findings = [f for f in report.findings if f.check not in report.failed]
    return report


def _guarded(check: Check, report: Report) -> Check:
    """``check`` whose ``run`` never raises: a check that raises (a plug-in's bug) is noted in
    ``report.failed`` once, its findings left out, and it is not run again."""
    run = check.run

    def guarded_run(item: Any, ctx: Context) -> list[Finding]:
        if check.name in report.failed:
            return []
        try:
            return list(run(item, ctx))
        except Exception as exc:
            report.failed[check.name] = _one_line(exc)
            return []

    return replace(check, run=guarded_run)


def _over_trajectories(run: Any, listing: Any, checks: list[Check], ctx: Context) -> Iterator[Finding]:
    """Trajectory checks, step by step: a check with ``span_kinds`` over trajectories holding only
    those spans, the others over whole trajectories (built only when such a check runs)."""
    from rlreplay.adapters.generic import GenericAdapter
    from rlreplay.format.arrow_ops import release_unused
    from rlreplay.read.scan import by_step

    # an adapter reading calls its own way may want what the calls-only reader leaves out
    reads = ("call_ids", "stop_reason", "max_tokens", "tool_error", "parse_error")
    plain = all(getattr(type(ctx.adapter), m, None) is getattr(GenericAdapter, m) for m in reads)
    light = [c for c in checks if c.span_kinds is not None and plain]
    for step, ids in by_step(listing).items():
        release_unused()  # what the last step freed: memory stays one step's
        if type(step) is not int:
            for traj in run.load(ids):
                yield from check_trajectory(traj, checks, ctx)
        else:
            yield from _over_step(run, step, ids, checks, light, ctx)


def _over_step(
    run: Any, step: int, ids: list[str], checks: list[Check], light: list[Check], ctx: Context
) -> list[Finding]:
    """The findings of ``checks`` over the trajectories ``ids`` of ``step`` (a list: nothing of
    the step is held once it returns)."""
    from rlreplay.read.scan import step_calls, step_spans

    warn = lambda message: run.warn(f"step {step}: {message}")  # noqa: E731
    kinds = sorted({k for c in light for k in c.span_kinds or ()})
    light_names = {c.name for c in light}
    whole = step_spans(run, step, ids) if len(light) < len(checks) else None
    views = step_calls(run, step, ids, kinds, None if whole else warn) if light else None
    found: list[Finding] = []
    for k in range(len(ids)):
        traj = whole.trajectory(k, warn) if whole is not None else None
        view = views.trajectory(k) if views is not None else None
        if traj is None and view is None:
            continue
        for check in checks:
            if ctx.decoder is not None or not check.needs_tokenizer:
                found.extend(check.run(view if check.name in light_names else traj, ctx))
    return found


def check_trajectory(traj: Any, checks: Sequence[Check], ctx: Context) -> list[Finding]:
    """The findings of the trajectory checks among ``checks`` on one trajectory (a check needing
    a tokenizer is left out when ``ctx`` has no decoder)."""
    found: list[Finding] = []
    for check in checks:
        if check.over != OVER_LISTING and (ctx.decoder is not None or not check.needs_tokenizer):
            found.extend(check.run(traj, ctx))
    return found


def about(findings: Sequence[Finding], traj: Any) -> list[Finding]:
    """The findings that point at ``traj``: its own, and its group's."""
    group = group_key(traj)
    return [
        f
        for f in findings
        if f.trajectory_id == traj.id
        or (f.trajectory_id is None and not traj.validate and group_key(f) == group)
    ]


def _decoder(run: Any, tokenizer: str | None, report: Report, needing: list[Check]) -> Any:
    from rlreplay.text.token2text import Decoder, TokenizerUnavailable, resolve_tokenizer

    name = resolve_tokenizer(run, tokenizer)
    why = "no tokenizer is known for this run (pass --tokenizer)"
    if name is not None:
        try:
            return Decoder.load(name)
        except TokenizerUnavailable as exc:
            if tokenizer is not None:
                raise
            why = f"tokenizer unavailable: {exc}"
    for check in needing:
        report.skipped[check.name] = why
    return None


def finding_ids(report: Report, listing: Any) -> set[str]:
    """Ids of the listing's trajectories a finding points at (a group finding: its rollouts)."""
    from rlreplay.format.keys import KEY_STR, KEYS
    from rlreplay.model import listing_rows

    ids = {f.trajectory_id for f in report.findings if f.trajectory_id}
    groups = {group_key(f) for f in report.findings if f.trajectory_id is None and f.sample_index is not None}
    if groups:
        for row in listing_rows(listing.select(["id", *KEYS, *KEY_STR.values(), "validate"])):
            if not row["validate"] and group_key(row) in groups:
                ids.add(row["id"])
    return ids
