"""``rlreplay audit`` on a short run of the real verl job (``sample_runs/make_verl_run.py``) in which
chosen rollouts go wrong on purpose: every problem the job ran into is found under the right check,
and no clean rollout is flagged (precision and recall counted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import rlreplay_proc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "sample_runs" / "make_verl_run.py"
#: (step, sample_index, rollout_n) -> the problem planted there; the job's prompts are indices 1000..1003
PLANTS = {
    (1, 1000, 0): "repetition",
    (1, 1000, 1): "truncated",
    (1, 1001, 0): "empty_response",
    (1, 1001, 1): "parse_error",
    (1, 1002, 0): "tool_error",
    (1, 1002, 1): "retokenization",
}
CHECKS = (
    "repetition",
    "truncated",
    "empty_response",
    "parse_error",
    "tool_error",
    "retokenization",
    "garbled",
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[tuple[str, tuple]], set[tuple]]:
    """The recorded run, what went wrong in it as the job itself noted it, and every rollout's key."""
    base = tmp_path_factory.mktemp("verl-planted")
    run_dir, events = base / "run", base / "events.jsonl"
    plant = ",".join(f"{s}:{i}:{n}={problem}" for (s, i, n), problem in PLANTS.items())
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--task=arith",
            "--steps=1",
            "--questions=4",
            "--prompts=4",
            "--n=2",
            "--val-questions=0",
            f"--plant={plant}",
            f"--events={events}",
            f"--out={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    happened = set()
    for line in events.read_text().splitlines():
        e = json.loads(line)
        happened.add((e["check"], (e["step"], e["sample_index"], e["rollout_n"])))
    keys = {(1, 1000 + i, n) for i in range(4) for n in range(2)}
    return run_dir, happened, keys


def test_every_planted_problem_happened(planted: tuple) -> None:
    _, happened, _ = planted
    assert {(problem, key) for key, problem in PLANTS.items()} <= happened


def test_audit_finds_what_went_wrong_and_flags_no_clean_rollout(planted: tuple) -> None:
    run_dir, happened, keys = planted
    proc = rlreplay_proc("audit", run_dir, "--json", "--checks", ",".join(CHECKS))
    assert proc.returncode == 1, proc.stderr
    found = set()
    for line in proc.stdout.splitlines():
        f = json.loads(line)
        assert f["check"] in CHECKS
        found.add((f["check"], (f["step"], f["sample_index"], f["rollout_n"])))
    hits = found & happened
    precision, recall = len(hits) / len(found), len(hits) / len(happened)
    assert (precision, recall) == (1.0, 1.0), (sorted(found - happened), sorted(happened - found))
    clean = keys - {key for _, key in happened}
    assert clean, "the run keeps clean rollouts to check precision on"
    assert not {key for _, key in found} & clean


def test_checks_over_calls_alone_find_what_whole_trajectories_give(planted: tuple) -> None:
    from test_audit_scan import over_whole_trajectories

    fast, whole = over_whole_trajectories(planted[0])
    assert fast == whole
    assert {f["check"] for f in whole} >= set(PLANTS.values())
