"""``rlreplay mismatch`` on bad input and on runs that cannot answer: one line, exit 2; the text
report shows what ``--json`` says."""

from __future__ import annotations

from functools import partial

import pytest
from support import rlreplay_proc
from test_mismatch_verl import ROOT, SHOWCASE, mismatch_json

rlreplay = partial(rlreplay_proc, "mismatch", cwd=ROOT)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([str(SHOWCASE), "--step", "9999"], "no trajectories selected"),
        ([str(SHOWCASE), "--by", "colour"], "--by 'colour': one of step, worker, position"),
        ([str(SHOWCASE), "--top", "-1"], "--top must be at least 0"),
        ([str(SHOWCASE), "--top", "x"], "--top: 'x' is not a whole number"),
        ([str(SHOWCASE), "--tokenizer", "/nonexistent", "--by", "token"], "/nonexistent"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], said: str) -> None:
    proc = rlreplay(*args)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_help_says_every_way_to_record_per_token_log_probs() -> None:
    proc = rlreplay("--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    for way in ("record --token-signals", "record_signals(", "POST /rlreplay/signals", "per rollout"):
        assert way in text, way


def test_the_text_report_shows_the_json_numbers() -> None:
    rows = mismatch_json(str(SHOWCASE))
    proc = rlreplay(str(SHOWCASE))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"model tokens in {sum(r['sequences'] for r in rows)} of 200 selected" in out
    verl_table = out.split("compute_offpolicy_metrics")[1].split("\n\n")[0].splitlines()[1:]
    header = verl_table[0].split()
    for row, line in zip(rows, verl_table[1:]):
        cells = dict(zip(header, line.split()))
        assert int(cells["step"]) == row["step"] and int(cells["tokens"]) == row["tokens"]
        for name in ("kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_diff"):
            assert float(cells[name]) == pytest.approx(row[name], rel=1e-3), name
    assert "TIS cap 2" in out and "IcePop [0.5, 5]" in out and "healthy ≤ 1.05" in out
    assert "trend of logprob_diff_mean over" in out and "worst tokens" in out


def test_the_readme_shows_the_commands_real_output_on_the_showcase_run() -> None:
    """docs/mismatch.md's example output is what the command prints on the shipped run as it is now
    (re-recording the run means pasting the new output)."""
    readme = (ROOT / "docs" / "mismatch.md").read_text()
    command = "rlreplay mismatch sample_runs/verl-arith-smollm2"
    shown = readme.split(f"```bash\n{command}\n```\n\n```text\n", 1)[1].split("```", 1)[0]
    proc = rlreplay(str(SHOWCASE))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
