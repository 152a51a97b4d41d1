"""``rlreplay watch`` beside a real generic job recorded by ``rlreplay record``: a step event for every
step, alerts from the fault step on naming the faulty rollouts only, printed while the job runs."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import rlreplay_proc as rlreplay
from watch_live import Watched, faulty_ids, watch_beside

from rlreplay.watch import NAMED, THRESHOLDS, WINDOW, StepSummary, Watcher, binomial_tail

STEPS = 6
FAULT_STEP = 3
ROOT = Path(__file__).resolve().parents[2]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> tuple[Watched, Path, Path]:
    """The job with a fault from FAULT_STEP, watched with --on-alert appending each alert to a file."""
    base = tmp_path_factory.mktemp("watch")
    alerts_file = base / "alerts.jsonl"
    watched = watch_beside(
        str(base / "run"),
        base / "control",
        STEPS,
        FAULT_STEP,
        watch_args=("--on-alert", f"cat >> {alerts_file}"),
    )
    return watched, base, alerts_file


def test_alerts_come_at_the_fault_step_naming_the_faulty_rollouts_only_while_the_job_runs(faulty) -> None:
    watched, base, _ = faulty
    assert watched.record_code == 0
    assert watched.steps == list(range(STEPS)), watched.events  # a step event for every step, in order
    assert watched.running_then  # the first alert was printed before the job ended
    assert watched.watch_code == 1, watched.watch_stderr
    assert "Traceback" not in watched.watch_stderr
    ids = faulty_ids(base / "control")
    assert not [a for a in watched.alerts if a["step"] < FAULT_STEP]
    early = [a for a in watched.alerts if a["step"] in (FAULT_STEP, FAULT_STEP + 1)]
    assert early
    for alert in early:
        bad = {i for i, is_bad in ids[alert["step"]].items() if is_bad}
        assert set(alert["trajectories"]) <= bad, alert  # no healthy rollout named
        assert alert["count"] == len(alert["trajectories"])
    by_check = {a["check"]: a for a in early if a["step"] == FAULT_STEP}
    faulty_at_k = {i for i, is_bad in ids[FAULT_STEP].items() if is_bad}
    assert len(faulty_at_k) == len(ids[FAULT_STEP]) // 2
    for check in ("repetition", "tool_error"):  # the two faults, each naming every faulty rollout
        assert set(by_check[check]["trajectories"]) == faulty_at_k, by_check
    step_events = {e["step"]: e for e in watched.events if e["event"] == "step"}
    assert step_events[FAULT_STEP - 1]["findings"]["repetition"] == 0
    assert step_events[FAULT_STEP]["findings"]["repetition"] == len(faulty_at_k)
    assert step_events[FAULT_STEP]["tool_error_rate"] == 0.5  # one tool call per rollout, half fail
    assert step_events[0]["reward"] == 0.5


def test_on_alert_gets_each_alert_as_json_on_stdin(faulty) -> None:
    watched, _, alerts_file = faulty
    assert json_lines(alerts_file.read_text()) == watched.alerts


def test_a_healthy_job_gets_no_alert_and_exit_0(tmp_path: Path) -> None:
    watched = watch_beside(str(tmp_path / "run"), tmp_path / "control", 5, 99, until_step=3)
    assert watched.running_then
    assert watched.steps == list(range(5))
    assert watched.alerts == []
    assert watched.watch_code == 0, watched.watch_stderr


def test_the_real_verl_sample_run_is_healthy(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "verl-arith-smollm2", run)
    proc = rlreplay("watch", str(run), "--json", "--interval", "0.05")
    events = json_lines(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    listed = json_lines(rlreplay("ls", str(run), "--json").stdout)
    assert [e["step"] for e in events] == sorted({r["step"] for r in listed})
    assert all(e["event"] == "step" and e["mismatch"] == "healthy" for e in events)
    for e in events:
        train = [r for r in listed if r["step"] == e["step"] and not r["validate"]]
        assert e["reward"] == pytest.approx(sum(r["reward"] for r in train) / len(train))


def test_from_a_step_and_after_the_run_ended(faulty) -> None:
    _, base, _ = faulty
    late = rlreplay("watch", str(base / "run"), "--json", "--from", str(FAULT_STEP + 1))
    assert late.returncode == 0, late.stderr  # the steps before are not its baseline: nothing changed
    assert [e["step"] for e in json_lines(late.stdout)] == [FAULT_STEP + 1, FAULT_STEP + 2]
    since = rlreplay("watch", str(base / "run"), "--json", "--from", "1")
    events = json_lines(since.stdout)
    assert since.returncode == 1
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS))
    assert {e["step"] for e in events if e["event"] == "alert"} == {FAULT_STEP}


def test_a_failing_on_alert_command_is_a_warning_and_watching_goes_on(faulty) -> None:
    _, base, _ = faulty
    proc = rlreplay("watch", str(base / "run"), "--on-alert", "exit 3")
    alerts = [line for line in proc.stdout.splitlines() if line.startswith("ALERT")]
    assert proc.returncode == 1
    assert alerts and proc.stdout.splitlines()[-1].startswith(f"step {STEPS - 1} ")
    warnings = [line for line in proc.stderr.splitlines() if "--on-alert" in line]
    assert warnings == ["rlreplay: warning: --on-alert exited 3"] * len(alerts)


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, faulty) -> None:
    _, base, _ = faulty
    for args in (
        [str(tmp_path / "no-such-run")],
        [str(base / "run"), "--threshold", "no_such=1"],
        [str(base / "run"), "--from", "x"],
        [str(base / "run"), "--checks", "no_such_check"],
        [str(base / "run"), "--tokenizer", str(tmp_path / "no-such-tokenizer")],
    ):
        proc = rlreplay("watch", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("rlreplay: error: "), proc.stderr


def test_ctrl_c_ends_a_watch_of_a_running_run_cleanly(tmp_path: Path, faulty) -> None:
    _, base, _ = faulty
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "status": "running", "ended_at": None}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "watch", str(run), "--json", "--from", str(FAULT_STEP + 1)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())  # the newest step is not sealed for good: it waits
    time.sleep(0.5)
    assert first["step"] == FAULT_STEP + 1 and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == "" and err.strip().splitlines()[-1] == "rlreplay: watch stopped", err
    assert "Traceback" not in err


# ---- the trend checks, over any history -----------------------------------------------------------

N = 20


def exact_tail(k: int, n: int, p: float) -> float:
    """P(X >= k), X ~ Binomial(n, p), summed term by term."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(0, 82), p=st.floats(1e-4, 1 - 1e-4))
def test_binomial_tail_is_the_sum_of_the_terms(n: int, k: int, p: float) -> None:
    assert binomial_tail(k, n, p) == pytest.approx(exact_tail(k, n, p), rel=1e-9, abs=1e-300)


def _step(watcher: Watcher, step: int, flagged_n: int) -> list:
    rows = [
        {"id": f"s{step}-{k}", "validate": False, "reward": 0.5, "response_tokens": 100} for k in range(N)
    ]
    flagged = {"tool_error": [r["id"] for r in rows[:flagged_n]]}
    summary = StepSummary(step, N, {"tool_error": flagged_n / N}, 0.5, 100.0, None)
    return watcher.judge(summary, rows, flagged)


@settings(max_examples=200, deadline=None)
@given(
    steady=st.integers(0, N),
    earlier=st.integers(0, 12),
    now=st.integers(0, N),
)
def test_a_steady_history_alerts_only_on_a_jump_naming_exactly_the_flagged(
    steady: int, earlier: int, now: int
) -> None:
    watcher = Watcher([], {})
    for step in range(earlier):
        assert _step(watcher, step, steady) == []  # a steady run never alerts
    alerts = _step(watcher, earlier, now)
    jump = (now - steady) / N >= THRESHOLDS["alert_jump"] - 1e-9 and now >= THRESHOLDS["alert_min"]
    window = min(earlier, WINDOW)
    rate = (steady * window + 0.5) / (N * window + 1)
    unlikely = exact_tail(now, N, rate) <= THRESHOLDS["alert_p"]
    expected = jump and unlikely and earlier >= 2
    assert bool(alerts) == expected, (steady, earlier, now, alerts)
    if alerts:
        (alert,) = alerts
        assert alert.check == "tool_error" and alert.step == earlier
        assert alert.trajectories == [f"s{earlier}-{k}" for k in range(now)][:NAMED]
        assert alert.count == now


def test_reward_collapse_and_length_drift_name_the_trajectories_behind_them() -> None:
    watcher = Watcher([], {})
    for step in range(3):
        rows = [
            {"id": f"{step}-{k}", "validate": False, "reward": 0.8, "response_tokens": 100} for k in range(4)
        ]
        assert watcher.judge(StepSummary(step, 4, {}, 0.8, 100.0, None), rows, {}) == []
    rows = [
        {"id": "low-long", "validate": False, "reward": 0.0, "response_tokens": 400},
        {"id": "low", "validate": False, "reward": 0.1, "response_tokens": 100},
        {"id": "fine", "validate": False, "reward": 0.8, "response_tokens": 100},
        {"id": "val", "validate": True, "reward": 0.0, "response_tokens": 900},
    ]
    alerts = {a.check: a for a in watcher.judge(StepSummary(3, 4, {}, 0.3, 200.0, None), rows, {})}
    assert alerts["reward_collapse"].trajectories == ["low-long", "low"]
    assert alerts["length_drift"].trajectories == ["low-long"]


def test_a_mismatch_verdict_alerts_when_it_gets_worse_only() -> None:
    watcher = Watcher([], {})
    verdicts = ["healthy", "investigate", "investigate", "broken", "broken", "healthy", "investigate"]
    fired = []
    for step, verdict in enumerate(verdicts):
        summary = StepSummary(step, 1, {}, None, None, verdict)
        alerts = watcher.judge(summary, [], {}, worst_mismatch=[f"worst-{step}"])
        fired += [(a.step, a.severity, a.trajectories) for a in alerts if a.check == "mismatch_verdict"]
    assert fired == [(1, "warning", ["worst-1"]), (3, "error", ["worst-3"]), (6, "warning", ["worst-6"])]


def _running_copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    data = json.loads((to / "run.json").read_text())
    (to / "run.json").write_text(json.dumps({**data, "status": "running", "ended_at": None}))
    return to


def test_a_run_out_of_reach_for_a_while_is_watched_on_then_given_up(tmp_path: Path, faulty) -> None:
    _, base, _ = faulty
    run = _running_copy(base / "run", tmp_path / "run")
    args = [sys.executable, "-m", "rlreplay", "watch", str(run), "--json", "--interval", "0.1"]
    proc = subprocess.Popen(
        [*args, "--from", str(FAULT_STEP + 1)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["step"] == FAULT_STEP + 1
    run.rename(tmp_path / "away")  # the file system is gone for a while (a few looks)
    time.sleep(1.0)
    (tmp_path / "away").rename(run)
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "status": "finished", "ended_at": time.time()}))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [json.loads(line)["step"] for line in out.splitlines()] == [FAULT_STEP + 2]
    warned = [line for line in err.splitlines() if "cannot read the run now" in line]
    assert len(warned) == 1 and warned[0].startswith("rlreplay: warning: "), err
    # gone for good: after FAILED_LOOKS looks, one error line and exit 2
    _running_copy(base / "run", tmp_path / "gone")
    proc = subprocess.Popen(
        [*args[:4], str(tmp_path / "gone"), *args[5:], "--from", str(STEPS)],
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    shutil.rmtree(tmp_path / "gone")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.splitlines()[-1].startswith("rlreplay: error: ") and "Traceback" not in err
