"""The read-only web app: Starlette routes rendering Jinja2 templates over a run or a folder of runs."""

from __future__ import annotations

import datetime as dt
import functools
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
import pyarrow as pa
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from rlreplay.errors import RunError
from rlreplay.format.keys import SELECT_KEYS, key_order, parse_int
from rlreplay.model import listing_rows
from rlreplay.read.filters import Filters
from rlreplay.read.selection import Selection
from rlreplay.read.where import time_budget
from rlreplay.ui import charts, views
from rlreplay.ui.data import (
    PAGE_SIZES,
    ListQuery,
    NotFound,
    RunSet,
    RunView,
    one_look,
    paginate,
    run_base,
)
from rlreplay.ui.pairing import Comparisons, Shown

HERE = Path(__file__).parent
LOSS_COUNTERS = ("dropped", "spilled", "lost", "encode_errors")
LIST_COLUMNS = (
    "step",
    "sample_index",
    "rollout_n",
    "validate",
    "agent",
    "model_calls",
    "tool_calls",
    "tool_errors",
    "response_tokens",
    "duration_s",
    "reward",
    "advantage",
    "logprob_diff_max",
    "status",
    "worker",
)
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _num
    env.filters["when"] = _when
    env.filters["pretty"] = views.pretty
    env.filters["plain"] = views.plain
    env.globals["qs"] = lambda params: urlencode(params)
    env.globals["step_href"] = step_href
    env.globals["prompt_href"] = prompt_href
    return env


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "val" if value else "train"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _when(value: Any) -> str:
    try:
        return dt.datetime.fromtimestamp(float(value)).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return "–"


#: the page context's messages (errors, reasons), shown without this machine's paths
MESSAGES = ("message", "why", "error", "decoder_error")
#: findings listed on the findings page (the counts cover them all)
FINDINGS_SHOWN = 1000


class UI:
    def __init__(self, runs: RunSet, poll_ms: int = 1500) -> None:
        self.runs = runs
        self.env = _env()
        self.env.filters["nopath"] = runs.without_paths
        self.poll_ms = poll_ms
        self.comparisons = Comparisons(runs)

    def warm(self) -> None:
        """Do the first request's work now: templates, query engine, a single run's listing."""
        import rlreplay.read.query  # noqa: F401

        for name in self.env.list_templates():
            self.env.get_template(name)
        if self.runs.single:
            view = self.runs.get(self.runs.names()[0])
            view.stats()

    def page(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        for key in MESSAGES:  # what a page says: no path of this machine
            if isinstance(context.get(key), str):
                context[key] = self.runs.without_paths(context[key])
        if context.get("warnings"):
            context["warnings"] = [self.runs.without_paths(w) for w in context["warnings"]]
        context.setdefault("view", None)
        context.setdefault("version", "")
        context.setdefault("crumbs", [])
        view = context["view"]
        context.setdefault("live", view.recording() if isinstance(view, RunView) else False)
        html = self.env.get_template(template).render(
            poll_ms=self.poll_ms, single=self.runs.single, **context
        )
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    def view(self, request: Request) -> RunView:
        return self.runs.get(request.path_params["run"])

    # ---- pages --------------------------------------------------------------------------------

    def index(self, request: Request) -> Response:
        names = self.runs.names()
        if self.runs.single:
            return RedirectResponse(f"{run_base(names[0])}/", status_code=302)
        rows = []
        for name in names:
            try:
                m = self.runs.get(name).manifest()
            except RunError as exc:
                m = {"error": str(exc)}
            rows.append({"name": name, "base": run_base(name), "manifest": m})
        return self.page("index.html", rows=rows, root=self.runs.name, version=self._root_version())

    def _root_version(self) -> str:
        return "|".join(self.runs.names())

    def root_version(self, request: Request) -> Response:
        return JSONResponse({"version": self._root_version()}, headers=HEADERS)

    def version(self, request: Request) -> Response:
        return JSONResponse({"version": self.view(request).version()}, headers=HEADERS)

    def overview(self, request: Request) -> Response:
        import pyarrow.compute as pc

        view = self.view(request)
        version = view.version()
        table = view.listing()
        stats = view.stats()
        counters = view.counters()
        losses = {k: v for k, v in counters.items() if k in LOSS_COUNTERS and v}
        found, found_what = view.counted_findings()
        findings = _findings_per_step(found)
        sections = []
        for split, label in ((False, "training"), (True, "validation")):
            rows = [s for s in stats if s["validate"] == split]
            if not rows:
                continue
            for r in rows:
                r["findings"] = findings.get((r["step"], split), 0)
            sections.append(
                {
                    "label": label,
                    "split": split_name(split),
                    "validate": split,
                    "rows": rows,
                    "charts": _trend_charts(view, rows, split),
                }
            )
        counted = pc.value_counts(table["status"]).to_pylist()
        status_counts = {c["values"]: c["counts"] for c in counted}
        return self.page(
            "overview.html",
            view=view,
            version=version,
            manifest=view.manifest(),
            counters=counters,
            losses=losses,
            total=table.num_rows,
            status_counts=status_counts,
            sections=sections,
            findings_total=len(found),
            findings_what=found_what,
            warnings=view.run.notes(),
            crumbs=[],
        )

    def alerts(self, request: Request) -> Response:
        """The run's alerts (what ``rlreplay watch`` alerts on): a fragment the front page loads."""
        from rlreplay.ui.alerts import SHOWN, run_alerts

        view = self.view(request)
        return self.page("alerts.html", view=view, alerts=run_alerts(view), shown=SHOWN)

    def trajectories(self, request: Request) -> Response:
        """The trajectory list; for one step and split, the step page: distributions, groups, list."""
        view = self.view(request)
        version = view.version()
        q = ListQuery.from_params(request.query_params)
        table = view.listing()
        error = None
        try:
            chosen = view.selected(q)
        except RunError as exc:
            error, chosen = str(exc), table.slice(0, 0)
        page = paginate(chosen, q)
        present = [
            c for c in LIST_COLUMNS if c in table.column_names and table[c].null_count < table.num_rows
        ]
        wanted = [c for c in q.cols.split(",") if c in table.column_names] if q.cols else []
        columns = wanted or [c for c in present if c in DEFAULT_COLUMNS]
        step = _one_step(q)
        step_page = self._step(view, table, step, bool(q.validate)) if step is not None else None
        crumbs = (
            [(f"step {step} ({split_name(q.validate)})", None)] if step_page else [("trajectories", None)]
        )
        return self.page(
            "list.html",
            status=400 if error else 200,
            view=view,
            version=version,
            q=q,
            page=page,
            columns=columns,
            choices=present,
            error=error,
            page_sizes=PAGE_SIZES,
            all_columns=[c for c in table.column_names if not c.endswith("_str")],
            select_keys=SELECT_KEYS,
            step_page=step_page,
            within=urlencode(q.params(page=1)),
            findings=_findings_per_trajectory(view.listing_findings()),
            compared=self.comparisons.badges(view),
            crumbs=crumbs,
        )

    def _step(self, view: RunView, table: Any, step: int, validate: bool) -> dict[str, Any] | None:
        """What the step page shows above the list: its stats, distributions and groups."""
        rows = Filters(step=step, validate=validate).apply(table)
        if rows.num_rows == 0:
            return None
        stats = next((r for r in view.stats() if r["step"] == step and r["validate"] == validate), {})
        hists = [
            charts.histogram(label, rows[col].to_pylist())
            for col, label in (
                ("reward", "reward"),
                ("response_tokens", "response tokens"),
                ("logprob_diff_max", "log-prob diff max"),
            )
            if rows[col].null_count < rows.num_rows
        ]
        findings = view.listing_findings()
        steps = sorted(
            {r["step"] for r in view.stats() if r["validate"] == validate and isinstance(r["step"], int)}
        )
        at = steps.index(step)
        return {
            "step": step,
            "split": split_name(validate),
            "validate": validate,
            "stats": stats,
            "hists": hists,
            "groups": _groups(view, rows, step, findings),
            "prev": step_href(view, steps[at - 1], validate) if at > 0 else None,
            "next": step_href(view, steps[at + 1], validate) if at + 1 < len(steps) else None,
        }

    def trajectory(self, request: Request) -> Response:
        view = self.view(request)
        traj = view.trajectory(request.path_params["tid"])
        findings = view.trajectory_findings(traj)
        decoder = view.decoder()
        if decoder is not None:
            from rlreplay.text.token2text import add_text

            decoder = views.Memo(decoder)
            add_text([traj], decoder)
        row = view.row(traj.id) or {}
        siblings = []
        if traj.sample_index is not None:  # the other rollouts of its group
            group = Filters(**traj.key.group().as_dict()).apply(view.listing())
            siblings = [r for r in listing_rows(group) if r["id"] != traj.id]
        return self.page(
            "trajectory.html",
            view=view,
            traj=traj,
            row=row,
            messages=views.messages(traj, decoder, view.adapter()),
            spans=views.timeline(traj, decoder),
            tools=views.tool_calls(traj),
            timings=views.timings(traj),
            tokens=views.tokens(traj, decoder, getattr(view.adapter(), "fields", None)),
            siblings=siblings,
            findings=findings,
            compared=self.comparisons.badges(view).get(traj.id),
            decoder_error=view.decoder_error,
            prompt_link=_prompt_link(view, traj),
            moves=_moves(view, traj, request.query_params.get("in")),
            crumbs=_traj_crumbs(view, traj),
        )

    def prompt(self, request: Request) -> Response:
        """One prompt across training: its rollouts at every step, with reward, length and answer."""
        from rlreplay.format.schema import KIND_SIGNALS

        view = self.view(request)
        q = ListQuery.from_params(request.query_params)
        if q.sample_index is None or q.validate is None:
            raise RunError("the prompt page needs sample_index and validate (true or false)")
        validate = q.validate
        rows = listing_rows(Selection(sample_index=q.sample_index, validate=validate).apply(view.listing()))
        if not rows:
            raise NotFound(f"no {split_name(validate)} trajectories of sample_index {q.sample_index}")
        key = rows[0]["sample_index"]
        steps = sorted({r["step"] for r in rows}, key=key_order)
        # a page of steps (the latest first): only their rollouts are read, for their answers
        per = q.per if "per" in request.query_params else PROMPT_STEPS_SHOWN
        pages = max(1, math.ceil(len(steps) / per))
        page = min(q.page, pages)
        end = len(steps) - (page - 1) * per
        shown_steps = steps[max(0, end - per) : end]
        shown = [r for r in rows if r["step"] in shown_steps]
        decoder, adapter = view.decoder(), view.adapter()
        # only the shown steps' files (their partitions), only the row groups holding these rollouts
        ints = [s for s in shown_steps if isinstance(s, int)]
        step_filter = ints if len(ints) == len(shown_steps) else None
        wanted = Filters(step=step_filter, sample_index=key)
        # the trainer's signals (per-token arrays) are no part of the conversation: not decoded
        ids = [r["id"] for r in shown]
        loaded = {t.id: t for t in view.run.load(ids, wanted, skip_kinds=(KIND_SIGNALS,))}
        question = ""
        by_step: dict[Any, list[dict[str, Any]]] = {}
        for r in sorted(shown, key=lambda r: key_order(r["rollout_n"])):
            traj = loaded.get(r["id"])
            msgs = views.messages(traj, decoder, adapter) if traj is not None else []
            question = question or next((m.content for m in msgs if m.role == "user"), "")
            answer = next((m.content for m in reversed(msgs) if m.role == "assistant"), "")
            by_step.setdefault(r["step"], []).append({**r, "answer": answer})
        # the chart covers every step (from the listing); a point opens the page showing its step
        rewards: dict[Any, list[float]] = {}
        for r in rows:
            if r["reward"] is not None:
                rewards.setdefault(r["step"], []).append(r["reward"])
        every = [s for s in steps if isinstance(s, int)]
        means = [sum(rewards[s]) / len(rewards[s]) if s in rewards else None for s in every]
        at = {s: i for i, s in enumerate(steps)}

        def href(step: Any) -> str:
            on = (len(steps) - 1 - at[step]) // per + 1
            return f"#step-{step}" if on == page else prompt_page(on) + f"#step-{step}"

        def prompt_page(number: int) -> str:
            more = {"page": number, **({"per": per} if per != PROMPT_STEPS_SHOWN else {})}
            return f"{prompt_href(view, key, validate)}&{urlencode(more)}"

        chart = charts.trend_chart(
            "reward mean of this prompt", every, [charts.Series("mean", means)], href=href
        )
        return self.page(
            "prompt.html",
            view=view,
            sample_index=key,
            split=split_name(validate),
            validate=validate,
            question=question,
            steps=[(s, by_step[s]) for s in shown_steps],
            total_steps=len(steps),
            newer=prompt_page(page - 1) if page > 1 else None,
            older=prompt_page(page + 1) if page < pages else None,
            chart=chart,
            decoder_error=view.decoder_error,
            crumbs=[(f"prompt {key} ({split_name(validate)})", None)],
        )

    def compare(self, request: Request) -> Response:
        """This run against another of the folder (e.g. its replay): pairs same, changed or in one."""
        from rlreplay.compare import summary, where

        view = self.view(request)
        others = [n for n in self.runs.names() if n != view.name]
        other = request.query_params.get("with", "").strip()
        q = ListQuery.from_params(request.query_params)
        if not other:
            return self.page(
                "compare.html",
                view=view,
                others=others,
                other="",
                q=q,
                result=None,
                where=where,
                crumbs=[("compare", None)],
            )
        b = self.runs.get(other)
        shown = Shown(view.name, other, q.step, q.validate)
        pairs = self.comparisons.pairs(shown)
        self.comparisons.show(shown)
        order = {"changed": 0, "only_a": 1, "only_b": 2, "same": 3}
        shown = sorted(pairs, key=lambda p: order[p.status])[:FINDINGS_SHOWN]
        return self.page(
            "compare.html",
            view=view,
            others=others,
            other=other,
            other_base=b.base,
            q=q,
            result=summary(pairs),
            pairs=shown,
            total=len(pairs),
            where=where,
            crumbs=[("compare", None)],
        )

    def findings(self, request: Request) -> Response:
        """What ``rlreplay audit`` finds in the run: counts per check, then every finding."""
        view = self.view(request)
        version = view.version()
        report = view.findings()
        counts = {c.name: 0 for c in report.checks}
        for f in report.findings:
            counts[f.check] = counts.get(f.check, 0) + 1
        return self.page(
            "findings.html",
            view=view,
            version=version,
            report=report,
            counts=counts,
            help={c.name: c.help for c in report.checks},
            shown=report.findings[:FINDINGS_SHOWN],
            crumbs=[("findings", None)],
        )

    def mismatch(self, request: Request) -> Response:
        """Trainer vs rollout log-probs over the run: the numbers of ``rlreplay mismatch`` per step,
        their trend, a bucket key's buckets, the worst rollouts and tokens."""
        from rlreplay.mismatch import BY
        from rlreplay.mismatch import metrics as m

        view = self.view(request)
        version = view.version()
        by = request.query_params.get("by", "position")
        if by not in BY or by == "step":
            raise RunError(f"by must be one of {', '.join(b for b in BY if b != 'step')}, not {by!r}")
        crumbs = [("mismatch", None)]
        try:
            report = view.mismatch()
            buckets = view.mismatch(by)
        except RunError as exc:
            return self.page(
                "mismatch.html", view=view, version=version, report=None, why=str(exc), crumbs=crumbs
            )
        trained = [r for r in report.steps if not r["validate"] and isinstance(r["step"], int)]
        steps = [r["step"] for r in trained]

        def chart(title: str, keys: tuple[str, ...]) -> Any:
            lines = [charts.Series(MISMATCH_LABELS.get(k, k), [r[k] for r in trained]) for k in keys]
            return charts.trend_chart(title, steps, lines, href=lambda st: step_href(view, st, False))

        return self.page(
            "mismatch.html",
            view=view,
            version=version,
            report=report,
            why=None,
            by=by,
            keys=[b for b in BY if b != "step"],
            buckets=buckets,
            sequence_keys=m.SEQUENCE_KEYS,
            charts=[
                chart("|Δ| = |trainer − rollout| log-prob", ("logprob_diff_mean", "logprob_diff_p99")),
                chart("token_mult_prob_error (mean exp|Δ|)", ("token_mult_prob_error",)),
                chart("kl and k3_kl (verl)", ("kl", "k3_kl")),
                chart("chi2_token (verl)", ("chi2_token",)),
            ]
            if report.per == "token"
            else [  # the trainer's per-rollout figures only
                chart("|Δ| per rollout", ("seq_logprob_diff_mean", "logprob_diff_max")),
                chart("chi2_seq (verl)", ("chi2_seq",)),
            ],
            rules=(m.BOUNDS_RULE, m.VERDICT_RULE),
            labels=MISMATCH_LABELS,
            crumbs=crumbs,
        )

    def group(self, request: Request) -> Response:
        """A group's rollouts side by side as chat, with reward, advantage and where each diverges."""
        import pyarrow.compute as pc

        from rlreplay.diff.align import diff_group

        view = self.view(request)
        traj = view.trajectory(request.path_params["tid"])
        decoder = view.decoder()
        group = diff_group(view.run, traj, decoder)
        ids = [m.side.id for m in group.members]
        loaded = group.loaded
        table = view.listing()
        rows = {r["id"]: r for r in table.filter(pc.is_in(table["id"], pa.array(ids))).to_pylist()}
        adapter = view.adapter()
        columns, prompt = [], []
        for member in group.members:
            t = loaded.get(member.side.id)
            msgs = views.messages(t, decoder, adapter) if t is not None else []
            start = next((i for i, m in enumerate(msgs) if m.role == "assistant"), len(msgs))
            prompt = prompt or msgs[:start]
            columns.append({"member": member, "row": rows.get(member.side.id, {}), "messages": msgs[start:]})
        return self.page(
            "group.html",
            view=view,
            traj=traj,
            group=group,
            prompt=prompt,
            columns=columns,
            decoder_error=view.decoder_error,
            prompt_link=_prompt_link(view, traj),
            crumbs=[*_traj_crumbs(view, traj)[:-1], ("group", None)],
        )

    def diff(self, request: Request) -> Response:
        from rlreplay.diff.align import diff_trajectories
        from rlreplay.diff.report import render_html

        view = self.view(request)
        a_ref = request.query_params.get("a", "").strip()
        b_ref = request.query_params.get("b", "").strip()
        if not a_ref or not b_ref:
            return self.page(
                "diff_form.html", view=view, a=a_ref, b=b_ref, crumbs=[("diff", None)], status=200
            )
        a, b = view.trajectory(a_ref), view.trajectory(b_ref)
        decoder = view.decoder()
        found = diff_trajectories(a, b, decoder, view.run, view.run)
        found.a.run = found.b.run = view.name  # the run's name, never its path on this machine
        report = render_html(found)
        nav = self.env.get_template("diff_nav.html").render(view=view, a=a, b=b)
        body = report.replace("<body>", "<body>" + nav, 1)
        head = '<link rel="stylesheet" href="/static/style.css">'
        return HTMLResponse(body.replace("</head>", head + "</head>", 1), headers=HEADERS)


TREND_CHARTS = (
    ("reward mean", ("reward_mean",), ("reward_p10", "reward_p90")),
    ("advantage spread (std)", ("advantage_std",), None),
    ("response length (tokens)", ("response_tokens_p50", "response_tokens_p95"), None),
    ("trainer vs rollout log-prob diff", ("logprob_diff_mean", "logprob_diff_p95"), None),
    ("importance ratio", ("importance_ratio_p5", "importance_ratio_p95"), None),
    ("tool error rate", ("tool_error_rate",), None),
    ("zero-std group fraction", ("frac_groups_zero_std",), None),
    ("findings", ("findings",), None),
)
SERIES_NAMES = {
    "reward_mean": "mean",
    "reward_p10": "p10",
    "reward_p90": "p90",
    "response_tokens_p50": "p50",
    "response_tokens_p95": "p95",
    "logprob_diff_mean": "mean",
    "logprob_diff_p95": "p95 of max",
    "importance_ratio_p5": "p5",
    "importance_ratio_p95": "p95",
}


#: Short column names on the mismatch page (the --json name is each column's title).
MISMATCH_LABELS = {
    "logprob_diff_mean": "mean |Δ|",
    "logprob_diff_p99": "p99 |Δ|",
    "logprob_diff_max": "max |Δ|",
    "seq_logprob_diff_max_p50": "rollout max p50",
    "seq_logprob_diff_max_p90": "rollout max p90",
    "seq_logprob_diff_max_p99": "rollout max p99",
    "seq_logprob_diff_mean": "rollout mean |Δ|",
    "icepop_seq_frac_out": "Πρ ∉ [0.5, 5]",
    "token_mult_prob_error": "mult. prob. error",
    "tis_token_frac_high": "ρ > 2",
    "icepop_token_frac_out": "ρ ∉ [0.5, 5]",
    "tis_seq_frac_high": "Πρ > 2",
    "eff_sample_size": "ESS",
    "kl": "kl",
    "k3_kl": "k3_kl",
}


def split_name(validate: Any) -> str:
    """How a page shows the split: ``val`` or ``train``."""
    return "val" if validate else "train"


def step_href(view: RunView, step: Any, validate: bool) -> str:
    """The step page: the listing of one step and split, with its distributions and groups."""
    flag = "true" if validate else "false"
    if isinstance(step, int):  # what urlencode gives, without its cost for every point of a chart
        return f"{view.base}/trajectories?step={step}&validate={flag}"
    return f"{view.base}/trajectories?{urlencode({'step': step, 'validate': flag})}"


def _trend_charts(view: RunView, rows: list[dict[str, Any]], validate: bool) -> list[Any]:
    rows = [r for r in rows if isinstance(r["step"], int)]
    steps = [r["step"] for r in rows]
    out = []
    for title, keys, band in TREND_CHARTS:
        if not any(r.get(k) is not None for r in rows for k in keys):
            continue
        lines = [charts.Series(SERIES_NAMES.get(k, title), [r.get(k) for r in rows]) for k in keys]
        bands = (
            (
                charts.Series(SERIES_NAMES[band[0]], [r.get(band[0]) for r in rows]),
                charts.Series(SERIES_NAMES[band[1]], [r.get(band[1]) for r in rows]),
            )
            if band
            else None
        )
        out.append(
            charts.trend_chart(title, steps, lines, bands, href=lambda st: step_href(view, st, validate))
        )
    return out


#: the list's columns until the user chooses (the list fits 1,280 px)
DEFAULT_COLUMNS = tuple(c for c in LIST_COLUMNS if c not in ("agent", "model_calls", "worker"))
#: the steps a page of a prompt's history shows (their rollouts are read for their answers)
PROMPT_STEPS_SHOWN = 10
#: groups on a step page whose prompt is read and shown
PROMPTS_SHOWN = 64


def prompt_href(view: RunView, sample_index: Any, validate: bool) -> str:
    """A prompt's page: its rollouts at every step."""
    chosen = Selection(sample_index=str(sample_index), validate=validate)
    return f"{view.base}/prompt?{urlencode(chosen.params())}"


def _moves(view: RunView, traj: Any, within: str | None) -> dict[str, Any]:
    """The previous and next trajectory in the listing the user came from (else the step's)."""
    from starlette.datastructures import QueryParams

    if within is None and traj.step is not None:
        within = urlencode({"step": traj.step, "validate": "true" if traj.validate else "false"})
    out: dict[str, Any] = {"prev": None, "next": None, "at": None, "of": 0}
    if within is None:
        return out
    try:
        ids = view.selected(ListQuery.from_params(QueryParams(within)))["id"].to_pylist()
    except RunError:
        return out
    if traj.id not in ids:
        return out
    at = ids.index(traj.id)
    keep = urlencode({"in": within})
    out.update(at=at + 1, of=len(ids))
    if at > 0:
        out["prev"] = f"{view.base}/t/{ids[at - 1]}?{keep}"
    if at + 1 < len(ids):
        out["next"] = f"{view.base}/t/{ids[at + 1]}?{keep}"
    return out


def _prompt_link(view: RunView, traj: Any) -> str | None:
    return (
        prompt_href(view, traj.sample_index, bool(traj.validate)) if traj.sample_index is not None else None
    )


def _one_step(q: ListQuery) -> int | None:
    """The step a list query names alone (with its split): it is a step page."""
    return parse_int(q.step) if q.validate is not None and q.step is not None else None


def _groups(view: RunView, rows: Any, step: int, findings: list[Any]) -> list[dict[str, Any]]:
    """The step's groups (rollouts of one prompt), by sample index."""
    by_sample: dict[Any, list[dict[str, Any]]] = {}
    for r in listing_rows(rows):
        by_sample.setdefault(r["sample_index"], []).append(r)
    flagged: dict[Any, int] = {}
    for f in findings:
        if f.step == step:
            flagged[f.sample_index] = flagged.get(f.sample_index, 0) + 1
    rewards = [r for r in rows["reward"].to_pylist() if r is not None]
    lo, hi = (min(rewards), max(rewards)) if rewards else (0.0, 1.0)
    keys = sorted(by_sample, key=key_order)
    firsts = [min(by_sample[k], key=lambda r: key_order(r["rollout_n"]))["id"] for k in keys[:PROMPTS_SHOWN]]
    prompts = view.prompts(firsts, step)
    out = []
    for k in keys:
        members = sorted(by_sample[k], key=lambda r: key_order(r["rollout_n"]))
        rs = [m["reward"] for m in members]
        advs = [m["advantage"] for m in members if m["advantage"] is not None]
        known = [r for r in rs if r is not None]
        tips = [f"rollout {m['rollout_n']}: reward {charts.fmt(m['reward'])}" for m in members]
        out.append(
            {
                "sample_index": k,
                "first": members[0]["id"],
                "prompt": prompts.get(members[0]["id"], ""),
                "dots": charts.dots(rs, lo, hi, tips),
                "rollouts": len(members),
                "reward_mean": sum(known) / len(known) if known else None,
                "advantage_spread": max(advs) - min(advs) if advs else None,
                "findings": flagged.get(k, 0),
            }
        )
    return out


def _findings_per_trajectory(findings: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in findings:
        if f.trajectory_id:
            out.setdefault(f.trajectory_id, []).append(f)
    return out


def _findings_per_step(findings: list[Any]) -> dict[tuple[Any, bool], int]:
    out: dict[tuple[Any, bool], int] = {}
    for f in findings:
        key = (f.step, bool(f.validate))
        out[key] = out.get(key, 0) + 1
    return out


def _traj_crumbs(view: RunView, traj: Any) -> list[tuple[str, str | None]]:
    crumbs: list[tuple[str, str | None]] = []
    if traj.step is not None:
        crumbs.append(
            (f"step {traj.step} ({split_name(traj.validate)})", step_href(view, traj.step, traj.validate))
        )
    crumbs.append((traj.id[:12], None))
    return crumbs


#: Seconds the queries of one page (its where box, the step statistics) may compute: a link
#: someone is sent must not pin a core, and a page whose browser left stops computing.
QUERY_SECONDS = 10.0


def looked_once(handler: Any, budget_s: float | None = QUERY_SECONDS) -> Any:
    """The page handler, looking at each run's files once per request, its queries within
    ``budget_s`` seconds."""

    @functools.wraps(handler)
    def page(request: Request) -> Response:
        with one_look(), time_budget(budget_s):
            return handler(request)

    return page


def create_app(
    root: str | os.PathLike[str],
    poll_ms: int = 1500,
    allowed_hosts: list[str] | None = None,
    warm: bool = False,
    tokenizer: str | None = None,
    query_budget_s: float | None = QUERY_SECONDS,
) -> Starlette:
    """The app over a run directory or a folder of runs; ``allowed_hosts`` guards the Host header;
    ``warm``: read a single run's listing before returning, so that the first page is fast;
    ``tokenizer``: decode with this tokenizer instead of the one each run's manifest names;
    ``query_budget_s``: the seconds a page's queries may compute."""
    ui = UI(RunSet(root, tokenizer), poll_ms=poll_ms)
    if warm:
        ui.warm()

    async def not_found(request: Request, exc: Exception) -> Response:
        return ui.page("error.html", status=404, message=str(exc) or "not found", crumbs=[])

    async def bad_input(request: Request, exc: Exception) -> Response:
        return ui.page("error.html", status=400, message=str(exc), crumbs=[])

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return ui.page("error.html", status=exc.status_code, message=exc.detail, crumbs=[])

    routes = [
        Route("/", ui.index),
        Route("/api/version", ui.root_version),
        Route("/r/{run}/", looked_once(ui.overview, query_budget_s)),
        Route("/r/{run}/trajectories", looked_once(ui.trajectories, query_budget_s)),
        Route("/r/{run}/t/{tid}", looked_once(ui.trajectory, query_budget_s)),
        Route("/r/{run}/group/{tid}", looked_once(ui.group, query_budget_s)),
        Route("/r/{run}/prompt", looked_once(ui.prompt, query_budget_s)),
        Route("/r/{run}/diff", looked_once(ui.diff, query_budget_s)),
        Route("/r/{run}/findings", looked_once(ui.findings, query_budget_s)),
        Route("/r/{run}/mismatch", looked_once(ui.mismatch, query_budget_s)),
        Route("/r/{run}/alerts", looked_once(ui.alerts, query_budget_s)),
        Route("/r/{run}/compare", looked_once(ui.compare, query_budget_s)),
        Route("/r/{run}/api/version", looked_once(ui.version, query_budget_s)),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = []
    if allowed_hosts:
        from starlette.middleware import Middleware
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={NotFound: not_found, RunError: bad_input, HTTPException: http_error},
    )
    app.state.ui = ui
    return app
