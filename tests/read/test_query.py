"""Selection grammar, ls/stats/sql/export over the sample runs, checked against listings computed
here straight from the span files (pyarrow.parquet and plain Python, not rlreplay's query code)."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import run_cli as cli

from rlreplay.errors import SelectionError
from rlreplay.read.selection import parse_keys, parse_sort

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
SMOLLM = ROOT / "sample_runs" / "verl-toolagent-smollm2"
META = [
    "trajectory_id",
    "span_id",
    "parent_id",
    "kind",
    "start_ns",
    "end_ns",
    "status",
    "reward",
    "response_tokens",
]
KEYS = ["step", "sample_index", "rollout_n", "validate", "experiment", "worker"]


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def span_rows(run_dir: Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Every span row of the sealed files (columns a file lacks, e.g. in format 1, are None)."""
    rows = []
    for f in sorted(run_dir.glob("spans/step=*/worker=*/*.parquet")):
        names = pq.read_schema(f).names
        table = pq.read_table(f, columns=[c for c in columns if c in names] if columns else None)
        rows += [{**dict.fromkeys(columns or []), **r} for r in table.to_pylist()]
    return rows


def expected_listing(run_dir: Path) -> list[dict[str, Any]]:
    """One dict per trajectory, by the contract's rules, in the listing's order."""
    by_traj: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in span_rows(run_dir, META + KEYS):
        by_traj[row["trajectory_id"]].append(row)
    out = []
    for tid, spans in by_traj.items():
        roots = [s for s in spans if s["parent_id"] is None]
        rewarded = [
            s for s in spans if s["kind"] in ("signals", "agent", "trajectory") and s["reward"] is not None
        ]
        start = min(s["start_ns"] for s in spans)
        agent = [
            s["response_tokens"] for s in spans if s["kind"] == "agent" and s["response_tokens"] is not None
        ]
        llm = [s["response_tokens"] for s in spans if s["kind"] == "llm" and s["response_tokens"] is not None]
        out.append(
            {
                "id": tid,
                **{k: spans[0][k] for k in KEYS},
                "start": start,
                "duration_s": (max(s["end_ns"] for s in spans) - start) / 1e9,
                "num_spans": len(spans),
                "model_calls": sum(s["kind"] == "llm" for s in spans),
                "tool_calls": sum(s["kind"] == "tool" for s in spans),
                "tool_errors": sum(s["kind"] == "tool" and s["status"] == "error" for s in spans),
                "status": "incomplete" if not roots else roots[0]["status"],
                "reward": max(rewarded, key=lambda s: s["end_ns"])["reward"] if rewarded else None,
                "response_tokens": agent[0] if agent else sum(llm) if llm else None,
            }
        )
    nulls_last = lambda v: (v is None, v if v is not None else 0)  # noqa: E731
    out.sort(
        key=lambda r: (
            nulls_last(r["step"]),
            nulls_last(r["sample_index"]),
            nulls_last(r["rollout_n"]),
            r["start"],
        )
    )
    return out


@pytest.fixture(scope="module")
def gsm8k() -> list[dict[str, Any]]:
    return expected_listing(GSM8K)


# --- the grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ints", "ranges", "strings"),
    [
        ("5", (5,), (), ()),
        ("3..7", (), ((3, 7),), ()),
        ("0..10,20,-1", (20, -1), ((0, 10),), ()),
        ("-5..-2, 4", (4,), ((-5, -2),), ()),
        ("007", (7,), (), ()),
        ("s1-3,2", (2,), (), ("s1-3",)),
    ],
)
def test_key_grammar(text: str, ints: tuple, ranges: tuple, strings: tuple) -> None:
    spec = parse_keys("--sample-index", text, allow_strings=True)
    assert (spec.ints, spec.ranges, spec.strings) == (ints, ranges, strings)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("7..3", "start is after end"),
        ("3..x", "bad range"),
        ("..4", "bad range"),
        ("５", "non-ASCII digits"),
        ("1..٣", "non-ASCII digits"),
        ("1,,2", "empty item"),
        ("", "empty value"),
        ("five", "not an integer"),
        ("2.5", "bad range" if False else "not an integer"),
    ],
)
def test_key_grammar_rejects(text: str, needle: str) -> None:
    with pytest.raises(SelectionError, match=needle):
        parse_keys("--step", text)


def test_full_width_digits_are_not_numbers_even_where_strings_are_allowed() -> None:
    with pytest.raises(SelectionError, match="non-ASCII"):
        parse_keys("--sample-index", "１２", allow_strings=True)


def test_sort_grammar() -> None:
    assert parse_sort("reward desc, duration_s, step ASC") == [
        ("reward", "descending"),
        ("duration_s", "ascending"),
        ("step", "ascending"),
    ]
    for bad, needle in [
        ("bogus", "unknown column 'bogus'"),
        ("reward sideways", "COLUMN [asc|desc]"),
        ("", "is not COLUMN"),
    ]:
        with pytest.raises(SelectionError, match=re.escape(needle)):
            parse_sort(bad)


# --- ls with every selection option -----------------------------------------------------------


def _sorted(rows: list[dict[str, Any]], key: str, desc: bool) -> list[dict[str, Any]]:
    present = [r for r in rows if r[key] is not None]
    missing = [r for r in rows if r[key] is None]
    return sorted(present, key=lambda r: r[key], reverse=desc) + missing


def _stable_desc(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Descending on ``key`` with ties in the listing's order (``sorted(reverse=True)`` keeps it too)."""
    return _sorted(rows, key, desc=True)


CASES: dict[str, tuple[list[str], Any]] = {
    "step": (["--step", "3"], lambda rs: [r for r in rs if r["step"] == 3]),
    "step-range": (["--step", "2..4"], lambda rs: [r for r in rs if 2 <= r["step"] <= 4]),
    "step-list": (["--step", "0..1,5,-1"], lambda rs: [r for r in rs if r["step"] in (0, 1, 5)]),
    "step-negative": (["--step", "-3..-1"], lambda rs: []),
    # a key option given twice means both values, as one list would
    "step-repeated": (
        ["--step", "1", "--step", "5..6"],
        lambda rs: [r for r in rs if r["step"] in (1, 5, 6)],
    ),
    "keys-repeated": (
        ["--sample-index", "0..60", "--rollout-n", "0", "--sample-index", "1114", "--rollout-n", "2"],
        lambda rs: [
            r
            for r in rs
            if (0 <= r["sample_index"] <= 60 or r["sample_index"] == 1114) and r["rollout_n"] in (0, 2)
        ],
    ),
    "sample-index": (
        ["--sample-index", "0..60,1114"],
        lambda rs: [r for r in rs if 0 <= r["sample_index"] <= 60 or r["sample_index"] == 1114],
    ),
    "rollout-n": (["--rollout-n", "1..2"], lambda rs: [r for r in rs if r["rollout_n"] in (1, 2)]),
    "validate": (["--validate"], lambda rs: [r for r in rs if r["validate"] is True]),
    "train": (["--train"], lambda rs: [r for r in rs if r["validate"] is False]),
    "experiment": (["--experiment", "gsm8k-grpo-qwen3"], lambda rs: rs),
    "experiment-other": (["--experiment", "other"], lambda rs: []),
    "status": (["--status", "ok"], lambda rs: [r for r in rs if r["status"] == "ok"]),
    "status-error": (["--status", "error"], lambda rs: []),
    "where": (
        ["--where", "reward > 0 and model_calls >= 3"],
        lambda rs: [r for r in rs if (r["reward"] or 0) > 0 and r["model_calls"] >= 3],
    ),
    "where-keys": (
        ["--where", "step % 2 = 1 and not validate and tool_calls = 0"],
        lambda rs: [r for r in rs if r["step"] % 2 == 1 and not r["validate"] and r["tool_calls"] == 0],
    ),
    "sort": (["--sort", "duration_s desc"], lambda rs: _stable_desc(rs, "duration_s")),
    "sort-two": (
        ["--sort", "reward desc, duration_s"],
        lambda rs: _stable_desc(_sorted(rs, "duration_s", desc=False), "reward"),
    ),
    "limit": (["--limit", "7"], lambda rs: rs[:7]),
    "issue-example": (
        ["--step", "5..7", "--sort", "reward desc", "--limit", "20"],
        lambda rs: _stable_desc([r for r in rs if 5 <= r["step"] <= 7], "reward")[:20],
    ),
    "everything": (
        [
            *("--step", "1..6", "--rollout-n", "0..2", "--train", "--status", "ok"),
            *("--where", "tool_calls >= 1", "--sort", "model_calls desc, duration_s asc", "--limit", "9"),
        ],
        lambda rs: _stable_desc(
            _sorted(
                [
                    r
                    for r in rs
                    if 1 <= r["step"] <= 6
                    and r["rollout_n"] <= 2
                    and not r["validate"]
                    and r["status"] == "ok"
                    and r["tool_calls"] >= 1
                ],
                "duration_s",
                desc=False,
            ),
            "model_calls",
        )[:9],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ls_selection(case: str, gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    argv, expect = CASES[case]
    rc, out, err = cli(capsys, "ls", GSM8K, *argv, "--json")
    assert rc == 0, err
    rows = json_lines(out)
    wanted = expect(gsm8k)
    assert [r["id"] for r in rows] == [r["id"] for r in wanted]
    for got, exp in zip(rows, wanted):
        for key in ("step", "sample_index", "rollout_n", "validate", "model_calls", "tool_calls", "status"):
            assert got[key] == exp[key], key
        assert got["reward"] == exp["reward"]


def test_ls_plain_output_lists_the_selection(
    gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "ls", GSM8K, "--step", "6..7", "--sort", "reward desc", "--limit", "5")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["id", "step", "sample_index"]
    wanted = _stable_desc([r for r in gsm8k if r["step"] in (6, 7)], "reward")[:5]
    assert [line.split()[0] for line in lines[1:6]] == [r["id"][:12] for r in wanted]
    assert lines[6] == f"5 trajectories (--limit) in {GSM8K}"


def test_ls_on_the_verl_sample_run(capsys: pytest.CaptureFixture[str]) -> None:
    listing = expected_listing(SMOLLM)
    rc, out, _ = cli(capsys, "ls", SMOLLM, "--step", "2", "--rollout-n", "1", "--json")
    assert rc == 0
    assert [r["id"] for r in json_lines(out)] == [
        r["id"] for r in listing if r["step"] == 2 and r["rollout_n"] == 1
    ]


def test_status_error_and_incomplete(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    # drop the root spans of two trajectories: they become incomplete
    victim = sorted(run.glob("spans/step=2/worker=*/*.parquet"))[0]
    table = pq.read_table(victim)
    roots = [r for r in table.to_pylist() if r["parent_id"] is None][:2]
    gone = {r["span_id"] for r in roots}
    kept = table.filter(pa.array([s not in gone for s in table["span_id"].to_pylist()]))
    pq.write_table(kept, victim)
    listing = expected_listing(run)
    for status in ("ok", "error", "incomplete"):
        rc, out, err = cli(capsys, "ls", run, "--status", status, "--json")
        assert rc == 0, err
        ids = [r["id"] for r in json_lines(out)]
        assert ids == [r["id"] for r in listing if r["status"] == status], status
        assert ids, status  # the fixture has each kind
    assert {r["trajectory_id"] for r in roots} == {r["id"] for r in listing if r["status"] == "incomplete"}


# --- bad input --------------------------------------------------------------------------------

BAD = [
    (["ls", "{run}", "--step", "7..3"], "start is after end"),
    (["ls", "{run}", "--step", "５"], "non-ASCII"),
    (["ls", "{run}", "--step", "five"], "not an integer"),
    (["ls", "{run}", "--sample-index", "1..x"], "bad range"),
    (["ls", "{run}", "--where", "nope > 1"], '"nope" not found'),
    (["ls", "{run}", "--where", "reward >"], "syntax error"),
    (["ls", "{run}", "--where", "reward > 'high'"], "--where"),
    (["ls", "{run}", "--where", "1=1); SELECT (1"], "not a single expression"),
    (["ls", "{run}", "--where", "  "], "empty expression"),
    (["ls", "{run}", "--sort", "bogus desc"], "unknown column 'bogus'"),
    (["ls", "{run}", "--sort", "reward sideways"], "COLUMN [asc|desc]"),
    (["ls", "{run}", "--status", "maybe"], "--status"),
    (["ls", "{run}", "--limit", "0"], "--limit must be at least 1"),
    (["ls", "{run}", "--limit", "５"], "not a whole number"),
    (["ls", "{run}", "--rollout-n", "１"], "non-ASCII"),
    (["export", "{run}", "--out", "{tmp}/x.jsonl", "--max-samples", "２"], "not a whole number"),
    (
        ["export", "{run}", "--out", "{tmp}/x.jsonl", "--max-samples", "1", "--seed", "７"],
        "not a whole number",
    ),
    (["stats", "{run}", "--columns", "bogus"], "unknown column 'bogus'"),
    (["stats", "{run}", "--plot", "{tmp}/chart.txt"], "--plot"),
    (["stats", "{run}", "--plot", "{run}/chart.html"], "inside the run directory"),
    (["stats", "{run}", "--where", "nope"], '"nope" not found'),
    (["sql", "selec 1", "--run", "{run}"], "syntax error"),
    (["sql", "select * from nope", "--run", "{run}"], "nope"),
    (["sql", "copy (select 1) to '{tmp}/x.csv'", "--run", "{run}"], "disabled"),
    (["sql", "select * from read_parquet('{tmp}/x.parquet')", "--run", "{run}"], "disabled"),
    (["sql", " ", "--run", "{run}"], "empty SQL"),
    (["sql", "SELECT 1; SELECT 2", "--run", "{run}"], "one statement at a time (got 2)"),
    (["ls", "{run}", "--status", "ok", "--status", "error"], "--status given twice"),
    (["ls", "{run}", "--where", "reward > 0", "--where", "step = 1"], "--where given twice"),
    (["ls", "{run}", "--limit", "3", "--limit", "4"], "--limit given twice"),
    (["sql", "--run", "{run}"], "give the query"),
    (["export", "{run}", "--format", "jsonl"], "--out"),
    (["export", "{run}", "--out", "{tmp}/x.csv"], "--format"),
    (["export", "{run}", "--out", "{tmp}/x.jsonl", "--format", "xml"], "--format"),
    (["export", "{run}", "--out", "{run}/x.jsonl"], "inside the run directory"),
    (["export", "{run}", "--out", "{run}/spans/x.parquet"], "inside the run directory"),
    (["export", "{run}", "--out", "{tmp}/missing/x.jsonl"], "no directory"),
    (["export", "{run}", "--out", "{tmp}", "--format", "jsonl"], "is a directory"),
    (["export", "{run}", "--out", "{tmp}/x.jsonl", "--max-samples", "0"], "--max-samples"),
    (["export", "{run}", "--out", "{tmp}/x.jsonl", "--step", "1..0"], "start is after end"),
]


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a[:1] + a[2:4]) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(run=GSM8K, tmp=tmp_path) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, out, err = cli(capsys, *argv)
    assert rc == 2, (out, err)
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("rlreplay: error: ")
    assert needle in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


# --- stats ------------------------------------------------------------------------------------


def expected_stats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    splits = sorted({(r["step"], r["validate"]) for r in rows})
    for step, validate in splits:
        mine = [r for r in rows if (r["step"], r["validate"]) == (step, validate)]
        rewards = np.array([r["reward"] for r in mine if r["reward"] is not None], dtype=float)
        groups: dict[Any, list[float]] = defaultdict(list)
        for r in mine:
            groups[r["sample_index"]].append(r["reward"])
        multi = [g for g in groups.values() if len([x for x in g if x is not None]) >= 2]
        durations = np.array([r["duration_s"] for r in mine])
        lengths = np.array(
            [r["response_tokens"] for r in mine if r["response_tokens"] is not None], dtype=float
        )
        tool_calls = sum(r["tool_calls"] for r in mine)
        out.append(
            {
                "step": step,
                "validate": validate,
                "trajectories": len(mine),
                "groups": len(groups),
                "reward_mean": float(rewards.mean()) if len(rewards) else None,
                "reward_std": float(rewards.std()) if len(rewards) else None,
                "frac_reward_positive": float((rewards > 0).mean()) if len(rewards) else None,
                "frac_groups_zero_std": (
                    sum(len({x for x in g if x is not None}) == 1 for g in multi) / len(multi)
                    if multi
                    else None
                ),
                "response_tokens_mean": float(lengths.mean()) if len(lengths) else None,
                "response_tokens_p95": float(np.percentile(lengths, 95)) if len(lengths) else None,
                "model_calls_mean": float(np.mean([r["model_calls"] for r in mine])),
                "tool_error_rate": sum(r["tool_errors"] for r in mine) / tool_calls if tool_calls else None,
                "tool_calls_mean": float(np.mean([r["tool_calls"] for r in mine])),
                "error_rate": sum(r["status"] == "error" for r in mine) / len(mine),
                "duration_p50_s": float(np.percentile(durations, 50)),
                "duration_p95_s": float(np.percentile(durations, 95)),
                **_signal_stats(mine),
            }
        )
    return out


def _signal_stats(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def present(name: str) -> np.ndarray:
        return np.array([r[name] for r in rows if r.get(name) is not None], dtype=float)

    adv, diff_mean, diff_max, ratio = (
        present(n) for n in ("advantage", "logprob_diff_mean", "logprob_diff_max", "importance_ratio")
    )
    return {
        "advantage_mean": float(adv.mean()) if len(adv) else None,
        "advantage_std": float(adv.std()) if len(adv) else None,
        "logprob_diff_mean": float(diff_mean.mean()) if len(diff_mean) else None,
        "logprob_diff_p95": float(np.percentile(diff_max, 95)) if len(diff_max) else None,
        "importance_ratio_p5": float(np.percentile(ratio, 5)) if len(ratio) else None,
        "importance_ratio_p95": float(np.percentile(ratio, 95)) if len(ratio) else None,
    }


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


STATS_NAMES = [
    "step",
    "validate",
    "trajectories",
    "groups",
    "reward_mean",
    "reward_std",
    "frac_reward_positive",
    "frac_groups_zero_std",
    "response_tokens_mean",
    "response_tokens_p95",
    "model_calls_mean",
    "tool_calls_mean",
    "tool_error_rate",
    "error_rate",
    "duration_p50_s",
    "duration_p95_s",
    "advantage_mean",
    "advantage_std",
    "logprob_diff_mean",
    "logprob_diff_p95",
    "importance_ratio_p5",
    "importance_ratio_p95",
]


@pytest.mark.parametrize(
    ("argv", "keep"),
    [
        ([], lambda r: True),
        (["--step", "2..5", "--train"], lambda r: 2 <= r["step"] <= 5 and not r["validate"]),
        (["--where", "model_calls >= 2"], lambda r: r["model_calls"] >= 2),
    ],
)
def test_stats_json(
    argv: list[str], keep: Any, gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "stats", GSM8K, *argv, "--json")
    assert rc == 0, err
    rows = json_lines(out)
    wanted = expected_stats([r for r in gsm8k if keep(r)])
    assert [list(r) for r in rows] == [STATS_NAMES] * len(rows)
    assert [(r["step"], r["validate"]) for r in rows] == [(w["step"], w["validate"]) for w in wanted]
    for got, exp in zip(rows, wanted):
        for key, value in exp.items():
            assert _close(got[key], value), (got["step"], got["validate"], key, got[key], value)


def test_stats_with_tool_errors(recorded_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "stats", recorded_run, "--json")
    assert rc == 0, err
    rows = json_lines(out)
    wanted = expected_stats(expected_listing(recorded_run))
    assert any(w["error_rate"] for w in wanted) and any(w["tool_error_rate"] for w in wanted)
    assert all(w["response_tokens_mean"] for w in wanted)
    for got, exp in zip(rows, wanted, strict=True):
        for key, value in exp.items():
            assert _close(got[key], value), (got["step"], got["validate"], key, got[key], value)


def test_stats_table_trends_and_plots(
    tmp_path: Path, gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "stats", GSM8K, "--columns", "reward_mean,tool_calls_mean")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["step", "split", "reward_mean", "tool_calls_mean"]
    wanted = expected_stats(gsm8k)
    assert len([line for line in lines[1:] if line.strip() and line.split()[0].isdigit()]) == len(wanted)
    trend = next(line for line in lines if line.strip().startswith("reward_mean") and "→" in line)
    bars = trend.split()[1]
    train = [w["reward_mean"] for w in wanted if not w["validate"]]
    assert len(bars) == len(train)
    # the highest step gets the tallest bar, the lowest the shortest
    assert bars[train.index(max(train))] == "█" and bars[train.index(min(train))] == "▁"

    html = tmp_path / "stats.html"
    rc, _, err = cli(capsys, "stats", GSM8K, "--plot", html, "--columns", "reward_mean,duration_p95_s")
    assert rc == 0, err
    text = html.read_text()
    assert text.count("<svg") == 2 and "reward_mean" in text and "duration_p95_s" in text
    assert text.count("<polyline") == 4  # two panels, train and val
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained
    rc, _, err = cli(capsys, "stats", GSM8K, "--plot", html)
    assert rc == 2 and "--force" in err
    rc, _, err = cli(capsys, "stats", GSM8K, "--plot", html, "--force", "--columns", "groups")
    assert rc == 0 and html.read_text().count("<svg") == 1

    png = tmp_path / "stats.png"
    rc, _, err = cli(capsys, "stats", GSM8K, "--plot", png)
    assert rc == 0, err
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 300
    svg = tmp_path / "stats.svg"
    rc, _, _ = cli(capsys, "stats", GSM8K, "--plot", svg, "--columns", "reward_mean")
    assert rc == 0 and svg.read_text().startswith("<svg")


# --- sql --------------------------------------------------------------------------------------


def test_sql_views(gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    spans = span_rows(GSM8K)
    rc, out, err = cli(
        capsys,
        "sql",
        "SELECT kind, count(*) AS n FROM spans GROUP BY kind ORDER BY kind",
        "--run",
        GSM8K,
        "--json",
    )
    assert rc == 0, err
    counts: dict[str, int] = defaultdict(int)
    for s in spans:
        counts[s["kind"]] += 1
    assert json_lines(out) == [{"kind": k, "n": counts[k]} for k in sorted(counts)]

    query = "SELECT id, step, reward FROM trajectories WHERE reward > 0 ORDER BY step, id"
    rc, out, _ = cli(capsys, "sql", query, "--run", GSM8K, "--json")
    wanted = sorted((r["step"], r["id"]) for r in gsm8k if (r["reward"] or 0) > 0)
    assert [(r["step"], r["id"]) for r in json_lines(out)] == wanted

    # payloads are JSON text, exactly as stored
    llm = next(s for s in spans if s["kind"] == "llm")
    rc, out, _ = cli(
        capsys,
        "sql",
        f"SELECT inputs FROM spans WHERE span_id = '{llm['span_id']}'",
        "--run",
        GSM8K,
        "--json",
    )
    assert json.loads(json_lines(out)[0]["inputs"]) == json.loads(llm["inputs"])

    # both views together
    query = (
        "SELECT t.id, count(*) AS n FROM trajectories t JOIN spans s ON s.trajectory_id = t.id "
        "WHERE t.step = 4 GROUP BY t.id ORDER BY t.id"
    )
    rc, out, _ = cli(capsys, "sql", query, "--run", GSM8K, "--json")
    assert [(r["id"], r["n"]) for r in json_lines(out)] == sorted(
        (r["id"], r["num_spans"]) for r in gsm8k if r["step"] == 4
    )

    rc, out, _ = cli(capsys, "sql", "SELECT count(*) AS n FROM trajectories", "--run", GSM8K)
    assert rc == 0 and out.splitlines()[1].strip() == str(len(gsm8k)) and out.endswith("(1 row)\n")
    # the run may come first, as on every command
    rc, out_first, _ = cli(capsys, "sql", GSM8K, "SELECT count(*) AS n FROM trajectories")
    assert rc == 0 and out_first == out


def test_queries_in_one_process_see_only_their_own_run_and_tables() -> None:
    """Queries share one database in a process (opening one is slow); what one query makes or
    registers is not seen by the next, whichever run it reads."""
    from rlreplay.errors import QueryError
    from rlreplay.read.open import open_run
    from rlreplay.read.query import sql

    gsm8k, smollm = open_run(GSM8K), open_run(SMOLLM)
    counts = {}
    for path, run in ((GSM8K, gsm8k), (SMOLLM, smollm), (GSM8K, gsm8k)):
        got = sql(run, "SELECT count(*) AS n FROM spans").to_pylist()[0]["n"]
        counts.setdefault(path, set()).add(got)
        assert got == len(span_rows(path))
    assert all(len(seen) == 1 for seen in counts.values())

    made = sql(gsm8k, "CREATE TABLE made AS SELECT 1 AS x")
    assert made.num_rows <= 1
    with pytest.raises(QueryError, match="made"):
        sql(gsm8k, "SELECT * FROM made")
    # the views earlier queries made are theirs alone: one that names no view sees none
    left = sql(smollm, "SELECT count(*) AS n FROM duckdb_views() WHERE NOT internal").to_pylist()
    assert left == [{"n": 0}]


# --- export -----------------------------------------------------------------------------------


def _agent_outputs(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each trajectory's agent span output, token arrays restored by the store."""
    import rlreplay

    run = rlreplay.open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        (agent,) = [s for s in traj.spans if s.kind == "agent"]
        out[traj.id] = agent.output
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_loads_with_datasets(
    fmt: str,
    tmp_path: Path,
    gsm8k: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / f"export.{fmt}"
    rc, _, err = cli(
        capsys,
        "export",
        GSM8K,
        "--step",
        "0,7",
        "--max-samples",
        "2",
        "--seed",
        "3",
        "--format",
        fmt,
        "--out",
        out,
        "--token-ids",
    )
    assert rc == 0, err
    assert "--max-samples 2 chose 2 prompts a step × 2 steps" in err
    data = datasets.load_dataset(
        fmt if fmt == "parquet" else "json",
        data_files=str(out),
        split="train",
        cache_dir=str(tmp_path / "hf"),
    )
    records = data.to_list()
    by_id = {r["id"]: r for r in gsm8k}
    # whole groups: 2 samples per step and split, each with all of its rollouts
    chosen: dict[tuple, set] = defaultdict(set)
    for rec in records:
        chosen[(rec["step"], rec["validate"])].add(rec["sample_index"])
    assert set(chosen) == {(0, False), (0, True), (7, False), (7, True)}
    assert all(len(samples) == 2 for samples in chosen.values())
    expected_ids = {
        r["id"] for r in gsm8k if r["sample_index"] in chosen.get((r["step"], r["validate"]), set())
    }
    assert {rec["id"] for rec in records} == expected_ids
    agents = _agent_outputs(GSM8K)
    for rec in records:
        exp = by_id[rec["id"]]
        assert (rec["step"], rec["sample_index"], rec["rollout_n"], rec["validate"]) == (
            exp["step"],
            exp["sample_index"],
            exp["rollout_n"],
            exp["validate"],
        )
        assert rec["reward"] == exp["reward"] and rec["advantage"] is None
        assert rec["prompt_ids"] == agents[rec["id"]]["prompt_ids"]
        assert rec["response_ids"] == agents[rec["id"]]["response_ids"]
        assert rec["response_mask"] == agents[rec["id"]]["response_mask"]
        roles = [m["role"] for m in rec["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert roles.count("assistant") == exp["model_calls"] and roles.count("tool") == exp["tool_calls"]
        for message in rec["messages"]:
            assert isinstance(message["content"], str)
            for call in message.get("tool_calls") or []:
                assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
                assert call["function"]["name"] == "calc_gsm8k_reward"
    answer = next(m for rec in records for m in rec["messages"] if m["role"] == "tool")
    assert answer["content"].startswith("Current parsed answer=")


def test_export_text_matches_the_token_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from support import qwen_tokenizer_dir
    from tokenizers import Tokenizer

    out = tmp_path / "x.jsonl"
    rc, _, err = cli(capsys, "export", GSM8K, "--step", "3", "--rollout-n", "0", "--limit", "3", "--out", out)
    assert rc == 0, err
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    agents = _agent_outputs(GSM8K)
    lines = json_lines(out.read_text())
    assert len(lines) == 3 and "prompt_ids" not in lines[0]
    for rec in lines:
        out_ids = agents[rec["id"]]
        first_turn = [t for t, m in zip(out_ids["response_ids"], out_ids["response_mask"]) if m == 1]
        text = tok.decode(first_turn, skip_special_tokens=False)
        assistant = next(m for m in rec["messages"] if m["role"] == "assistant")
        assert assistant["content"].split("<tool_call>")[0].strip()[:40] in text


def test_export_never_overwrites_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    out.write_text("precious\n")
    rc, _, err = cli(capsys, "export", GSM8K, "--step", "1", "--out", out)
    assert rc == 2 and "--force" in err and out.read_text() == "precious\n"
    link = tmp_path / "link.jsonl"
    link.symlink_to(GSM8K / "run.json")
    manifest = (GSM8K / "run.json").read_text()
    rc, _, err = cli(capsys, "export", GSM8K, "--step", "1", "--out", link, "--force")
    assert rc == 2 and "inside the run directory" in err
    assert (GSM8K / "run.json").read_text() == manifest
    rc, _, err = cli(capsys, "export", GSM8K, "--step", "1", "--out", out, "--force")
    assert rc == 0, err
    assert len(json_lines(out.read_text())) == sum(1 for r in expected_listing(GSM8K) if r["step"] == 1)


# --- keys that are not integers -------------------------------------------------------------


@pytest.fixture(scope="module")
def string_key_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run recorded with the real recorder whose sample_index is sometimes a string."""
    import asyncio

    import rlreplay

    run_dir = tmp_path_factory.mktemp("strkeys") / "run"

    @rlreplay.trace_op(name="Loop.run", kind="agent")
    async def run(i: int) -> dict:
        return {"reward_score": float(i % 2)}

    async def go() -> None:
        for step, sample in [(1, 0), (1, "s1-3"), (2, 7), (2, "s1-3"), (3, "b")]:
            for n in range(2):
                async with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=n, validate=False):
                    await run(n)

    rlreplay.init(run_dir, experiment="strkeys", worker="w0")
    try:
        asyncio.run(go())
    finally:
        rlreplay.close()
    return run_dir


def test_string_keys(string_key_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "ls", string_key_run, "--sample-index", "s1-3,7", "--json")
    assert rc == 0, err
    rows = json_lines(out)
    assert [(r["step"], r["sample_index"], r["rollout_n"]) for r in rows] == [
        (1, "s1-3", 0),
        (1, "s1-3", 1),
        (2, 7, 0),
        (2, 7, 1),
        (2, "s1-3", 0),
        (2, "s1-3", 1),
    ]
    rc, out, _ = cli(capsys, "ls", string_key_run, "--sample-index", "0..10", "--json")
    assert {r["sample_index"] for r in json_lines(out)} == {0, 7}
    rc, out, _ = cli(capsys, "ls", string_key_run, "--where", "sample_index = 'b'", "--json")
    assert [(r["step"], r["sample_index"]) for r in json_lines(out)] == [(3, "b"), (3, "b")]
    # in SQL the column holding a non-int value is VARCHAR; steps stay integers
    query = "SELECT DISTINCT typeof(step) AS s, typeof(sample_index) AS i FROM trajectories"
    rc, out, _ = cli(capsys, "sql", query, "--run", string_key_run, "--json")
    assert json_lines(out) == [{"s": "BIGINT", "i": "VARCHAR"}]
    rc, out, _ = cli(
        capsys, "sql", "SELECT DISTINCT sample_index FROM spans ORDER BY 1", "--run", string_key_run, "--json"
    )
    assert [r["sample_index"] for r in json_lines(out)] == ["0", "7", "b", "s1-3"]
    rc, out, _ = cli(capsys, "stats", string_key_run, "--json")
    assert [(r["step"], r["groups"], r["trajectories"]) for r in json_lines(out)] == [
        (1, 2, 4),
        (2, 2, 4),
        (3, 1, 2),
    ]


def test_string_keys_export_loads_with_datasets(
    string_key_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    from support import qwen_tokenizer_dir

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"x.{fmt}"
        rc, _, err = cli(capsys, "export", string_key_run, "--out", out, "--tokenizer", qwen_tokenizer_dir())
        assert rc == 0, err
        data = datasets.load_dataset(
            "json" if fmt == "jsonl" else fmt,
            data_files=str(out),
            split="train",
            cache_dir=str(tmp_path / "hf"),
        )
        assert data.features["sample_index"].dtype == "string" and data.features["step"].dtype == "int64"
        assert sorted(set(data["sample_index"])) == ["0", "7", "b", "s1-3"]


def test_diff_group_takes_the_selection(
    gsm8k: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    group = [r for r in gsm8k if r["step"] == 5 and r["sample_index"] == 730 and not r["validate"]]
    rc, out, err = cli(capsys, "diff", GSM8K, "--group", "step=5,sample_index=730", "--no-text", "--json")
    assert rc == 0, err
    assert sorted(r["id"] for r in json.loads(out)["rollouts"]) == sorted(r["id"] for r in group)
    argv = [
        "--group",
        "step=5,sample_index=730",
        "--no-text",
        "--rollout-n",
        "1..3",
        "--where",
        "reward > 0",
        "--json",
    ]
    rc, out, err = cli(capsys, "diff", GSM8K, *argv)
    assert rc == 0, err
    kept = [r for r in group if 1 <= r["rollout_n"] <= 3 and (r["reward"] or 0) > 0]
    assert kept and len(kept) < len(group)
    assert sorted(r["id"] for r in json.loads(out)["rollouts"]) == sorted(r["id"] for r in kept)
    rc, _, err = cli(capsys, "diff", GSM8K, "--group", "step=5,sample_index=730", "--where", "reward < 0")
    assert rc == 2 and "leaves none" in err
    rc, _, err = cli(
        capsys, "diff", GSM8K, "step=5,sample_index=730,rollout_n=0", "rollout_n=1", "--step", "5"
    )
    assert rc == 2 and "--group" in err and len(err.strip().splitlines()) == 1


def test_upload_takes_the_selection(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = expected_listing(run_copy)
    argv = [
        "upload",
        run_copy,
        "--backend",
        "mlflow",
        "--dry-run",
        "--json",
        "--step",
        "1..2",
        "--status",
        "ok",
    ]
    rc, out, err = cli(capsys, *argv, "--where", "tool_calls >= 1")
    assert rc == 0, err
    wanted = [r for r in listing if r["step"] in (1, 2) and r["status"] == "ok" and r["tool_calls"] >= 1]
    assert json.loads(out)["selected"] == len(wanted) > 0


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_of_an_empty_selection_writes_nothing_and_says_so(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / f"none{suffix}"
    rc, stdout, err = cli(capsys, "export", GSM8K, "--step", "999", "--out", out)
    assert rc == 1 and stdout == ""
    assert "no trajectories selected" in err and "nothing written" in err
    assert not out.exists() and sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dry_run", [True, False])
def test_upload_says_what_max_samples_chose(
    dry_run: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / SMOLLM.name
    shutil.copytree(SMOLLM, run)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    listing = expected_listing(run)
    train = [r for r in listing if not r["validate"]]
    val = [r for r in listing if r["validate"]]
    steps, val_steps = {r["step"] for r in train}, {r["step"] for r in val}
    rollouts = {
        len([x for x in train if (x["step"], x["sample_index"]) == (r["step"], r["sample_index"])])
        for r in train
    }
    assert len(rollouts) == 1 and len(steps) > 1 and val  # every group has n rollouts
    (n,) = rollouts
    expected = 2 * len(steps) * n + min(2, len(val) // len(val_steps)) * len(val_steps)
    dry = ["--dry-run"] if dry_run else []
    rc, out, err = cli(capsys, "upload", run, "--backend", "mlflow", "--max-samples", "2", *dry)
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("--max-samples 2"))
    val_prompts = min(2, len(val) // len(val_steps))

    def count(k: int, word: str) -> str:
        return f"{k} {word}{'' if k == 1 else 's'}"

    assert line == (
        f"--max-samples 2 chose 2 prompts a step × {count(len(steps), 'step')} × {count(n, 'rollout')}"
        f" ({2 * len(steps) * n}) + validation: {count(val_prompts, 'prompt')} a step"
        f" × {count(len(val_steps), 'step')} × 1 rollout ({val_prompts * len(val_steps)})"
        f" = {expected} trajectories"
    )
    rc, out, err = cli(
        capsys, "upload", run, "--backend", "mlflow", "--max-samples", "2", "--dry-run", "--json"
    )
    assert rc == 0, err
    assert json.loads(out)["max_samples"] == line.removeprefix("--max-samples 2 chose ")


# --- every filter before the sort and the limit ----------------------------------------------

ARITH = ROOT / "sample_runs" / "verl-arith-smollm2"


def test_finding_filters_before_the_sort_and_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """``ls --finding CHECK --limit N`` is the first N of what the check flags (the limit once came
    first and left nothing); a sort orders the flagged rows, then the limit cuts."""
    rc, out, err = cli(capsys, "audit", ARITH, "--checks", "truncated", "--fail-on", "none", "--json")
    assert rc == 0, err
    flagged = {f["trajectory_id"] for f in json_lines(out)}
    rc, out, _ = cli(capsys, "ls", ARITH, "--json")
    listing = [r for r in json_lines(out) if r["id"] in flagged]
    cut = {  # from the span files: the trajectories with a model call stopped on its length limit
        r["trajectory_id"]
        for f in ARITH.glob("spans/*/*/*.parquet")
        for r in pq.read_table(f, columns=["trajectory_id", "kind", "output"]).to_pylist()
        if r["kind"] == "llm" and json.loads(r["output"]).get("stop_reason") == "length"
    }
    assert len(listing) == len(flagged) == len(cut) > 0
    cases = [
        (["--limit", "1"], listing[:1]),
        (["--limit", "5"], listing[:5]),
        (["--sort", "duration_s desc", "--limit", "3"], _stable_desc(listing, "duration_s")[:3]),
        (["--where", "step >= 4", "--limit", "2"], [r for r in listing if r["step"] >= 4][:2]),
    ]
    for args, want in cases:
        rc, out, err = cli(capsys, "ls", ARITH, "--finding", "truncated", *args, "--json")
        assert rc == 0, err
        assert [r["id"] for r in json_lines(out)] == [r["id"] for r in want], args


#: Every command that selects trajectories, with the arguments it needs besides its selection.
SELECTING = {
    "ls": ["{run}"],
    "stats": ["{run}"],
    "audit": ["{run}"],
    "export": ["{run}", "--out", "{tmp}/x.jsonl"],
    "upload": ["{run}", "--dry-run"],
    "compare": ["{run}", "{run}"],
    "diff": ["{run}", "--group", "step=1,sample_index=1000"],
    "replay": ["{run}", "--out", "{tmp}/replayed", "--", "true"],
}
#: Selection options that take one value: given twice, bad input (the key options add up instead).
ONCE = [
    ["--train", "--train"],
    ["--validate", "--validate"],
    ["--validate", "--train"],
    ["--experiment", "a", "--experiment", "b"],
    ["--status", "ok", "--status", "ok"],
    ["--where", "reward > 0", "--where", "reward > 0"],
    ["--sort", "reward", "--sort", "reward"],
    ["--limit", "3", "--limit", "3"],
]


@pytest.mark.parametrize("command", list(SELECTING))
def test_a_selection_option_given_twice_is_bad_input(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--train --train`` (or ``--validate --train``) once passed silently, the last one winning."""
    args = [a.format(run=ARITH, tmp=tmp_path) for a in SELECTING[command]]
    split = args.index("--") if "--" in args else len(args)
    for twice in ONCE:
        rc, out, err = cli(capsys, command, *args[:split], *twice, *args[split:])
        assert rc == 2, (command, twice, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("rlreplay: error: "), err
        assert "twice" in err or "give one" in err, err
    assert list(tmp_path.iterdir()) == []


# --- --worker: a selection key like the others -------------------------------------------------


def _roots_by_worker(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Each worker's trajectories (their root spans' rows), read with pyarrow from the span files."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in span_rows(run_dir, ["trajectory_id", "parent_id", "kind", "worker", "step", "validate"]):
        if row["parent_id"] is None and row["kind"] != "signals":
            out[row["worker"]].append(row)
    return out


def test_worker_selects_in_every_selecting_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--worker NAME`` (and ``worker=NAME`` in a selector) keeps the trajectories that worker
    recorded, in ls, stats, audit, export, upload, compare, diff --group, show and replay's
    selection; counted against the root spans read straight from the span files."""
    from rlreplay.playback import ReplayConfig, selected
    from rlreplay.read.open import open_run
    from rlreplay.read.selection import Selection

    by_worker = _roots_by_worker(GSM8K)
    assert len(by_worker) == 2 and all(by_worker.values())
    copy = tmp_path / "copy"  # compare refuses a run with itself
    shutil.copytree(GSM8K, copy)
    for worker, roots in by_worker.items():
        mine = {r["trajectory_id"] for r in roots}
        rc, out, err = cli(capsys, "ls", GSM8K, "--worker", worker, "--json")
        assert rc == 0, err
        assert {r["id"] for r in json_lines(out)} == mine
        rc, out, err = cli(capsys, "stats", GSM8K, "--worker", worker, "--json")
        per_split: dict[tuple, int] = defaultdict(int)
        for r in roots:
            per_split[r["step"], r["validate"]] += 1
        assert {(s["step"], s["validate"]): s["trajectories"] for s in json_lines(out)} == per_split
        rc, out, err = cli(capsys, "audit", GSM8K, "--worker", worker, "--fail-on", "none")
        assert rc == 0 and out.splitlines()[0] == f"audited {len(mine)} trajectories", err
        target = tmp_path / f"{worker}.jsonl"
        rc, out, err = cli(capsys, "export", GSM8K, "--worker", worker, "--out", target)
        assert rc == 0, err
        assert {json.loads(line)["id"] for line in target.read_text().splitlines()} == mine
        rc, out, err = cli(capsys, "upload", GSM8K, "--worker", worker, "--dry-run")
        assert rc == 0 and f"selected {len(mine)} trajectories" in out + err, err
        rc, out, err = cli(capsys, "compare", GSM8K, copy, "--worker", worker, "--json")
        assert rc == 0 and {p["a"] for p in json_lines(out)} == mine, err
        # replay's selection reaches each process of the job through the environment
        env = ReplayConfig.of(GSM8K, select=Selection(worker=worker)).env()
        chosen = ReplayConfig.from_env(env)
        assert chosen is not None
        assert set(selected(open_run(GSM8K), chosen.selection)["id"].to_pylist()) == mine
    # selectors: a key like the others
    rows = json_lines(cli(capsys, "ls", GSM8K, "--step", "5", "--sample-index", "730", "--json")[1])
    one = rows[0]
    assert {r["id"] for r in rows} <= {r["trajectory_id"] for r in by_worker[one["worker"]]}  # one worker
    selector = f"step=5,sample_index=730,rollout_n={one['rollout_n']},worker={one['worker']}"
    rc, out, err = cli(capsys, "show", selector, "--run", GSM8K, "--json", "--no-text")
    assert rc == 0 and json.loads(out)["id"] == one["id"], err
    other = next(w for w in by_worker if w != one["worker"])
    rc, out, err = cli(capsys, "show", selector.replace(one["worker"], other), "--run", GSM8K)
    assert rc == 2 and f"no worker={other}" in err
    group = ["diff", "-r", GSM8K, "--group", "step=5,sample_index=730", "--json", "--worker"]
    rc, out, err = cli(capsys, *group, other)
    assert rc == 2 and "leaves none" in err  # the group's rollouts all come from one worker
    rc, out, err = cli(capsys, *group, one["worker"])
    assert rc == 0 and {r["id"] for r in json.loads(out)["rollouts"]} == {r["id"] for r in rows}
