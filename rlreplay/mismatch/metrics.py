"""Every mismatch number, defined once, over the tokens that count (model tokens with both log-probs).

With ``log ρ = trainer − rollout`` per token (the log importance ratio):

- verl 0.9.1's ``compute_offpolicy_metrics`` (``verl.trainer.ppo.rollout_corr_helper``, logged as
  ``rollout_corr/*``), with its names and definitions, its ``1e-8`` in masked means and its clamp of
  log ratios at ±20 (``SAFETY_BOUND``): ``kl`` = mean(rollout − trainer); ``k3_kl`` = mean(ρ − log ρ
  − 1); ``chi2_token`` = mean(ρ²) − 1; ``chi2_seq`` = mean over responses of (Πρ)² − 1;
  ``training_ppl`` / ``rollout_ppl`` = mean over responses of exp(−their mean log-prob) (and
  ``*_log_ppl``); ``log_ppl_diff`` = mean of (rollout mean log-prob − trainer mean log-prob), with
  ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min`` and ``ppl_ratio``.
- The gap |Δ| = |trainer − rollout| log-prob of the sampled token: ``logprob_diff_mean``,
  ``logprob_diff_p99``, ``logprob_diff_max``; the distribution of each response's largest |Δ|
  (``seq_logprob_diff_max_p50/p90/p99``); ``token_mult_prob_error`` = mean exp|Δ| (NeMo-RL).
- Importance ratios outside the usual bounds: ``tis_token_frac_high`` (ρ > 2, the TIS cap, verl's
  ``rollout_is_ratio_fraction_high``), ``icepop_token_frac_out`` (ρ outside [0.5, 5], verl's IcePop
  ``rollout_is_oob_ratio``), the same per response of Πρ (``tis_seq_frac_high``,
  ``icepop_seq_frac_out``) and ``eff_sample_size`` (verl's ``rollout_is_eff_sample_size`` of
  token weights truncated at 2).
- A verdict per step from ``token_mult_prob_error``, and the trend over steps.

Per-rollout figures (``rollout_metrics``), for a run that keeps only the trainer's summary of
each response (the listing's ``logprob_diff_mean``, ``logprob_diff_max``, ``importance_ratio``):
the sequence-level figures above that those determine, by the same definitions
(``logprob_diff_max``, ``seq_logprob_diff_max_*``, ``chi2_seq``, ``tis_seq_frac_high``,
``icepop_seq_frac_out``) and ``seq_logprob_diff_mean`` (the mean over responses of each one's
mean |Δ|); never the token-weighted ones.

Non-finite values: a token whose trainer − rollout difference is NaN or ±inf does not count (see
``rlreplay.mismatch.tokens``), nor does a per-rollout figure that is not finite; a figure that
overflows float64 from finite tokens (exp(|Δ|) for |Δ| > 709) is ±inf, one left undefined by
that (inf − inf) is None.

Numbers are computed in float64 from what was recorded. Per-response sums are kept (``SUMS``) so
that any group of responses (a step, a worker, a weights version) gets its numbers exactly;
token-level buckets (position, probability, ...) add up the same sums per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: verl clamps log importance ratios to ±20 before exponentiating (``SAFETY_BOUND``).
SAFETY_BOUND = 20.0
#: verl's ``masked_mean`` divides by the count + 1e-8.
EPS = 1e-8
#: The TIS cap (verl's ``rollout_is_threshold`` default) and the IcePop bounds.
TIS_CAP = 2.0
ICEPOP = (0.5, 5.0)
#: token_mult_prob_error above this: investigate (NeMo-RL's guide to adding models)
INVESTIGATE = 1.05
#: ... above this (the mean token's probability off by more than the TIS cap): broken
BROKEN = TIS_CAP
VERDICT_RULE = (
    f"verdict on token_mult_prob_error (mean exp|Δ|): healthy ≤ {INVESTIGATE:g} "
    f"(NeMo-RL's threshold to investigate) < investigate ≤ {BROKEN:g} (the TIS cap: verl's "
    f"rollout_is_threshold default) < broken"
)
BOUNDS_RULE = (
    f"importance ratio ρ = exp(trainer − rollout): TIS cap {TIS_CAP:g} (verl's default), "
    f"IcePop [{ICEPOP[0]:g}, {ICEPOP[1]:g}]"
)

#: verl 0.9.1 compute_offpolicy_metrics, its names (rollout_corr/NAME in a training log).
VERL_METRICS = (
    "training_ppl",
    "training_log_ppl",
    "kl",
    "k3_kl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)
GAP_METRICS = (
    "logprob_diff_mean",
    "seq_logprob_diff_mean",
    "logprob_diff_p99",
    "logprob_diff_max",
    "seq_logprob_diff_max_p50",
    "seq_logprob_diff_max_p90",
    "seq_logprob_diff_max_p99",
    "token_mult_prob_error",
    "tis_token_frac_high",
    "icepop_token_frac_out",
    "tis_seq_frac_high",
    "icepop_seq_frac_out",
    "eff_sample_size",
)
METRICS = ("sequences", "tokens", *VERL_METRICS, *GAP_METRICS)
#: Per-token terms summed per response and per token bucket (``max_abs`` is a maximum).
TOKEN_SUMS = (
    "tokens",
    "sum_log_ratio",
    "sum_abs",
    "max_abs",
    "sum_k3",
    "sum_rho2",
    "sum_exp_abs",
    "n_tis_high",
    "n_icepop_out",
    "sum_w",
    "sum_w2",
)
#: Per response: the token sums and its log-prob sums on each side.
SUMS = (*TOKEN_SUMS, "sum_trainer", "sum_rollout")


def terms(trainer: Any, rollout: Any) -> Iterator[tuple[str, Any]]:
    """``(name, per-token values)`` of each summed term in ``TOKEN_SUMS`` for counted tokens
    (float64 arrays of their trainer and rollout log-probs), one at a time: a step of tokens holds
    a few arrays, not all of them. ``sum_abs`` comes second, its values are each token's |Δ|."""
    with np.errstate(all="ignore"):
        log_ratio = trainer - rollout
    yield "sum_log_ratio", log_ratio
    gap = np.abs(log_ratio)
    yield "sum_abs", gap
    with np.errstate(all="ignore"):
        rho = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        exp_lr = rho  # exp(log ρ), unclamped: the same but beyond the clamp
        far = gap > SAFETY_BOUND
        if far.any():
            exp_lr = rho.copy()
            exp_lr[far] = np.exp(log_ratio[far])
        yield "sum_k3", exp_lr - log_ratio - 1.0
        yield "sum_exp_abs", np.where(log_ratio >= 0, exp_lr, 1.0 / exp_lr)
        del exp_lr, far
        yield "sum_rho2", rho * rho
        yield "n_tis_high", rho > TIS_CAP
        yield "n_icepop_out", (rho < ICEPOP[0]) | (rho > ICEPOP[1])
        weight = np.minimum(rho, TIS_CAP)
        yield "sum_w", weight
        yield "sum_w2", weight * weight


class Segments:
    """Groups of consecutive counted tokens (a response's): ``counts`` tokens each, in order."""

    def __init__(self, counts: Any) -> None:
        self.size = len(counts)
        self.nonempty = counts > 0
        self.starts = (np.cumsum(counts) - counts)[self.nonempty]
        self.counts = counts

    def add(self, values: Any) -> Any:
        out = np.zeros(self.size)
        if len(self.starts):
            with np.errstate(all="ignore"):  # a sum past float64: ±inf
                out[self.nonempty] = np.add.reduceat(values, self.starts, dtype=np.float64)
        return out

    def max(self, values: Any) -> Any:
        out = np.full(self.size, np.nan)
        if len(self.starts):
            out[self.nonempty] = np.maximum.reduceat(values, self.starts)
        return out


class Buckets:
    """``TOKEN_SUMS`` per token bucket (an int key ≥ 0), added up over steps: each response's
    sums per bucket first (:meth:`partials`), then those added to the bucket's in response order
    (:meth:`fold`), so the same floats come out however the responses were cut into pieces."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] | None = None

    @staticmethod
    def groups(response: Any, key: Any) -> tuple[Any, Any]:
        """(each group's bucket, each token's group) of tokens grouped by (response, bucket),
        the groups in response order (``response``: each token's, ascending; ``key``: its bucket)."""
        if not len(key):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        width = int(key.max()) + 1
        pairs, inverse = np.unique(response.astype(np.int64) * width + key, return_inverse=True)
        return pairs % width, inverse.reshape(-1)

    @staticmethod
    def partials(inverse: Any, size: int, name: str, values: Any) -> Any:
        """``values`` summed (``max_abs``: their largest; ``tokens``: counted) per group
        (``inverse``: each token's, of ``size`` groups), in the order of the tokens."""
        if name == "max_abs":
            out = np.full(size, np.nan)
            np.fmax.at(out, inverse, values)
            return out
        if name == "tokens":
            return np.bincount(inverse, minlength=size).astype(np.float64)
        return np.bincount(inverse, weights=values, minlength=size)

    def fold(self, name: str, bucket: Any, reduced: Any) -> None:
        """Add groups' :meth:`partials` (``bucket``: each group's) to the sums, one at a time in
        their order."""
        size = int(bucket.max()) + 1 if len(bucket) else 0
        sums = self.sums = self.sums if self.sums is not None else {}
        old = sums.get(name)
        if old is None or len(old) < size:
            fill = np.nan if name == "max_abs" else 0.0
            grown = np.full(max(size, len(old) if old is not None else 0), fill)
            if old is not None:
                grown[: len(old)] = old
            sums[name] = old = grown
        if name == "max_abs":
            np.fmax.at(old, bucket, reduced)
        else:
            with np.errstate(all="ignore"):  # a sum past float64: ±inf
                np.add.at(old, bucket, reduced)

    def size(self) -> int:
        return 0 if self.sums is None else max(len(v) for v in self.sums.values())

    def padded(self) -> dict[str, Any]:
        """The sums, every array as long as the longest."""
        n = self.size()
        out = {}
        for name in TOKEN_SUMS:
            values = self.sums.get(name, np.zeros(0)) if self.sums else np.zeros(0)
            fill = np.nan if name == "max_abs" else 0.0
            out[name] = np.concatenate([values, np.full(n - len(values), fill)])
        return out


#: Counted tokens taken at a time (whole responses): a step's per-token terms never all at once.
CHUNK_TOKENS = 1 << 18


def sequence_sums(
    batch: Any,
    counted: Any = None,
    each: Callable[[str, Any, slice], None] | None = None,
    chunk: int = CHUNK_TOKENS,
) -> dict[str, Any]:
    """``SUMS`` per response of a ``rlreplay.mismatch.tokens.Batch``, over its counted tokens,
    reduced a chunk of whole responses (about ``chunk`` tokens) at a time; ``each(name, values,
    at)`` (when given) sees every per-token term as it goes by, ``at`` the slice of the batch's
    counted tokens they are (``tokens``: the trainer's log-probs, ``max_abs``: each |Δ|)."""
    counted = batch.counted if counted is None else counted
    running = np.r_[0, np.cumsum(counted, dtype=np.int64)]
    counts = running[batch.offsets[1:]] - running[batch.offsets[:-1]]
    del running
    out = {name: np.zeros(len(counts)) for name in SUMS}
    out["max_abs"][:] = np.nan
    out["tokens"] = counts.astype(np.float64)
    done = np.r_[0, np.cumsum(counts)]  # counted tokens before each response
    first = 0
    while first < len(counts):
        last = int(np.searchsorted(done, done[first] + chunk, side="right")) - 1
        last = min(max(last, first + 1), len(counts))
        lo, hi = int(batch.offsets[first]), int(batch.offsets[last])
        chosen = counted[lo:hi]
        at = slice(int(done[first]), int(done[last]))
        segments = Segments(counts[first:last])
        trainer = batch.trainer[lo:hi][chosen].astype(np.float64, copy=False)
        rollout = batch.rollout[lo:hi][chosen].astype(np.float64, copy=False)
        if each is not None:
            each("tokens", trainer, at)
        out["sum_trainer"][first:last] = segments.add(trainer)
        out["sum_rollout"][first:last] = segments.add(rollout)
        for name, values in terms(trainer, rollout):
            out[name][first:last] = segments.add(values)
            if name == "sum_abs":
                out["max_abs"][first:last] = segments.max(values)
                if each is not None:
                    each("max_abs", values, at)
            if each is not None:
                each(name, values, at)
        first = last
    return out


#: The percentile of a group's every |Δ| (``logprob_diff_p99``).
GAP_PERCENTILE = 99
#: A piece of a step keeps twice what its own percentile would read, and this many more.
TAIL_SLACK = 32


def top_needed(count: int, q: float = GAP_PERCENTILE) -> int:
    """How many of the largest of ``count`` values numpy's ``percentile(values, q)`` (its linear
    method) reads: the values below those do not change it. Grows with ``count``."""
    if count <= 0:
        return 0
    virtual = (count - 1) * (q / 100)
    return 1 if virtual >= count - 1 else count - math.floor(virtual)


def percentile_of_top(count: int, top: Any, q: float = GAP_PERCENTILE) -> float:
    """``np.percentile(values, q)`` of ``count`` values from their largest ones (``top``,
    ascending, at least ``top_needed(count, q)`` of them): numpy's arithmetic, step for step."""
    virtual = (count - 1) * (q / 100)
    if virtual >= count - 1:
        return float(top[-1])
    below = math.floor(virtual)
    at = below - (count - len(top))  # ``top[0]`` is the value ranked count - len(top)
    a, b = float(top[at]), float(top[at + 1])
    gamma = virtual - below
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


@dataclass
class Tail:
    """The largest of a group's ``count`` values (``values``, ascending): what its percentile
    reads, merged from pieces of the group; ``whole``: ``values`` are all of them."""

    count: int
    values: Any
    whole: bool = True

    @classmethod
    def of(cls, values: Any, keep: int | None = None) -> Tail:
        """The tail of ``values``: their ``keep`` largest (at least :func:`spare`), or with None
        what their own percentile reads (a group not cut into pieces)."""
        n = len(values)
        k = top_needed(n) if keep is None else min(n, max(keep, spare(n)))
        top = np.sort(np.partition(values, n - k)[n - k :]) if 0 < k < n else np.sort(values)[n - k :]
        return cls(n, top, k == n)

    @classmethod
    def merged(cls, tails: list[Tail]) -> Tail | None:
        """The tail of the group made of ``tails``' groups, holding what its percentile reads;
        None when a tail left out a value that could be among those (its piece must keep more)."""
        count = sum(t.count for t in tails)
        need = top_needed(count)
        union = np.concatenate([t.values for t in tails]) if tails else np.zeros(0)
        if len(union) < need:
            return None
        top = np.sort(np.partition(union, len(union) - need)[len(union) - need :]) if need else union[:0]
        for t in tails:  # what a tail left out is at most its smallest value kept
            if not t.whole and (not len(t.values) or t.values[0] > top[0]):
                return None
        return cls(count, top, need == count)

    def percentile(self) -> float | None:
        """``np.percentile`` of the group's values (``GAP_PERCENTILE``); None: no values."""
        return percentile_of_top(self.count, self.values) if self.count else None


def spare(count: int) -> int:
    """Values a piece of a group keeps of its ``count``: twice what its own percentile reads, and
    ``TAIL_SLACK`` more (the group's percentile may read more of one piece than of another)."""
    return min(count, 2 * top_needed(count) + TAIL_SLACK)


def _f(value: Any) -> float | None:
    """A number as a Python float; None for NaN (no value)."""
    value = float(value)
    return None if math.isnan(value) else value


def summarize(
    totals: dict[str, float], sequences: dict[str, Any] | None = None, gaps: Any = None
) -> dict[str, Any]:
    """The metrics of a group of tokens from its ``totals`` (``TOKEN_SUMS`` added up), with
    ``sequences`` (per-response ``SUMS`` arrays of its responses) when the group is made of whole
    responses, and ``gaps`` (the :class:`Tail` of every |Δ| of the group) for the percentile.
    Missing numbers are None."""
    with np.errstate(all="ignore"):  # overflow: ±inf; inf − inf: None
        return _summarize(totals, sequences, gaps)


def _summarize(totals: dict[str, float], sequences: dict[str, Any] | None, gaps: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(METRICS)
    n = float(totals["tokens"])
    out["tokens"] = int(n)
    if sequences is not None:
        out["sequences"] = len(sequences["tokens"])
    if n > 0:
        count = n + EPS
        out["kl"] = _f(-totals["sum_log_ratio"] / count)
        out["k3_kl"] = _f(totals["sum_k3"] / count)
        out["chi2_token"] = _f(totals["sum_rho2"] / count - 1.0)
        out["logprob_diff_mean"] = _f(totals["sum_abs"] / n)
        out["logprob_diff_max"] = _f(totals["max_abs"])
        out["token_mult_prob_error"] = _f(totals["sum_exp_abs"] / n)
        out["tis_token_frac_high"] = _f(totals["n_tis_high"] / count)
        out["icepop_token_frac_out"] = _f(totals["n_icepop_out"] / count)
        mean_w = totals["sum_w"] / count
        if totals["sum_w2"] > 0:
            out["eff_sample_size"] = _f(count * (mean_w + EPS) ** 2 / totals["sum_w2"])
        if gaps is not None and gaps.count:
            out["logprob_diff_p99"] = _f(gaps.percentile())
    if sequences is not None and len(sequences["tokens"]):
        out.update(_sequence_metrics(sequences))
    return out


def _sequence_metrics(s: dict[str, Any]) -> dict[str, Any]:
    count = s["tokens"] + EPS
    trainer_mean = s["sum_trainer"] / count
    rollout_mean = s["sum_rollout"] / count
    diff = rollout_mean - trainer_mean
    out = {
        "training_ppl": _f(np.mean(np.exp(-trainer_mean))),
        "training_log_ppl": _f(np.mean(-trainer_mean)),
        "rollout_ppl": _f(np.mean(np.exp(-rollout_mean))),
        "rollout_log_ppl": _f(np.mean(-rollout_mean)),
        "log_ppl_diff": _f(np.mean(diff)),
        "log_ppl_abs_diff": _f(np.mean(np.abs(diff))),
        "log_ppl_diff_max": _f(np.max(diff)),
        "log_ppl_diff_min": _f(np.min(diff)),
        "ppl_ratio": _f(np.mean(np.exp(diff))),
        **_ratio_metrics(s["sum_log_ratio"]),
    }
    some = s["tokens"] > 0
    out.update(_largest_metrics(s["max_abs"][some], s["sum_abs"][some] / s["tokens"][some]))
    return out


def _ratio_metrics(log_ratio: Any) -> dict[str, Any]:
    """The sequence-level figures of each response's log importance ratio Σ log ρ."""
    if not len(log_ratio):
        return dict.fromkeys(("chi2_seq", "tis_seq_frac_high", "icepop_seq_frac_out"))
    clamped = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    outside = (log_ratio < math.log(ICEPOP[0])) | (log_ratio > math.log(ICEPOP[1]))
    return {
        "chi2_seq": _f(np.mean(np.exp(2.0 * clamped)) - 1.0),
        "tis_seq_frac_high": _f(np.mean(log_ratio > math.log(TIS_CAP))),
        "icepop_seq_frac_out": _f(np.mean(outside)),
    }


def _largest_metrics(largest: Any, means: Any) -> dict[str, Any]:
    """The figures of each response's largest |Δ| (``largest``) and mean |Δ| (``means``)."""
    out: dict[str, Any] = {"seq_logprob_diff_mean": _f(np.mean(means)) if len(means) else None}
    if len(largest):
        p50, p90, p99 = np.percentile(largest, [50, 90, 99])
        out.update(
            seq_logprob_diff_max_p50=_f(p50),
            seq_logprob_diff_max_p90=_f(p90),
            seq_logprob_diff_max_p99=_f(p99),
        )
    return out


#: What a per-rollout row holds beside ``sequences`` (the rest of ``METRICS`` is None there).
ROLLOUT_METRICS = (
    "seq_logprob_diff_mean",
    "logprob_diff_max",
    "seq_logprob_diff_max_p50",
    "seq_logprob_diff_max_p90",
    "seq_logprob_diff_max_p99",
    "chi2_seq",
    "tis_seq_frac_high",
    "icepop_seq_frac_out",
)


def rollout_metrics(diff_mean: Any, diff_max: Any, ratio: Any) -> dict[str, Any]:
    """``METRICS`` of a group of responses from the trainer's per-response figures (float64
    arrays, NaN where none): each response's mean |Δ|, largest |Δ| and importance ratio
    exp(Σ log ρ). Only ``ROLLOUT_METRICS`` have values; each over the responses where its figure
    is finite (a ratio: finite and above 0); ``sequences``: those with one finite figure or more."""
    out: dict[str, Any] = dict.fromkeys(METRICS)
    with np.errstate(all="ignore"):
        mean_ok, max_ok = np.isfinite(diff_mean), np.isfinite(diff_max)
        log_ratio = np.log(np.where(ratio > 0, ratio, np.nan))
        ratio_ok = np.isfinite(log_ratio)
        out["sequences"] = int(np.count_nonzero(mean_ok | max_ok | ratio_ok))
        largest = diff_max[max_ok]
        out["logprob_diff_max"] = _f(largest.max()) if len(largest) else None
        out.update(_largest_metrics(largest, diff_mean[mean_ok]))
        out.update(_ratio_metrics(log_ratio[ratio_ok]))
    return out


def totals_of(sums: dict[str, Any], rows: Any = None) -> dict[str, float]:
    """``TOKEN_SUMS`` added up over ``rows`` (an index array; default all) of per-group sums."""
    out = {}
    for name in TOKEN_SUMS:
        values = sums[name] if rows is None else sums[name][rows]
        if name == "max_abs":
            known = values[~np.isnan(values)]
            out[name] = float(known.max()) if len(known) else float("nan")
        else:
            with np.errstate(all="ignore"):  # a sum past float64: ±inf
                out[name] = float(values.sum())
    return out


def take(sums: dict[str, Any], rows: Any) -> dict[str, Any]:
    """Per-response sums of ``rows`` only."""
    return {name: values[rows] for name, values in sums.items()}


def verdict(
    token_mult_prob_error: float | None, investigate: float = INVESTIGATE, broken: float = BROKEN
) -> str | None:
    """healthy / investigate / broken, by ``VERDICT_RULE`` (None without tokens)."""
    if token_mult_prob_error is None:
        return None
    if token_mult_prob_error > broken:
        return "broken"
    if token_mult_prob_error > investigate:
        return "investigate"
    return "healthy"


# ---- the trend over steps -------------------------------------------------------------------------

#: A step is a spike above the median by this many MADs (scaled to a standard deviation) and twice it.
SPIKE_MADS = 10.0
#: The last third of the steps above the first third by this factor: rising (below by it: falling).
RISE = 1.5
TREND_MIN_STEPS = 3


@dataclass
class Trend:
    """How ``metric`` moved over the training steps: ``shape`` is rising, falling, flat, spiky or
    None (too few steps); ``spikes`` the steps far above the rest."""

    metric: str
    steps: list[Any]
    values: list[float | None]
    shape: str | None
    spikes: list[Any] = field(default_factory=list)
    first: float | None = None
    last: float | None = None

    @property
    def text(self) -> str:
        if self.shape is None:
            return f"too few steps for a trend (fewer than {TREND_MIN_STEPS})"
        ends = f"{_g(self.first)} → {_g(self.last)} (first third of the steps → last third)"
        if self.shape == "spiky":
            steps = ", ".join(map(str, self.spikes))
            rest = "" if self.first is None else f"; otherwise {ends}"
            return f"spiky at step {steps}: a refit or a kernel bug?{rest}"
        if self.shape == "rising":
            return f"rising: {ends}; at a learning rate of 0 that is engine or weight drift"
        if self.shape == "falling":
            return f"falling: {ends}"
        return f"flat: {ends}"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def trend(metric: str, steps: list[Any], values: list[float | None]) -> Trend:
    """The shape of the finite ``values`` over ``steps`` (in order): spikes first (a step above the median
    by ``SPIKE_MADS`` scaled MADs and twice the median), then the last third of the other steps
    against the first third (``RISE``)."""
    known = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
    if len(known) < TREND_MIN_STEPS:
        return Trend(metric, steps, values, None)
    x = np.array([v for _, v in known])
    med = float(np.median(x))
    mad = 1.4826 * float(np.median(np.abs(x - med)))
    far = (x > med + SPIKE_MADS * mad) & (x > 2 * med) & (x > med)
    spikes = [s for (s, _), f in zip(known, far) if f]
    rest = x[~far]
    k = max(1, len(rest) // 3)
    first, last = (float(rest[:k].mean()), float(rest[-k:].mean())) if len(rest) >= 2 else (None, None)
    if spikes:
        shape = "spiky"
    elif first is not None and last > RISE * first and last > first:
        shape = "rising"
    elif first is not None and first > RISE * last and first > last:
        shape = "falling"
    else:
        shape = "flat"
    return Trend(metric, steps, values, shape, spikes, first, last)


# ---- buckets ----------------------------------------------------------------------------------------

#: What ``--by`` groups by: per response (whole responses: every metric) or per token.
SEQUENCE_KEYS = ("step", "worker", "rollout", "version", "staleness")
TOKEN_KEYS = ("position", "probability", "entropy", "turn", "token")

#: Position buckets: 0–15, then powers of two (16–31, 32–63, ...).
POSITION_FIRST = 16
#: Entropy bucket edges (nats); the last bucket is open.
ENTROPY_EDGES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def position_bucket(position: Any) -> Any:
    with np.errstate(divide="ignore"):
        return np.where(
            position < POSITION_FIRST, 0, np.floor(np.log2(np.maximum(position, 1))).astype(np.int64) - 3
        )


def position_label(bucket: int) -> str:
    if bucket == 0:
        return f"0-{POSITION_FIRST - 1}"
    lo = POSITION_FIRST << (bucket - 1)
    return f"{lo}-{2 * lo - 1}"


PROBABILITY_BUCKETS = 10


def probability_bucket(rollout: Any) -> Any:
    """Tenths of the rollout's probability of the sampled token: 0 for [0, 0.1), ..., 9 for [0.9, 1]."""
    p = np.exp(np.minimum(rollout, 0.0))
    return np.minimum((p * PROBABILITY_BUCKETS).astype(np.int64), PROBABILITY_BUCKETS - 1)


def probability_label(bucket: int) -> str:
    return f"{bucket / PROBABILITY_BUCKETS:.1f}-{(bucket + 1) / PROBABILITY_BUCKETS:.1f}"


def entropy_bucket(entropy: Any) -> Any:
    return np.searchsorted(np.asarray(ENTROPY_EDGES[1:]), entropy, side="right")


def entropy_label(bucket: int) -> str:
    lo = ENTROPY_EDGES[bucket]
    return f"{lo:g}+" if bucket + 1 >= len(ENTROPY_EDGES) else f"{lo:g}-{ENTROPY_EDGES[bucket + 1]:g}"
