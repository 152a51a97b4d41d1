"""``rlreplay watch``: follow a run while it is recorded, and alert on what changes."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Annotated, Any

import typer

from rlreplay.cli.app import (
    MAX_SECONDS,
    JsonOption,
    RunArgument,
    RunOption,
    TokenizerOption,
    app,
    open_run_arg,
    report_warnings,
    trajectories,
    whole_number,
)

#: Seconds an --on-alert command may run before it is stopped (watching goes on).
ON_ALERT_SECONDS = 60

WATCH_HELP = """Follow a run as it is recorded and alert on what changes.

As each step's shards are sealed (a later step began, or the run ended), runs the audit checks
(rlreplay audit --help) and the mismatch figures on that step, then trend checks against the
run's own earlier steps (the last 10). Prints one line per step (reward, advantage spread,
response length, tool error rate, mismatch verdict, findings by check) and one line per alert.

\b
Alerts are for what changed:
  CHECK            a check flags a share of the step's trajectories alert_jump (0.2) above its
                   share over the earlier steps (and 3 standard deviations of it), at least
                   alert_min (2) trajectories, and as many would come by chance at the earlier
                   rate with probability alert_p (0.01) at most (binomial)
  mismatch_verdict the mismatch verdict moves to investigate or broken
  reward_collapse  mean reward reward_drop (0.3) below the earlier steps' mean
  length_drift     mean response length length_growth (0.5) above the earlier steps' mean
Each names its trajectories, worst first (at most 50; "count" says how many in all).

--json: JSON lines, {"event": "step", ...} and {"event": "alert", "step", "check", "severity",
"message", "trajectories", "count"}. --on-alert CMD runs CMD (a shell command) per alert with the
alert's JSON on stdin; a CMD that fails is a warning and watching goes on.

Ends when the run ends (rlreplay record marks it finished in run.json; a run recorded by
rlreplay.init alone is followed until Ctrl-C) or on Ctrl-C. A look that cannot read the run is
a warning and is tried again (30 looks in a row: exit 2).

Exit code: 1 if any alert fired, 0 if none, 2 if the run could not be read.
"""


@app.command("watch", help=WATCH_HELP)
def watch_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    from_step: Annotated[
        str | None, typer.Option("--from", metavar="STEP", help="Start at this step (default: the first).")
    ] = None,
    on_alert: Annotated[
        str | None,
        typer.Option(
            "--on-alert", metavar="CMD", help="Run this shell command per alert, its JSON on stdin."
        ),
    ] = None,
    checks: Annotated[
        str | None, typer.Option("--checks", metavar="A,B", help="Only these checks (default: all).")
    ] = None,
    threshold: Annotated[
        list[str] | None,
        typer.Option("--threshold", metavar="KEY=VALUE", help="Override a threshold."),
    ] = None,
    interval: Annotated[
        float,
        typer.Option(
            "--interval", min=0.05, max=MAX_SECONDS, metavar="SECONDS", help="Seconds between looks (2)."
        ),
    ] = 2.0,
    tokenizer: TokenizerOption = None,
    as_json: JsonOption = False,
) -> int:
    from rlreplay import watch
    from rlreplay.audit import engine
    from rlreplay.audit.finding import parse_thresholds

    start = whole_number("--from", from_step)
    broken: dict[str, str] = {}
    installed = engine.available(broken)
    chosen = engine.choose(checks, installed, broken)
    for name, why in broken.items():
        print(f"rlreplay: warning: check {name} skipped: {why}", file=sys.stderr)
    known = {**engine.default_thresholds(installed.values()), **watch.THRESHOLDS}
    overrides = parse_thresholds(threshold or [], known)
    if tokenizer is not None:
        from rlreplay.text.token2text import Decoder

        Decoder.load(tokenizer)  # one that does not load is refused before watching (exit 2)
    first = open_run_arg(run, run_path)  # a run that cannot be opened: exit 2 before watching
    watcher = watch.Watcher(chosen, overrides, tokenizer)
    alerts = 0
    said: set[str] = set()

    def emit(opened: Any, result: Any, sealed_at: float) -> None:
        nonlocal alerts
        event = {**result.event, "delay_s": round(max(0.0, time.time() - sealed_at), 3)}
        _print(event, as_json)
        report_warnings(opened)  # what reading the step met (a damaged file), as it happens
        for name, why in watcher.notes.items():
            if name not in said:
                said.add(name)
                print(f"rlreplay: note: {name} not run: {why}", file=sys.stderr)
        for alert in result.alerts:
            alerts += 1
            _print(alert.to_dict(), as_json)
            if on_alert is not None:
                _run_on_alert(on_alert, alert.to_dict())

    opened = [first]

    def open_again() -> Any:
        if opened:
            return opened.pop()
        return open_run_arg(run, run_path)

    try:
        watch.follow(open_again, watcher, emit, from_step=start, interval=interval, warn=_warn_once())
    except KeyboardInterrupt:
        print("rlreplay: watch stopped", file=sys.stderr)
    return 1 if alerts else 0


def _warn_once() -> Any:
    """A warning printer that says each message once (secrets redacted)."""
    from rlreplay.format.redact import redact_value

    said: set[str] = set()

    def warn(message: str) -> None:
        if message not in said:
            said.add(message)
            print(f"rlreplay: warning: {redact_value(message)}", file=sys.stderr)

    return warn


def _print(event: dict[str, Any], as_json: bool) -> None:
    if as_json:
        import orjson

        sys.stdout.write(orjson.dumps(event).decode() + "\n")
    else:
        sys.stdout.write(render(event) + "\n")
    sys.stdout.flush()  # a line as soon as it is known, also into a pipe


def render(event: dict[str, Any]) -> str:
    """One event as a line of text."""
    if event["event"] == "alert":
        ids = ", ".join(i[:12] for i in event["trajectories"][:5])
        more = event["count"] - min(5, len(event["trajectories"]))
        named = f"{ids}{f' (+{more} more)' if more > 0 else ''}" if ids else "no trajectory named"
        return (
            f"ALERT step {event['step']} {event['check']} ({event['severity']}): {event['message']}: {named}"
        )
    cells = [f"step {event['step']}", trajectories(event["trajectories"])]
    for label, key in (("reward", "reward"), ("adv std", "advantage_std"), ("len", "response_tokens")):
        if event.get(key) is not None:
            cells.append(f"{label} {event[key]:.3g}")
    if event.get("tool_error_rate") is not None:
        cells.append(f"tool errors {event['tool_error_rate']:.0%}")
    cells.append(f"mismatch {event['mismatch'] or '-'}")
    found = [f"{name} {n}" for name, n in event["findings"].items() if n]
    cells.append("findings: " + (", ".join(found) if found else "none"))
    return "  ".join(cells)


def _run_on_alert(command: str, alert: dict[str, Any]) -> None:
    """Run ``command`` with the alert's JSON on stdin (its output goes to stderr); a failure is
    one warning line, never the end of the watch."""
    import orjson

    try:
        done = subprocess.run(
            command,
            shell=True,
            input=orjson.dumps(alert) + b"\n",
            stdout=sys.stderr,
            timeout=ON_ALERT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"rlreplay: warning: --on-alert stopped after {ON_ALERT_SECONDS}s", file=sys.stderr)
        return
    except OSError as exc:
        print(f"rlreplay: warning: --on-alert could not run: {exc.strerror or exc}", file=sys.stderr)
        return
    if done.returncode != 0:
        print(f"rlreplay: warning: --on-alert exited {done.returncode}", file=sys.stderr)
