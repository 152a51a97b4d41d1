"""Keys stay int64 from the listing to audit's findings and their JSON: 2**53 + 1 (no float holds
it) is reported as recorded, and groups whose keys differ only past a float's 53 bits stay apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import rlreplay_proc as _cli

#: Past a float's 53 bits of mantissa: as a float, K and K - 1 are the same number.
K = 2**53 + 1
ROLLOUTS = 4


def _record(run: Path) -> None:
    """Two groups at step K (samples K and K - 1) whose rollouts all got reward 1, and one rollout at
    step K - 1 whose importance ratio is far from 1."""
    code = f"""
import rlreplay
from rlreplay.recorder.signals import record_signals

rlreplay.init({str(run)!r}, experiment="int64", worker="w0")
for step, sample, n, ratio in {_plan()!r}:
    with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=n) as t:
        pass
    record_signals(t.id, step=step, sample_index=sample, rollout_n=n, validate=False, reward=1.0,
                   advantage=0.0, importance_ratio=ratio)
rlreplay.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _plan() -> list[tuple[int, int, int, float]]:
    groups = [(K, sample, n, 1.0) for sample in (K, K - 1) for n in range(ROLLOUTS)]
    return [*groups, (K - 1, 3, 0, 100.0)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("int64") / "run"
    _record(path)
    return path


def test_keys_past_53_bits_stay_exact_from_listing_to_audit_json(run: Path) -> None:
    listing = [json.loads(line) for line in _cli("ls", str(run), "--json").stdout.splitlines()]
    recorded = sorted((r["step"], r["sample_index"], r["rollout_n"]) for r in listing)
    assert recorded == sorted((s, i, n) for s, i, n, _ in _plan())

    proc = _cli("audit", str(run), "--json", "--checks", "group_collapse,mismatch")
    assert proc.returncode == 1, proc.stderr  # findings
    found = [json.loads(line) for line in proc.stdout.splitlines()]
    collapsed = sorted(
        (f["step"], f["sample_index"], f["detail"]) for f in found if f["check"] == "group_collapse"
    )
    detail = f"all {ROLLOUTS} rollouts got reward 1 (zero advantage)"
    assert collapsed == [(K, K - 1, detail), (K, K, detail)]
    far = [f for f in found if f["check"] == "mismatch"]
    assert [(f["step"], f["sample_index"], f["rollout_n"]) for f in far] == [(K - 1, 3, 0)]
    assert all(type(f[key]) is int for f in found for key in ("step", "sample_index") if f[key] is not None)


def test_the_audit_report_prints_the_keys_as_recorded(run: Path) -> None:
    proc = _cli("audit", str(run), "--checks", "group_collapse,mismatch")
    assert proc.returncode == 1, proc.stderr
    assert str(K) in proc.stdout and str(K - 1) in proc.stdout  # as floats, both print as K - 1
