"""``audit``'s mismatch check per token (trainer log-probs recorded per token, as ``record
--token-signals`` keeps them) and the listing checks over runs whose keys are strings.

The worst tokens and the flagged groups are computed here from what was recorded."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
from support import json_rows

import rlreplay
from rlreplay.recorder.signals import record_signals

ROOT = Path(__file__).resolve().parents[2]
PER_STEP = 10


def audit(*args: str) -> list[dict[str, Any]]:
    return json_rows("audit", *args, "--json", "--fail-on", "none", cwd=ROOT)


def reward(samples: list[Any], sample: Any, n: int) -> float:
    """The first sample's rollouts all get 1 (a collapsed group); the others 0 and 1."""
    return 1.0 if sample == samples[0] else float(n)


def record_run(run_dir: Path, steps: list[Any], samples: list[Any], plant: dict, token_signals: bool) -> dict:
    """Agent loops with two model turns and a tool answer between them, and the trainer's signals.
    ``plant``: keys → {position: added to the trainer's log-prob}. Returns, by keys, the response
    ids, mask, rollout and trainer log-probs."""

    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    def agent(rng: random.Random) -> dict:
        first = [rng.randrange(10, 5000) for _ in range(rng.randrange(20, 40))]
        tool = [rng.randrange(10, 5000) for _ in range(8)]
        second = [rng.randrange(10, 5000) for _ in range(rng.randrange(20, 40))]
        ids = first + tool + second
        mask = [1] * len(first) + [0] * len(tool) + [1] * len(second)
        logprobs = [float(np.float32(-rng.random())) if m else 0.0 for m in mask]
        return {
            "prompt_ids": [1, 2, 3],
            "response_ids": ids,
            "response_mask": mask,
            "response_logprobs": logprobs,
        }

    recorded = {}
    rlreplay.init(run_dir, worker="w0")
    for step in steps:
        for sample, n in [(sample, n) for sample in samples for n in (0, 1)]:
            keys = (step, sample, n)
            rng = random.Random(str(keys))
            with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=n) as traj:
                out = agent(rng)
            trainer = [
                lp + rng.uniform(-0.01, 0.01) if m else rng.uniform(-9, 0)
                for lp, m in zip(out["response_logprobs"], out["response_mask"])
            ]
            for position, added in plant.get(keys, {}).items():
                trainer[position] += added
            gaps = [
                abs(t - r) for t, r, m in zip(trainer, out["response_logprobs"], out["response_mask"]) if m
            ]
            record_signals(
                traj.id,
                step=step,
                sample_index=sample,
                rollout_n=n,
                validate=False,
                reward=reward(samples, sample, n),
                logprob_diff_max=max(gaps),
                importance_ratio=1.0,
                output={"old_log_probs": trainer} if token_signals else None,
            )
            recorded[keys] = (out, trainer)
    rlreplay.close()
    return recorded


def test_mismatch_names_the_worst_tokens_where_per_token_log_probs_were_recorded(tmp_path: Path) -> None:
    samples = list(range(PER_STEP))
    plant = {(1, 4, 0): {5: -2.5, 12: 1.2}, (0, 7, 1): {3: 4.0}}
    recorded = record_run(tmp_path / "tokens", [0, 1], samples, plant, token_signals=True)
    found = [f for f in audit(str(tmp_path / "tokens"), "--checks", "mismatch")]
    flagged = {(f["step"], f["sample_index"], f["rollout_n"]): f for f in found if f["trajectory_id"]}
    assert set(flagged) == set(plant)
    # the steps `rlreplay mismatch` calls investigate: mean exp|trainer - rollout| over model tokens > 1.05
    errors: dict[int, list[float]] = {}
    for (step, _, _), (out, trainer) in recorded.items():
        for t, r, m in zip(trainer, out["response_logprobs"], out["response_mask"]):
            if m:
                errors.setdefault(step, []).append(math.exp(abs(t - r)))
    steps = {f["step"]: f for f in found if f["trajectory_id"] is None}
    assert set(steps) == {s for s, e in errors.items() if sum(e) / len(e) > 1.05} != set()
    for step, finding in steps.items():
        mult = sum(errors[step]) / len(errors[step])
        assert (
            finding["severity"] == "warning"
            and f"token_mult_prob_error {mult:.4g} > 1.05" in finding["detail"]
        )
    for keys, finding in flagged.items():
        out, trainer = recorded[keys]
        gaps = [
            (abs(t - r), i)
            for i, (t, r, m) in enumerate(zip(trainer, out["response_logprobs"], out["response_mask"]))
            if m
        ]
        worst = [i for _, i in sorted(gaps, key=lambda g: -g[0])[:3]]
        assert worst[0] == max(plant[keys], key=lambda p: abs(plant[keys][p]))
        assert finding["position"] == worst[0]
        named = finding["detail"].split("worst tokens (position id |diff|): ")[1]
        assert [int(item.split()[0]) for item in named.split(", ")] == worst
        assert [int(item.split()[1]) for item in named.split(", ")] == [out["response_ids"][i] for i in worst]


def test_without_token_signals_mismatch_names_no_token(tmp_path: Path) -> None:
    plant = {(1, 4, 0): {5: -2.5}}
    record_run(tmp_path / "plain", [0, 1], list(range(PER_STEP)), plant, token_signals=False)
    (finding,) = audit(str(tmp_path / "plain"), "--checks", "mismatch")
    assert finding["position"] is None and "worst tokens" not in finding["detail"]


def test_listing_checks_over_string_keys(tmp_path: Path) -> None:
    """Steps and sample indexes recorded as strings: groups and outliers are still found."""
    steps, samples = ["warmup", "main"], [f"q{i}" for i in range(PER_STEP)]
    plant = {("main", "q3", 1): {7: 3.0}}
    recorded = record_run(tmp_path / "strings", steps, samples, plant, token_signals=True)
    found = audit(str(tmp_path / "strings"), "--checks", "group_collapse,mismatch")
    groups = {(f["step"], f["sample_index"]) for f in found if f["check"] == "group_collapse"}
    rewards: dict[tuple[str, str], set[float]] = {}
    for step in steps:
        for sample in samples:
            for n in (0, 1):
                rewards.setdefault((step, sample), set()).add(reward(samples, sample, n))
    assert groups == {g for g, r in rewards.items() if len(r) == 1} == {("warmup", "q0"), ("main", "q0")}
    mismatched = [f for f in found if f["check"] == "mismatch"]
    assert [(f["step"], f["sample_index"], f["rollout_n"]) for f in mismatched] == list(plant)
    out, _ = recorded[("main", "q3", 1)]
    assert mismatched[0]["position"] == 7 and f"7 {out['response_ids'][7]} " in mismatched[0]["detail"]
