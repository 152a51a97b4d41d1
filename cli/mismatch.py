"""``rlreplay mismatch``: where the trainer's and the rollout's log-probs part, over model tokens."""

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
    left_out_note,
    open_run_arg,
    report_warnings,
    selection_options,
    sparkline,
    terminal_width,
    text_table,
    whole_number,
    wrap_lines,
)
from rlreplay.format.keys import KEYS
from rlreplay.mismatch import BY as BY_KEYS

#: Said beside per-rollout figures.
PER_ROLLOUT = "per rollout, not per token: the trainer's figures of each rollout"

#: worst responses and tokens the text report shows
SHOWN = 5
MISMATCH_HELP = """Trainer vs rollout log-probs per token: the mismatch.

Compares the trainer's per-token log-probs (verl: old_log_probs, kept by `record --token-signals`)
with the rollout engine's (the agent's response_logprobs) over model tokens only (response_mask
1; tool and observation tokens never count). Per step and split: verl 0.9.1's off-policy metrics
(compute_offpolicy_metrics: kl, k3_kl, chi2_token, chi2_seq, training_ppl, rollout_ppl,
log_ppl_diff, ...), the gap |Δ| (mean, p99, max, each response's largest), token_mult_prob_error
(NeMo-RL), ratios beyond the TIS cap (2) and IcePop's bounds ([0.5, 5]), the effective sample size
and a verdict; then the trend over steps and the worst responses and tokens.

\b
--by KEY buckets the same numbers:
  step         per step and split (the default)
  worker       the worker that recorded each response (a bad node)
  position     position in the response (0-15, 16-31, 32-63, ...)
  probability  the rollout's probability of the sampled token, in tenths
  entropy      per-token entropy, where it was recorded
  turn         the model turn of the response
  token        token id, the --top largest by total |Δ|, decoded
  rollout      each response, the --top largest by max |Δ|
  version      the weights version a response was generated with (verl's max_global_steps)
  staleness    step - 1 - weights version (verl's trajectory_staleness)

\b
What counts: a model token whose trainer − rollout log-prob difference is a finite number. A
token with a NaN or ±inf log-prob on either side is left out and counted (tokens_not_finite in
--json); a response whose trainer log-probs (or rollout log-probs, or mask) are not one per
response token is left out whole and counted (lengths_differ), never cut or padded. A figure past
float64 from finite tokens is ±inf (--json: {"__type__": "float", "value": "inf"}).

\b
Without per-token trainer log-probs (verl recorded without --token-signals): the trainer's
per-rollout figures instead, labelled "per rollout" ("per": "rollout" in --json): the largest |Δ|
and its percentiles over rollouts, seq_logprob_diff_mean (mean over rollouts of each one's mean
|Δ|), chi2_seq and the sequence-level TIS/IcePop fractions from the importance ratio, computed
from the listing's logprob_diff_mean, logprob_diff_max and importance_ratio with the same
definitions; no verdict (it needs tokens). To record per-token trainer log-probs: verl, `rlreplay
record --token-signals` (or RLREPLAY_TOKEN_SIGNALS=1); the generic API,
`rlreplay.recorder.record_signals(trajectory_id, ..., output={"old_log_probs": [...]})`, one per
response token; behind `rlreplay proxy`, POST /rlreplay/signals with {"output": {"old_log_probs":
[...]}}, one per generated token of the trajectory's calls in call order.

Exit code: 0, also when there is nothing to compare (it says so); 2 on bad input or an empty
selection.
"""


@app.command("mismatch", help=MISMATCH_HELP)
@selection_options
def mismatch_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    by: Annotated[
        str, typer.Option("--by", metavar="KEY", help=f"Bucket by: {', '.join(BY_KEYS)} (default: step).")
    ] = "step",
    top: Annotated[
        str | None,
        typer.Option(
            "--top", metavar="N", help="--by token/rollout: the N largest buckets (default 20; 0: all)."
        ),
    ] = None,
    tokenizer: TokenizerOption = None,
    as_json: JsonOption = False,
    engine_name: EngineOption = "local",
    ray_address: RayAddressOption = None,
    *,
    selection: Any,
) -> None:
    from rlreplay.errors import NothingToCompare
    from rlreplay.mismatch import metrics
    from rlreplay.mismatch.report import LISTING_COLUMNS, WORST, compute

    if by not in BY_KEYS:
        fail(f"--by {by!r}: one of {', '.join(BY_KEYS)}")
    shown = whole_number("--top", top, minimum=0)
    cluster = cluster_for(engine_name, ray_address)
    opened = open_run_arg(run, run_path)
    listing = selection.trajectories(opened).select(LISTING_COLUMNS)  # the rest goes now
    decoder = _decoder(opened, tokenizer, wanted=by == "token" or not as_json)
    token_ids = not as_json  # --json prints no token (but with --by token)
    pieces = counts = None
    try:
        if cluster is not None:
            from rlreplay.engine import mismatch_pieces

            limits = (metrics.INVESTIGATE, metrics.BROKEN)
            pieces, counts = mismatch_pieces(opened, listing, by, token_ids, limits, cluster)
        report = compute(
            opened,
            listing,
            by=by,
            top=WORST if shown is None else (shown or None),
            decoder=decoder,
            token_ids=token_ids,
            pieces=pieces,
            counts=counts,
        )
    except NothingToCompare as exc:  # what the run does not have is an answer, not bad input
        if as_json:
            print(f"rlreplay: note: {exc}", file=sys.stderr)
        else:
            width = terminal_width()  # wrapped on a terminal, one line each to a pipe
            sys.stdout.write(f"{wrap_lines(exc.why, width)}\n{wrap_lines(exc.how, width)}\n")
        return
    finally:  # before any error: a damaged file may be why nothing could be compared
        report_warnings(opened)
    if as_json:
        _write_json(report)
        return
    sys.stdout.write(render(report, SHOWN))


def _decoder(opened: Any, tokenizer: str | None, wanted: bool) -> Any:
    """The run's tokenizer (or ``--tokenizer``) to decode tokens with; None when not wanted or
    not known. Asked for with --tokenizer and unavailable: an error (exit 2)."""
    from rlreplay.text.token2text import Decoder, TokenizerUnavailable, resolve_tokenizer

    if not wanted and tokenizer is None:
        return None
    name = resolve_tokenizer(opened, tokenizer)
    if name is None:
        return None
    try:
        return Decoder.load(name)
    except TokenizerUnavailable as exc:
        if tokenizer is not None:
            raise
        print(f"rlreplay: warning: {exc} (showing token ids)", file=sys.stderr)
        return None


def _write_json(report: Any) -> None:
    import orjson

    for note in report.notes:
        print(f"rlreplay: note: {note}", file=sys.stderr)
    from rlreplay.format.payload import float_marker

    if report.per == "rollout":
        print(f"rlreplay: note: {PER_ROLLOUT}; {report.how}", file=sys.stderr)
    rows = report.steps if report.buckets is None else report.buckets
    write = sys.stdout.write
    for row in rows:  # JSON has no NaN or infinity: the format's float marker says which
        row = {k: float_marker(v) if type(v) is float and not math.isfinite(v) else v for k, v in row.items()}
        write(orjson.dumps(row).decode() + "\n")


# ---- the text report ----------------------------------------------------------------------------

#: The per-step tables: (title, [(header, metric)]); the --json names are the metrics'.
STEP_TABLES = (
    (
        "verl 0.9.1 compute_offpolicy_metrics (rollout_corr/* in a training log)",
        [
            ("kl", "kl"),
            ("k3_kl", "k3_kl"),
            ("chi2_token", "chi2_token"),
            ("chi2_seq", "chi2_seq"),
            ("training_ppl", "training_ppl"),
            ("rollout_ppl", "rollout_ppl"),
            ("log_ppl_diff", "log_ppl_diff"),
            ("ppl_ratio", "ppl_ratio"),
        ],
    ),
    (
        "the gap |Δ| = |trainer − rollout| log-prob of each sampled model token (seq_max: a response's)",
        [
            ("diff_mean", "logprob_diff_mean"),
            ("diff_p99", "logprob_diff_p99"),
            ("diff_max", "logprob_diff_max"),
            ("seq_max_p50", "seq_logprob_diff_max_p50"),
            ("seq_max_p90", "seq_logprob_diff_max_p90"),
            ("seq_max_p99", "seq_logprob_diff_max_p99"),
            ("token_mult_prob_error", "token_mult_prob_error"),
            ("verdict", "verdict"),
        ],
    ),
    (
        "importance ratios ρ = exp(trainer − rollout) beyond the bounds (fractions), effective sample size",
        [
            ("tis_token", "tis_token_frac_high"),
            ("icepop_token", "icepop_token_frac_out"),
            ("tis_seq", "tis_seq_frac_high"),
            ("icepop_seq", "icepop_seq_frac_out"),
            ("eff_sample_size", "eff_sample_size"),
        ],
    ),
)
#: A bucket's columns: for every bucket, then for buckets of whole responses.
BUCKET_COLUMNS = [
    ("diff_mean", "logprob_diff_mean"),
    ("diff_max", "logprob_diff_max"),
    ("token_mult_prob_error", "token_mult_prob_error"),
    ("kl", "kl"),
    ("k3_kl", "k3_kl"),
    ("chi2_token", "chi2_token"),
    ("tis_token", "tis_token_frac_high"),
    ("icepop_token", "icepop_token_frac_out"),
    ("eff_sample_size", "eff_sample_size"),
]
SEQUENCE_COLUMNS = [
    ("seq_max_p50", "seq_logprob_diff_max_p50"),
    ("seq_max_p90", "seq_logprob_diff_max_p90"),
    ("chi2_seq", "chi2_seq"),
    ("log_ppl_diff", "log_ppl_diff"),
]
NAMES = (
    "columns are the --json names, shortened: diff_* = logprob_diff_*, seq_max_* = "
    "seq_logprob_diff_max_*, tis_* = tis_*_frac_high (ρ > 2), icepop_* = icepop_*_frac_out"
)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "val" if value else "train"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(header: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """Right-aligned columns, the first left-aligned; on a terminal, the first columns that fit it."""
    lines, left_out = text_table(header, rows, width=terminal_width(), indent=indent)
    return lines + [indent + n for n in left_out_note(left_out, "--json")]


def prose(*texts: str) -> list[str]:
    """Sentences as lines of at most ``WRAP`` characters."""
    import textwrap

    return [line for text in texts for line in textwrap.wrap(text, WRAP, subsequent_indent="  ")]


WRAP = 100


def render(report: Any, shown: int) -> str:
    from rlreplay.mismatch import metrics as m

    if report.per == "rollout":
        return render_per_rollout(report, shown)
    c = report.counts
    tokens = sum(r["tokens"] for r in report.steps)
    lines = prose(
        f"trainer vs rollout log-probs of {tokens} model tokens in {c.compared} of {c.selected} selected "
        "trajectories (response_mask 1: tool and observation tokens never count)",
        *(f"note: {n}" for n in report.notes),
    )
    if report.buckets is not None:
        lines += ["", *_buckets(report), "", *prose(NAMES, m.BOUNDS_RULE)]
        return "\n".join(lines) + "\n"
    for title, columns in STEP_TABLES:
        rows = [
            [
                fmt(r["step"]),
                fmt(r["validate"]),
                fmt(r["sequences"]),
                fmt(r["tokens"]),
                *(fmt(r[k]) for _, k in columns),
            ]
            for r in report.steps
        ]
        lines += [
            "",
            *prose(f"{title}:"),
            *table(["step", "split", "seqs", "tokens", *(h for h, _ in columns)], rows),
        ]
    lines += ["", *prose(NAMES, m.BOUNDS_RULE, m.VERDICT_RULE)]
    lines += _trend_lines(report.trend)
    lines += ["", "worst responses (largest |Δ|):"]
    rows = [
        [r["id"][:12], fmt(r["step"]), fmt(r["sample_index"]), fmt(r["rollout_n"]), fmt(r["tokens"]),
         fmt(r["logprob_diff_max"]), fmt(r["logprob_diff_mean"]), fmt(r["token_mult_prob_error"])]
        for r in report.worst_rollouts[:shown]
    ]  # fmt: skip
    header = [
        "id",
        "step",
        "sample_index",
        "rollout_n",
        "tokens",
        "diff_max",
        "diff_mean",
        "token_mult_prob_error",
    ]
    lines += table(header, rows, "  ")
    lines += ["", "worst tokens (largest |Δ|; position in the response):"]
    rows = [
        [r["id"][:12], fmt(r["step"]), fmt(r["sample_index"]), fmt(r["rollout_n"]), fmt(r["position"]),
         _token(r), fmt(r["rollout"]), fmt(r["trainer"]), fmt(r["logprob_diff"])]
        for r in report.worst_tokens[:shown]
    ]  # fmt: skip
    header = ["id", *KEYS, "position", "token", "rollout", "trainer", "|Δ|"]
    lines += table(header, rows, "  ")
    return "\n".join(lines) + "\n"


#: The per-rollout table: (header, metric).
ROLLOUT_TABLE = [
    ("seq_diff_mean", "seq_logprob_diff_mean"),
    ("diff_max", "logprob_diff_max"),
    ("seq_max_p50", "seq_logprob_diff_max_p50"),
    ("seq_max_p90", "seq_logprob_diff_max_p90"),
    ("seq_max_p99", "seq_logprob_diff_max_p99"),
    ("chi2_seq", "chi2_seq"),
    ("tis_seq", "tis_seq_frac_high"),
    ("icepop_seq", "icepop_seq_frac_out"),
]
ROLLOUT_NAMES = (
    "from the listing's logprob_diff_mean, logprob_diff_max and importance_ratio (ρ_seq = "
    "exp Σ(trainer − rollout)); columns are the --json names, shortened: seq_diff_mean = "
    "seq_logprob_diff_mean (mean over rollouts of each one's mean |Δ|), diff_max = logprob_diff_max, "
    "seq_max_* = seq_logprob_diff_max_* (over each rollout's largest |Δ|), tis_seq = tis_seq_frac_high "
    "(ρ_seq > 2), icepop_seq = icepop_seq_frac_out (outside [0.5, 5]); no token-level figure or "
    "verdict without per-token log-probs"
)


def render_per_rollout(report: Any, shown: int) -> str:
    """The text report of the trainer's per-rollout figures."""
    rollouts = sum(r["sequences"] for r in report.steps)
    lines = [
        *prose(
            f"{PER_ROLLOUT}: {rollouts} of {report.counts.selected} selected trajectories",
            *(f"note: {n}" for n in report.notes),
        ),
        report.how,
    ]
    if report.buckets is not None:
        return "\n".join(lines) + "\n"
    rows = [
        [fmt(r["step"]), fmt(r["validate"]), fmt(r["sequences"]), *(fmt(r[k]) for _, k in ROLLOUT_TABLE)]
        for r in report.steps
    ]
    lines += [
        "",
        "per rollout, per step:",
        *table(["step", "split", "rollouts", *(h for h, _ in ROLLOUT_TABLE)], rows),
    ]
    lines += ["", *prose(ROLLOUT_NAMES)]
    lines += _trend_lines(report.trend)
    lines += ["", "worst rollouts (largest |Δ|, per rollout):"]
    rows = [
        [r["id"][:12], fmt(r["step"]), fmt(r["sample_index"]), fmt(r["rollout_n"]),
         fmt(r["logprob_diff_max"]), fmt(r["logprob_diff_mean"]), fmt(r["importance_ratio"])]
        for r in report.worst_rollouts[:shown]
    ]  # fmt: skip
    header = ["id", *KEYS, "diff_max", "diff_mean", "importance_ratio"]
    lines += table(header, rows, "  ")
    return "\n".join(lines) + "\n"


def _trend_lines(trend: Any) -> list[str]:
    if trend is None:
        return []
    spark = sparkline(trend.values)
    return [
        "",
        *prose(f"trend of {trend.metric} over {len(trend.steps)} training steps: {spark}  {trend.text}"),
    ]


def _token(row: dict[str, Any]) -> str:
    text = row.get("text")
    return f"{row['token_id']} {text!r}" if text is not None else str(row["token_id"])


def _buckets(report: Any) -> list[str]:
    from rlreplay.mismatch import metrics as m

    by, rows = report.by, report.buckets
    if not rows:
        return [f"by {by}: no buckets"]
    columns = list(BUCKET_COLUMNS)
    head: list[str] = [by, "tokens"]
    if by in m.SEQUENCE_KEYS:
        head = [by, "seqs", "tokens"]
        columns += SEQUENCE_COLUMNS
    if by == "rollout":
        head = ["id", *KEYS, "tokens"]
    if by == "token":
        head = ["token", "text", "tokens", "diff_sum"]
    cells = []
    for r in rows:
        if by == "rollout":
            first = [
                r["id"][:12],
                fmt(r["step"]),
                fmt(r["sample_index"]),
                fmt(r["rollout_n"]),
                fmt(r["tokens"]),
            ]
        elif by == "token":
            text = "" if r["text"] is None else repr(r["text"])
            first = [fmt(r["bucket"]), text, fmt(r["tokens"]), fmt(r["logprob_diff_sum"])]
        elif by in m.SEQUENCE_KEYS:
            first = [fmt(r["bucket"]), fmt(r["sequences"]), fmt(r["tokens"])]
        else:
            first = [fmt(r["bucket"]), fmt(r["tokens"])]
        cells.append(first + [fmt(r[k]) for _, k in columns])
    return [f"by {by}:", *table(head + [h for h, _ in columns], cells)]
