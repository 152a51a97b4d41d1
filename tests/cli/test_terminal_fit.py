"""Every table command fits a 100-column terminal (a real pseudo-terminal) on the shipped sample runs,
keys and the most telling columns first; piped output keeps every column and every word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import on_terminal, rlreplay_proc

ROOT = Path(__file__).resolve().parents[2]
ARITH = "sample_runs/verl-arith-smollm2"  # per-token trainer log-probs
TOOLS = "sample_runs/verl-toolagent-smollm2"  # tool calls and tool errors
GSM8K = "sample_runs/gsm8k-grpo-qwen3"  # no trainer log-probs
COLUMNS = 100


def _piped(*args: str) -> str:
    done = rlreplay_proc(*args, cwd=ROOT)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


def _fits(text: str) -> list[str]:
    lines = text.splitlines()
    assert lines, "nothing printed"
    too_wide = [(len(line), line) for line in lines if len(line) > COLUMNS]
    assert not too_wide, too_wide
    return lines


def _two_ids(run: str) -> list[str]:
    rows = [json.loads(line) for line in _piped("ls", "--run", run, "--json").splitlines()]
    return [rows[0]["id"], rows[1]["id"]]


@pytest.mark.parametrize(
    "args",
    [
        ("info", "--run", TOOLS),
        ("ls", "--run", TOOLS),
        ("mismatch", "--run", ARITH),
        ("mismatch", "--run", TOOLS),
        ("audit", "--run", ARITH),
    ],
    ids=lambda a: f"{a[0]}@{a[2].split('/')[-1]}",
)
def test_command_fits_the_terminal(args: tuple[str, ...]) -> None:
    _fits(on_terminal(*args, columns=COLUMNS, exit_codes=(0, 1)))


def test_show_and_diff_fit_the_terminal() -> None:
    a, b = _two_ids(TOOLS)
    _fits(on_terminal("show", a, "--run", TOOLS, columns=COLUMNS))
    lines = _fits(on_terminal("diff", a, b, "--run", TOOLS, columns=COLUMNS))
    assert "tool calls (in call order):" in lines


def test_stats_keeps_the_first_columns_and_says_how_to_see_the_rest() -> None:
    rows = [json.loads(line) for line in _piped("stats", "--run", TOOLS, "--json").splitlines()]
    with_values = [
        k for k in rows[0] if k not in ("step", "validate") and any(r[k] is not None for r in rows)
    ]
    lines = _fits(on_terminal("stats", "--run", TOOLS, columns=COLUMNS))
    header = lines[0].split()
    assert header[:2] == ["step", "split"] and set(header[2:]) < set(with_values)
    assert {"trajectories", "reward_mean", "frac_groups_zero_std", "error_rate"} <= set(header)
    left_out = len(with_values) - (len(header) - 2)
    assert f"({left_out} more columns to fit the terminal: --columns NAMES, --json)" in lines
    # every column still has its trend line below the table
    trends = {line.split()[0] for line in lines if line.startswith("  ") and "→" in line}
    assert set(with_values) <= trends
    # piped: every column with values, no note
    piped = _piped("stats", "--run", TOOLS).splitlines()
    assert piped[0].split() == ["step", "split", *with_values]
    assert not any("more columns" in line for line in piped)


def test_audit_cuts_the_detail_to_fit_and_keeps_its_start() -> None:
    found = [json.loads(line) for line in _piped("audit", "--run", TOOLS, "--json").splitlines()]
    details = {f["detail"] for f in found}
    lines = _fits(on_terminal("audit", "--run", TOOLS, columns=COLUMNS, exit_codes=(1,)))
    cut = [line.rstrip("…").split("  ")[-1] for line in lines if line.endswith("…")]
    assert cut, "no detail was cut short"
    for start in cut:
        assert any(d.startswith(start.strip()) and len(d) > len(start.strip()) for d in details), start
    assert any(line.endswith("…") for line in lines) and not any(
        line.endswith("…") for line in _piped("audit", "--run", TOOLS).splitlines()
    )


@pytest.mark.parametrize(
    "args",
    [
        ("upload", ARITH, "--backend", "mlflow", "--max-samples", "2", "--dry-run"),
        ("mismatch", "--run", GSM8K),
    ],
    ids=["upload-dry-run", "mismatch-nothing-to-compare"],
)
def test_wrapped_text_loses_no_word(args: tuple[str, ...]) -> None:
    wrapped = _fits(on_terminal(*args, columns=COLUMNS))
    assert " ".join(" ".join(wrapped).split()) == " ".join(_piped(*args).split())
