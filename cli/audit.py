"""Finding what is wrong in a run: ``audit``."""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any

import typer

from rlreplay.cli.app import (
    EngineOption,
    JsonOption,
    RayAddressOption,
    RunArgument,
    RunOption,
    TokenizerOption,
    app,
    cluster_for,
    fail,
    open_run_arg,
    plural,
    report_warnings,
    selection_options,
    terminal_width,
    text_table,
    trajectories,
)
from rlreplay.format.keys import KEYS

#: worst examples shown per check
EXAMPLES = 5

AUDIT_HELP = """Find the trajectories that are wrong.

Runs checks over the selected trajectories and prints what they find.

Exit code: 0 when the --fail-on checks found nothing, 1 when they found something, 2 when the
audit could not run in full: bad input, a run that could not be read in full (a damaged or
unreadable span file; the warning says how many), or a check named in --checks or --fail-on that
could not be loaded or raised. A check plug-in that cannot be loaded is skipped with one warning.

\b
Checks (--checks; thresholds: --threshold KEY=VALUE):
  retokenization  model call k+1's prompt does not begin with call k's prompt + response ids
                  (re-tokenized text: the trainer sees tokens the model never sampled)
  repetition      a response degenerating into one repeated n-gram (repetition_max_ngram=32,
                  repetition_min_repeats=4, repetition_min_tokens=32)
  garbled         decoded text with replacement or control characters or a mix of 3+ scripts
                  (needs the tokenizer; skipped with a note without one)
  truncated       a model call stopped on its length limit (stop reason "length", or max_tokens)
  empty_response  a model call that returned no token ids
  tool_error      a tool call that raised or returned an error
  parse_error     a parser call that raised or returned a malformed tool call
  mismatch        logprob_diff_max an outlier for its step (median + 10 MADs, at least 0.1) or
                  above --mismatch-max (1.0); importance_ratio beyond 2x either way; with the
                  trainer's per-token log-probs, a step `rlreplay mismatch` calls investigate
                  (token_mult_prob_error > 1.05) or broken (> 2)
  group_collapse  a training group whose rollouts all got the same reward (zero advantage)
  length_drift    mean response length up 50% from the first third of the steps to the last,
                  mean reward up less than 0.05
  reward_drift    mean reward up 0.1 while the tool success rate falls 10 points
"""


@app.command("audit", help=AUDIT_HELP)
@selection_options
def audit_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    checks: Annotated[
        str | None, typer.Option("--checks", metavar="A,B", help="Only these checks (default: all).")
    ] = None,
    fail_on: Annotated[
        str | None,
        typer.Option(
            "--fail-on",
            metavar="CHECKS|none",
            help="Exit 1 when these checks find something (default: the trajectory-level checks).",
        ),
    ] = None,
    mismatch_max: Annotated[
        float | None,
        typer.Option("--mismatch-max", metavar="VALUE", help="mismatch: flag logprob_diff_max above this."),
    ] = None,
    threshold: Annotated[
        list[str] | None, typer.Option("--threshold", metavar="KEY=VALUE", help="Override a threshold.")
    ] = None,
    tokenizer: TokenizerOption = None,
    as_json: JsonOption = False,
    engine_name: EngineOption = "local",
    ray_address: RayAddressOption = None,
    *,
    selection: Any,
) -> int:
    from rlreplay.audit import engine
    from rlreplay.audit.finding import parse_thresholds

    broken: dict[str, str] = {}  # check plug-ins that cannot be loaded
    installed = engine.available(broken)
    chosen = engine.choose(checks, installed, broken)  # one named but broken: exit 2
    failing = _fail_on(fail_on, installed, broken)
    named = set(failing if fail_on is not None else ()) | {c.name for c in chosen if checks is not None}
    for name, why in broken.items():
        print(f"rlreplay: warning: check {name} skipped: {why}", file=sys.stderr)
    known = engine.default_thresholds(installed.values())
    overrides = parse_thresholds(threshold or [], known)
    if mismatch_max is not None:
        if not math.isfinite(mismatch_max):
            fail(f"--mismatch-max {mismatch_max}: give a finite number")
        overrides["mismatch_max"] = mismatch_max
    cluster = cluster_for(engine_name, ray_address)
    opened = open_run_arg(run, run_path)
    listing = selection.trajectories(opened)
    if cluster is None:
        report = engine.audit(opened, listing, chosen, overrides, tokenizer)
    else:
        from rlreplay.engine import audit as audit_on

        report = audit_on(opened, listing, chosen, overrides, tokenizer, cluster)
    report_warnings(opened)
    for name, why in report.skipped.items():
        print(f"rlreplay: note: {name} skipped: {why}", file=sys.stderr)
    for name, why in report.failed.items():
        print(f"rlreplay: warning: check {name} failed, its findings left out: {why}", file=sys.stderr)
    incomplete = opened.incomplete()
    if as_json:
        import orjson

        write = sys.stdout.write
        for finding in report.findings:
            write(orjson.dumps(finding.to_dict()).decode() + "\n")
    else:
        sys.stdout.write(render(report, incomplete))
    if incomplete is not None or named & set(report.failed):
        return EXIT_COULD_NOT_RUN  # not audited in full: neither clean nor only findings
    return 1 if any(f.check in failing for f in report.findings) else 0


#: audit's exit code when it could not run in full (as for bad input)
EXIT_COULD_NOT_RUN = 2


def _fail_on(text: str | None, installed: dict[str, Any], broken: dict[str, str]) -> set[str]:
    if text is None:
        from rlreplay.audit.engine import trajectory_checks

        return set(trajectory_checks(installed))
    if text.strip() == "none":
        return set()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unusable = [n for n in names if n in broken]
    if unusable:
        fail(f"--fail-on: check {unusable[0]}: {broken[unusable[0]]}")
    unknown = [n for n in names if n not in installed]
    if unknown or not names:
        fail(
            f"--fail-on: unknown check {', '.join(unknown) or '(none given)'}; checks: {', '.join(installed)}"
        )
    return set(names)


def render(report: Any, incomplete: str | None = None) -> str:
    """The report as text: per check, a table of findings per step and one of the worst examples;
    ``incomplete``: the line saying the run could not be read in full."""
    lines = []
    by_check: dict[str, list[Any]] = {c.name: [] for c in report.checks}
    for finding in report.findings:
        by_check.setdefault(finding.check, []).append(finding)
    width = max(len(name) for name in by_check) if by_check else 0
    lines.append(f"audited {trajectories(report.trajectories)}")
    if incomplete is not None:
        lines.append(f"  not in full: {incomplete}")
    for name, found in by_check.items():
        if name in report.failed:
            state = f"failed ({report.failed[name]})"
        elif name in report.skipped:
            state = f"skipped ({report.skipped[name]})"
        else:
            state = plural(len(found), "finding")
        lines.append(f"  {name.ljust(width)}  {state}")
    for name, found in by_check.items():
        if not found:
            continue
        lines += ["", f"{name}: {plural(len(found), 'finding')}"]
        steps: dict[str, int] = {}
        for f in found:
            steps[str(f.step)] = steps.get(str(f.step), 0) + 1
        by_step = [[step, str(n)] for step, n in steps.items()]
        lines += text_table(["step", "findings"], by_step, right=[False, False], indent="  ")[0]
        worst = sorted(found, key=lambda f: -f.score)[:EXAMPLES]
        rows = [["id", *KEYS, "detail"]]
        for f in worst:
            cells = [f.trajectory_id[:12] if f.trajectory_id else "-", *(getattr(f, k) for k in KEYS)]
            rows.append(["-" if c is None else str(c) for c in cells] + [f.detail])
        table, _ = text_table(
            rows[0], rows[1:], width=terminal_width(), right=[False] * 5, text_column=4, indent="  "
        )
        lines += ["  worst:", *table]
    return "\n".join(lines) + "\n"
