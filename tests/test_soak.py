"""The soak's short profile (benchmarks/soak.py): nothing acknowledged is lost, nothing listed twice.

Recording processes are killed, the disk fills, indexes are corrupted, bytes of span files are
flipped (a local run) and (on S3) the store goes away, while a reader loops over ls, show, stats
and sql.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[1] / "benchmarks" / "soak.py"


def run_soak(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--json", str(out), "--seed", "3", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert proc.returncode == (0 if not _failed(result) else 1), proc.stderr[-4000:]
    return result


def _failed(result: dict) -> bool:
    calls = sum(result["reader_calls"].values())
    return bool(
        result["duplicated"]
        or result["silently_missing"]
        or result["mismatched"]
        or result["phantom"]
        or result["reader_errors"]
        or not result["listing_equals_direct_count"]
        or (calls and calls <= result["reader_refusals"] + result["reader_errors"])
    )


def assert_nothing_lost(result: dict) -> None:
    # acknowledged trajectories are listed, but those recover set aside with a file a flip damaged
    gone = result.get("lost_to_flips_acknowledged", 0)
    assert result["acknowledged"] > 0 and result["listed"] + gone >= result["acknowledged"], result
    assert result["duplicated"] == 0, result
    assert result["silently_missing"] == 0, result["missing_acknowledged"]
    assert result["mismatched"] == 0, result
    assert result["phantom"] == 0, result
    assert result["reader_errors"] == 0, result["reader_error_examples"]
    assert result["listing_equals_direct_count"], (result["listed"], result["direct_count"])
    calls = result["reader_calls"]
    assert calls.get("ls", 0) > 0 and calls.get("show", 0) > 0, calls


# The soaks below inject a fault every 1 to 2 s: a whole deck of the fault kinds (each kind once,
# in a seeded order) is made within about 15 s of the first step, at most about 22 s (each gap
# 2 s, a disk full for 5 s, a cold start killed after 1.5 s, a replacement's first step awaited).


def test_short_soak_of_a_local_run(tmp_path: Path) -> None:
    result = run_soak(
        tmp_path,
        *("--processes", "3", "--duration", "35", "--step-s", "0.3", "--readers", "1"),
        *("--fault-gap", "1", "2"),
        *("--disk-mb", "512", "--no-ui"),
    )
    assert_nothing_lost(result)
    faults = result["faults"]
    assert sum(v for k, v in faults.items() if k.startswith("kill")) >= 2, faults
    assert not [k for k in faults if "not made" in k or "died" in k], faults
    if os.geteuid() == 0:  # the disk is a tmpfs the soak mounts (only root can)
        assert faults.get("disk full", 0) >= 1, faults
    assert faults.get("corrupt .index", 0) + faults.get("corrupt run index", 0) >= 1, faults
    # bytes changed in span files: what their checksums reject is refused or set aside, never read
    # as other values (mismatched 0 above), and what recover set aside is counted apart
    assert sum(v for k, v in faults.items() if k.startswith("bytes flipped")) >= 1, faults
    assert result["flipped_files"] >= 1 and result["unreadable_acknowledged"] == 0, result


def test_short_soak_into_s3(tmp_path: Path) -> None:
    result = run_soak(
        tmp_path,
        *("--s3", "--processes", "2", "--duration", "15", "--step-s", "1", "--readers", "1"),
        *("--fault-gap", "1", "2"),
        *("--disk-mb", "512", "--no-ui"),
    )
    assert_nothing_lost(result)
    assert result["faults"], result


def test_slopes_count_only_processes_sampled_over_100_steps() -> None:
    """A replacement started late shows its start-up over a few steps: it must not set the worst
    slope; the report says how many processes were counted."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("soak_module", SOAK)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    mb = 1 << 20
    # (step, rss, fds, threads): flat over 300 steps; a late one climbing 50 MB over 30 steps
    flat = SimpleNamespace(samples=[(s, 200 * mb + (s % 3) * mb, 20, 6) for s in range(0, 300, 5)])
    late = SimpleNamespace(samples=[(s, (100 + 50 * (s - 900) / 30) * mb, 20, 6) for s in range(900, 930)])
    result = soak.Soak.slopes(SimpleNamespace(workers=[flat, late]))
    assert (result["processes_sampled"], result["processes_started"]) == (1, 2)
    assert abs(result["rss_mb_per_100_steps_worst"]) < 1
    assert result["peak_rss_mb"] == 202
