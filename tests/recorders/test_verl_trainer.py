"""Trainer-side signals with verl's real DataProto, compute_advantage, balance_batch and extract_reward.

Trajectories are opened by verl's real ``rollout_trace_attr`` (hooked by rlreplay) and the key it
carries is put into the batch exactly where ``AgentLoopWorker._agent_loop_postprocess`` puts it
(``extra_fields`` → ``non_tensor_batch``). The driver-side functions are verl's own, reached through
``verl.trainer.ppo.ray_trainer`` as ``RayPPOTrainer.fit`` and ``_validate`` call them.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import rlreplay
from rlreplay.format import payload

torch = pytest.importorskip("torch")

PROMPTS, N, LENGTH = 4, 4, 7


@pytest.fixture(scope="module")
def verl_modules() -> SimpleNamespace:
    import verl.trainer.ppo.ray_trainer as ray_trainer
    import verl.utils.rollout_trace as rollout_trace

    from rlreplay.recorders import verl as hook
    from rlreplay.recorders import verl_trainer

    return SimpleNamespace(
        ray_trainer=ray_trainer,
        rollout_trace=rollout_trace,
        hook=hook,
        verl_trainer=verl_trainer,
        original=ray_trainer.compute_advantage,
        original_extract=ray_trainer.extract_reward,
    )


@pytest.fixture
def recording(tmp_path: Path, verl_modules: SimpleNamespace):
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, experiment="trainer", worker="driver")
    verl_modules.hook.install(verl_modules.rollout_trace)
    verl_modules.verl_trainer.install(verl_modules.ray_trainer)
    try:
        yield run_dir
    finally:
        rlreplay.close()
        rt = verl_modules.ray_trainer
        rt.compute_advantage, rt.extract_reward = verl_modules.original, verl_modules.original_extract


def agent_loop_keys(rt_module: Any, step: int, prompts: int, n: int, validate: bool) -> list[dict]:
    """One trajectory per rollout, opened as AgentLoopWorker._run_agent_loop opens it."""
    from rlreplay.recorders.verl import current_trajectory_key

    @rlreplay.trace_op(kind="agent", name="ToolAgentLoop.run")
    def run() -> dict:
        return {"response_ids": [1, 2], "response_mask": [1, 1]}

    keys = []
    for sample in range(prompts):
        for rollout in range(n):
            with rt_module.rollout_trace_attr(
                step=step, sample_index=100 + sample, rollout_n=rollout, validate=validate, name="agent_loop"
            ):
                run()
                keys.append(current_trajectory_key())
    return keys


def make_batch(keys: list[dict], seed: int, validate: bool = False) -> Any:
    """A batch shaped like fit's after generate_sequences + union: GRPO groups of N consecutive rows."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = len(keys)
    lengths = torch.randint(2, LENGTH + 1, (rows,), generator=g)
    response_mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    response_mask[0, 1] = 0  # a tool token inside the first response
    scores = torch.zeros(rows, LENGTH)
    reward = (torch.rand(rows, generator=g) > 0.5).float()
    scores[torch.arange(rows), lengths - 1] = reward
    rollout_lp = -torch.rand(rows, LENGTH, generator=g) * 2
    old_lp = rollout_lp + torch.randn(rows, LENGTH, generator=g) * 0.05
    prompt = torch.ones(rows, 3, dtype=torch.long)
    attention = torch.cat([prompt, response_mask.clone()], dim=1)
    attention[0, 3 + 1] = 1  # the tool token is attended
    keys_arr = np.empty(rows, dtype=object)
    keys_arr[:] = keys
    uid = np.array([f"uid-{i // N}" for i in range(rows)], dtype=object)
    acc = np.array([bool(r) for r in reward.tolist()], dtype=object)
    batch = DataProto.from_dict(
        tensors={
            "responses": torch.randint(5, 100, (rows, LENGTH), generator=g),
            "response_mask": response_mask,
            "attention_mask": attention,
            "rm_scores": scores,
            "rollout_log_probs": rollout_lp,
        },
        non_tensors={"uid": uid, "rlreplay_trajectory": keys_arr, "acc": acc},
        meta_info={"reward_extra_keys": ["acc"], "global_steps": 1, "validate": validate},
    )
    if not validate:
        batch.batch["old_log_probs"] = old_lp
    return batch


def balance(ray_trainer: Any, batch: Any) -> None:
    """verl's own RayPPOTrainer._balance_batch (2 data-parallel ranks): reorders rows in place."""
    trainer = SimpleNamespace(_get_dp_size=lambda *a: 2, use_prefix_grouper=False, actor_rollout_wg=None)
    ray_trainer.RayPPOTrainer._balance_batch(trainer, batch, metrics={})


def signals(run_dir: Path) -> dict[str, dict]:
    """trajectory id → the signals row, its figures from columns (v2) or attributes (v1)."""
    from rlreplay.recorders import verl_trainer

    assert verl_trainer.drain()
    rlreplay.flush()
    run = rlreplay.open_run(run_dir)
    table = run.spans()
    out = {}
    for row in table.to_pylist():
        if row["kind"] != "signals":
            continue
        attrs = payload.decode(row.get("attributes")) or {}
        merged = dict(attrs)
        for key in ("reward", "advantage", "logprob_diff_mean", "logprob_diff_max", "importance_ratio"):
            if row.get(key) is not None:
                merged[key] = row[key]
        merged["_row"] = row
        merged["_output"] = payload.decode(row.get("output"))
        assert row["trajectory_id"] not in out
        out[row["trajectory_id"]] = merged
    return out


def fit_like(ray_trainer: Any, batch: Any) -> Any:
    """The part of RayPPOTrainer.fit from extract_reward to compute_advantage (GRPO, no KL)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    reward_tensor, extra = ray_trainer.extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    return ray_trainer.compute_advantage(
        batch,
        adv_estimator=AdvantageEstimator.GRPO,
        num_repeat=N,
        norm_adv_by_std_in_grpo=True,
        config=AlgoConfig(adv_estimator="grpo"),
    )


def test_signals_join_exactly_after_balance_batch(recording: Path, verl_modules: SimpleNamespace) -> None:
    rt = verl_modules.ray_trainer
    assert getattr(rt.compute_advantage, "__rlreplay_verl_trainer__", False)
    keys = agent_loop_keys(verl_modules.rollout_trace, step=1, prompts=PROMPTS, n=N, validate=False)
    assert len({k["trajectory_id"] for k in keys}) == PROMPTS * N
    batch = make_batch(keys, seed=7)
    before = [k["trajectory_id"] for k in batch.non_tensor_batch["rlreplay_trajectory"]]
    balance(rt, batch)
    after = [k["trajectory_id"] for k in batch.non_tensor_batch["rlreplay_trajectory"]]
    assert sorted(after) == sorted(before) and after != before  # verl really reordered the rows
    result = fit_like(rt, batch)
    rlreplay.flush()

    # verl's own result is untouched by the hook
    expected = verl_modules.original(
        result, adv_estimator="grpo", num_repeat=N, norm_adv_by_std_in_grpo=True, config=None
    )
    assert torch.equal(result.batch["advantages"], expected.batch["advantages"])

    found = signals(recording)
    assert set(found) == set(after)
    b = result.batch
    groups: dict[str, list[float]] = {}
    for i, key in enumerate(result.non_tensor_batch["rlreplay_trajectory"]):
        sig = found[key["trajectory_id"]]
        row = sig["_row"]
        assert (row["step"], row["sample_index"], row["rollout_n"], row["validate"]) == (
            key["step"],
            key["sample_index"],
            key["rollout_n"],
            False,
        )
        mask = b["response_mask"][i].bool()
        assert sig["reward"] == pytest.approx(float(b["token_level_scores"][i].sum()))
        first = int(mask.nonzero()[0])
        assert sig["advantage"] == pytest.approx(float(b["advantages"][i, first]))
        delta = (b["old_log_probs"][i] - b["rollout_log_probs"][i]).double()[mask]
        assert sig["logprob_diff_mean"] == pytest.approx(float(delta.abs().mean()))
        assert sig["logprob_diff_max"] == pytest.approx(float(delta.abs().max()))
        assert sig["importance_ratio"] == pytest.approx(math.exp(float(delta.sum())))
        assert sig["reward_extra"] == {"acc": bool(b["token_level_scores"][i].sum() > 0)}
        assert sig["uid"] == result.non_tensor_batch["uid"][i]
        assert sig["_output"] is None  # per-token log-probs only when asked
        groups.setdefault(sig["uid"], []).append(sig["advantage"])
    assert len(groups) == PROMPTS
    for advantages in groups.values():
        assert sum(advantages) == pytest.approx(0.0, abs=1e-4)

    # the signals rows share the trajectories' ids: each trajectory has its agent-loop root too
    run = rlreplay.open_run(recording)
    spans = run.spans().to_pylist()
    roots = {s["trajectory_id"]: s["span_id"] for s in spans if s["kind"] == "trajectory"}
    assert set(found) <= set(roots)
    for tid, sig in found.items():
        assert sig["_row"]["parent_id"] == roots[tid]


def test_validation_rewards_without_advantages(recording: Path, verl_modules: SimpleNamespace) -> None:
    rt = verl_modules.ray_trainer
    keys = agent_loop_keys(verl_modules.rollout_trace, step=3, prompts=3, n=1, validate=True)
    batch = make_batch(keys, seed=3, validate=True)
    reward_tensor, extra = rt.extract_reward(batch)  # as RayPPOTrainer._validate calls it
    rlreplay.flush()
    found = signals(recording)
    assert len(found) == 3
    for i, key in enumerate(keys):
        sig = found[key["trajectory_id"]]
        assert sig["_row"]["validate"] is True and sig["_row"]["step"] == 3
        assert sig["reward"] == pytest.approx(float(reward_tensor[i].sum()))
        assert sig.get("advantage") is None and sig.get("importance_ratio") is None
        assert sig["reward_extra"] == {"acc": bool(extra["acc"][i])}


def test_token_signals_on_request(
    recording: Path, verl_modules: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLREPLAY_TOKEN_SIGNALS", "1")
    rt = verl_modules.ray_trainer
    keys = agent_loop_keys(verl_modules.rollout_trace, step=2, prompts=2, n=N, validate=False)
    batch = make_batch(keys, seed=11)
    result = fit_like(rt, batch)
    rlreplay.flush()
    found = signals(recording)
    for i, key in enumerate(result.non_tensor_batch["rlreplay_trajectory"]):
        tokens = found[key["trajectory_id"]]["_output"]["old_log_probs"]
        valid = int(result.batch["attention_mask"][i, -LENGTH:].sum())
        assert len(tokens) == valid
        assert tokens == pytest.approx(result.batch["old_log_probs"][i, :valid].tolist())


def test_rows_without_a_trajectory_are_skipped_not_raised(
    recording: Path, verl_modules: SimpleNamespace
) -> None:
    rt = verl_modules.ray_trainer
    keys = agent_loop_keys(verl_modules.rollout_trace, step=4, prompts=2, n=N, validate=False)
    keys[1] = None  # verl's per-worker trace sampling left this rollout unrecorded
    batch = make_batch(keys, seed=5)
    before = verl_modules.verl_trainer.unmatched_rows[0]
    fit_like(rt, batch)
    no_keys = make_batch(keys, seed=5)
    no_keys.non_tensor_batch.pop("rlreplay_trajectory")
    fit_like(rt, no_keys)  # a job that was not recorded by the agent-loop hook
    rlreplay.flush()
    assert len(signals(recording)) == 2 * N - 1
    assert verl_modules.verl_trainer.unmatched_rows[0] == before + 1 + 2 * N
    assert rlreplay.stats()["lost"] == 0
