"""The training signals where a researcher looks first: ``ls`` columns (fitted to the terminal),
``show``'s header and ``stats``, checked against ``ls --json`` computed independently."""

from __future__ import annotations

import json
import math
import os
import pty
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from support import rlreplay_proc as rlreplay

ROOT = Path(__file__).resolve().parents[2]
SIGNALS_RUN = ROOT / "sample_runs" / "verl-toolagent-smollm2"  # verl's driver recorded the signals
PLAIN_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"  # rewards only
#: The signals' columns, by their short names (aliases wherever a column is named).
SIGNAL_COLUMNS = {"adv": "advantage", "dlogp_max": "logprob_diff_max", "is_ratio": "importance_ratio"}
KEY_HEADER = ["id", "step", "sample_index", "rollout_n", "validate", "reward"]


def json_rows(run: Path, *args: str) -> list[dict]:
    proc = rlreplay("ls", str(run), "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def table(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = stdout.splitlines()
    return lines[0].split(), [line.split() for line in lines[1:-1]]


def close_to(cell: str, value: float) -> bool:
    return math.isclose(float(cell), value, rel_tol=5e-3, abs_tol=1e-12)


def test_ls_shows_advantage_mismatch_and_importance_ratio_when_the_run_has_them() -> None:
    rows = {r["id"][:12]: r for r in json_rows(SIGNALS_RUN, "--step", "1")}
    assert any(r["advantage"] is not None for r in rows.values())
    proc = rlreplay("ls", str(SIGNALS_RUN), "--step", "1")
    assert proc.returncode == 0, proc.stderr
    header, body = table(proc.stdout)
    assert header[:6] == KEY_HEADER
    assert len(body) == len(rows)
    for cells in body:
        row = rows[cells[0]]
        for field in SIGNAL_COLUMNS.values():
            assert close_to(cells[header.index(field)], row[field]), (field, cells, row[field])
        assert float(cells[header.index("reward")]) == row["reward"]


def test_ls_leaves_out_signal_columns_a_run_does_not_have() -> None:
    assert all(r["advantage"] is None for r in json_rows(PLAIN_RUN, "--step", "1"))
    proc = rlreplay("ls", str(PLAIN_RUN), "--step", "1")
    header, _ = table(proc.stdout)
    assert "reward" in header and not {*SIGNAL_COLUMNS, *SIGNAL_COLUMNS.values()} & set(header)


def test_ls_columns_chooses_and_orders() -> None:
    rows = json_rows(SIGNALS_RUN, "--step", "2")
    proc = rlreplay("ls", str(SIGNALS_RUN), "--step", "2", "--columns", "adv,step,id")
    assert proc.returncode == 0, proc.stderr
    header, body = table(proc.stdout)
    assert header == ["advantage", "step", "id"]  # an alias picks the column; the header is its name
    assert sorted(c[2] for c in body) == sorted(r["id"][:12] for r in rows)


def test_ls_columns_unknown_is_one_line_exit_2() -> None:
    proc = rlreplay("ls", str(SIGNALS_RUN), "--columns", "step,nope")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "'nope'" in proc.stderr


def test_an_empty_listing_says_so_on_stderr() -> None:
    proc = rlreplay("ls", str(SIGNALS_RUN), "--step", "999")
    assert proc.returncode == 0 and proc.stdout == ""
    assert "no trajectories selected" in proc.stderr


@pytest.mark.parametrize("width", [80, 120])
def test_ls_fits_the_terminal_without_squeezing_keys(width: int) -> None:
    rows = json_rows(SIGNALS_RUN, "--step", "1")
    env = {**os.environ, "COLUMNS": str(width), "LINES": "50", "NO_COLOR": "1"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: rlreplay ls on a terminal
        os.execvpe(
            sys.executable, [sys.executable, "-m", "rlreplay", "ls", str(SIGNALS_RUN), "--step", "1"], env
        )
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode())  # bold headers
    lines = [line for line in text.replace("\r", "").splitlines() if line.strip()]
    assert "…" not in out.decode()
    assert all(len(line) <= width for line in lines), [len(line) for line in lines]
    assert lines[0].split()[:6] == KEY_HEADER
    shown = {line.split()[0] for line in lines[1:-1]}
    assert shown == {r["id"][:12] for r in rows}
    assert len(lines[0].split()) < 16  # narrower than every column


def test_show_header_has_the_signals() -> None:
    row = json_rows(SIGNALS_RUN, "--step", "1", "--limit", "1")[0]
    proc = rlreplay("show", str(SIGNALS_RUN), row["id"], "--no-text")
    assert proc.returncode == 0, proc.stderr
    head = " ".join(proc.stdout.splitlines()[:3])
    for field in SIGNAL_COLUMNS.values():
        value = head.split(f"{field}=")[1].split()[0]
        assert close_to(value, row[field]), (field, value, row[field])


def test_stats_has_advantage_mismatch_and_importance_ratio_per_step() -> None:
    rows = json_rows(SIGNALS_RUN)
    proc = rlreplay("stats", str(SIGNALS_RUN), "--json")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert got
    for stat in got:
        mine = [r for r in rows if (r["step"], r["validate"]) == (stat["step"], stat["validate"])]
        adv = np.array([r["advantage"] for r in mine if r["advantage"] is not None], dtype=float)
        diff_mean = np.array([r["logprob_diff_mean"] for r in mine if r["logprob_diff_mean"] is not None])
        diff_max = np.array([r["logprob_diff_max"] for r in mine if r["logprob_diff_max"] is not None])
        ratio = np.array([r["importance_ratio"] for r in mine if r["importance_ratio"] is not None])
        expected = {
            "advantage_mean": adv.mean() if len(adv) else None,
            "advantage_std": adv.std() if len(adv) else None,
            "logprob_diff_mean": diff_mean.mean() if len(diff_mean) else None,
            "logprob_diff_p95": np.percentile(diff_max, 95) if len(diff_max) else None,
            "importance_ratio_p5": np.percentile(ratio, 5) if len(ratio) else None,
            "importance_ratio_p95": np.percentile(ratio, 95) if len(ratio) else None,
        }
        for key, value in expected.items():
            if value is None:
                assert stat[key] is None, (key, stat)
            else:
                assert math.isclose(stat[key], float(value), rel_tol=1e-9, abs_tol=1e-15), (
                    key,
                    stat[key],
                    value,
                )
    train = [s for s in got if not s["validate"]]
    assert any(s["advantage_std"] for s in train)


def test_stats_table_shows_signal_columns_only_when_present() -> None:
    with_signals = rlreplay("stats", str(SIGNALS_RUN)).stdout.splitlines()[0].split()
    without = rlreplay("stats", str(PLAIN_RUN)).stdout.splitlines()[0].split()
    assert {"advantage_mean", "importance_ratio_p95"} <= set(with_signals)
    assert not {"advantage_mean", "importance_ratio_p95"} & set(without)


def _group_table(run: Path, selector: str) -> tuple[list[str], list[list[str]]]:
    proc = rlreplay("diff", "-r", str(run), "--group", selector, env={**os.environ, "COLUMNS": "300"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rollout_n", "id"])
    says = ("best says:", "this says:")  # what a diverging rollout says, on the lines under its row
    rows = [
        line.split() for line in lines[start + 1 :] if line.strip() and not line.lstrip().startswith(says)
    ]
    return lines[start].split(), rows


def test_diff_group_shows_the_signals_per_rollout() -> None:
    rows = {r["id"][:12]: r for r in json_rows(SIGNALS_RUN, "--step", "1", "--sample-index", "26")}
    assert len(rows) > 1 and all(r["advantage"] is not None for r in rows.values())
    header, body = _group_table(SIGNALS_RUN, "step=1,sample_index=26")
    assert header[:6] == ["rollout_n", "id", "reward", *SIGNAL_COLUMNS.values()]
    assert sorted(cells[1] for cells in body) == sorted(rows)
    for cells in body:
        row = rows[cells[1]]
        assert float(cells[2]) == row["reward"]
        for i, field in enumerate(SIGNAL_COLUMNS.values(), start=3):
            assert close_to(cells[i], row[field]), (field, cells)
    proc = rlreplay("diff", "-r", str(SIGNALS_RUN), "--group", "step=1,sample_index=26", "--json")
    rollouts = {r["id"][:12]: r for r in json.loads(proc.stdout)["rollouts"]}
    for short, row in rows.items():
        for field in SIGNAL_COLUMNS.values():
            assert rollouts[short][field] == row[field]


def test_diff_group_leaves_out_signals_a_run_does_not_have() -> None:
    header, body = _group_table(PLAIN_RUN, "step=5,sample_index=730")
    assert body and "reward" in header and not {*SIGNAL_COLUMNS, *SIGNAL_COLUMNS.values()} & set(header)


def test_every_name_ls_shows_is_a_name_every_option_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """The ls header, --columns, --where, --sort and --json speak of a column by one name (the
    listing's); the short names (adv, sample, ...) are aliases wherever a column is named."""
    from rlreplay.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["ls", str(SIGNALS_RUN), "--step", "1", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    rows = [json.loads(line) for line in run("--json")[1].splitlines()]
    header, _ = table(run()[1])
    assert {"advantage", "logprob_diff_max", "importance_ratio", "sample_index", "rollout_n"} <= set(header)
    for name in header:
        assert name in rows[0], name  # the --json key
        for args in (["--sort", f"{name} desc"], ["--where", f"{name} IS NOT NULL"], ["--columns", name]):
            rc, out, err = run(*args)
            assert rc == 0 and err == "", (args, err)
        assert table(run("--columns", name)[1])[0] == [name]
    positive = [r["id"] for r in rows if r["advantage"] is not None and r["advantage"] > 0]
    assert 0 < len(positive) < len(rows)
    for alias, field in [*SIGNAL_COLUMNS.items(), ("sample", "sample_index"), ("rollout", "rollout_n")]:
        rc, out, err = run("--where", f"{alias} >= 0", "--sort", f"{alias} desc", "--json")
        assert rc == 0, err
        got = [json.loads(line) for line in out.splitlines()]
        kept = [r for r in rows if r[field] is not None and r[field] >= 0]
        assert [r["id"] for r in got] == [r["id"] for r in sorted(kept, key=lambda r: -r[field])], alias
        assert table(run("--columns", f"id,{alias}")[1])[0] == ["id", field]
    rc, out, _ = run("--where", "adv > 0", "--json")
    assert rc == 0 and [json.loads(line)["id"] for line in out.splitlines()] == positive


def test_sql_takes_the_short_names_too(capsys: pytest.CaptureFixture[str]) -> None:
    """``sql`` names the listing's columns as ``ls --json`` does, and accepts their aliases; a
    query that does not use an alias gets the listing's columns only."""
    from rlreplay.cli.main import main

    def sql(query: str) -> list[dict]:
        assert main(["sql", query, "--run", str(SIGNALS_RUN), "--json"]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert main(["ls", str(SIGNALS_RUN), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = sql("SELECT id, adv, dlogp_max, sample FROM trajectories WHERE is_ratio IS NOT NULL ORDER BY id")
    want = sorted((r for r in rows if r["importance_ratio"] is not None), key=lambda r: r["id"])
    assert [(g["id"], g["adv"], g["dlogp_max"], g["sample"]) for g in got] == [
        (r["id"], r["advantage"], r["logprob_diff_max"], r["sample_index"]) for r in want
    ]
    assert list(sql("SELECT * FROM trajectories LIMIT 1")[0]) == list(rows[0])
