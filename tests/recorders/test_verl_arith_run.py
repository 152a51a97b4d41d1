"""The shipped showcase run `verl-arith-smollm2`: its figures computed here from the span files with
pyarrow (rewards, spread, mismatch, recurring prompts), then compared with what `rlreplay stats` says."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import json_rows

RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-arith-smollm2"


@pytest.fixture(scope="module")
def spans() -> list[dict]:
    files = sorted(RUN.glob("spans/*/*/*.parquet"))
    assert files
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default").to_pylist()


@pytest.fixture(scope="module")
def signals(spans: list[dict]) -> list[dict]:
    return [s for s in spans if s["kind"] == "signals"]


def train(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["validate"]]


def by_step(rows: list[dict], column: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for r in train(rows):
        if r[column] is not None:
            out[r["step"]].append(r[column])
    return dict(out)


def test_shape_steps_prompts_rollouts_and_validation(signals: list[dict]) -> None:
    steps = {r["step"] for r in train(signals)}
    assert len(steps) >= 6
    groups = defaultdict(set)
    for r in train(signals):
        groups[(r["step"], r["sample_index"])].add(r["rollout_n"])
    assert all(len(groups_of_step := [g for g in groups if g[0] == s]) >= 8 for s in steps), groups_of_step
    assert all(len(n) == 4 for n in groups.values())
    assert any(r["validate"] for r in signals)


def test_some_rollouts_rewarded_and_most_groups_spread(signals: list[dict]) -> None:
    """A GRPO signal: between one rollout in ten and six in ten solve their problem, and more than
    half of the groups have rollouts with different rewards."""
    rewards = [r["reward"] for r in train(signals)]
    assert None not in rewards
    rewarded = sum(1 for x in rewards if x > 0) / len(rewards)
    assert 0.1 <= rewarded <= 0.6, rewarded
    groups = defaultdict(list)
    for r in train(signals):
        groups[(r["step"], r["sample_index"])].append(r["reward"])
    spread = sum(1 for g in groups.values() if len(set(g)) > 1) / len(groups)
    assert spread > 0.5, spread


def test_rewards_advantages_and_mismatch_vary_across_steps_as_stats_says(signals: list[dict]) -> None:
    reward = {s: statistics.fmean(v) for s, v in by_step(signals, "reward").items()}
    advantage = {s: statistics.pstdev(v) for s, v in by_step(signals, "advantage").items()}
    mismatch = {s: statistics.fmean(v) for s, v in by_step(signals, "logprob_diff_mean").items()}
    for figures in (reward, advantage, mismatch):
        assert len({round(x, 6) for x in figures.values()}) > 1, figures
    assert min(mismatch.values()) > 1e-3  # bfloat16 rollout weights against a float32 trainer
    stats = {r["step"]: r for r in json_rows("stats", RUN, "--json") if not r["validate"]}
    assert set(stats) == set(reward)
    for step in stats:
        assert stats[step]["reward_mean"] == pytest.approx(reward[step])
        assert stats[step]["logprob_diff_mean"] == pytest.approx(mismatch[step])
        assert stats[step]["advantage_std"] > 0


def test_per_token_trainer_logprobs_for_every_training_rollout(signals: list[dict]) -> None:
    for r in train(signals):
        logprobs = json.loads(r["output"])["old_log_probs"]
        if isinstance(logprobs, dict):  # long arrays live in the span's token_logprobs column
            logprobs = r["token_logprobs"][logprobs["o"] : logprobs["o"] + logprobs["n"]]
        assert logprobs and all(isinstance(x, float) and x <= 0 for x in logprobs), r["trajectory_id"]


def test_some_model_calls_stopped_on_their_token_budget(spans: list[dict]) -> None:
    truncated = [
        s for s in spans if s["kind"] == "llm" and json.loads(s["output"])["stop_reason"] == "length"
    ]
    assert truncated


def test_prompts_recur_across_at_least_three_steps(spans: list[dict]) -> None:
    steps_of = defaultdict(set)
    for s in train(spans):
        if s["kind"] == "agent":
            question = json.loads(s["inputs"])["kwargs"]["raw_prompt"][-1]["content"]
            steps_of[question].add(s["step"])
    assert len(steps_of) <= 16
    assert all(len(steps) >= 3 for steps in steps_of.values()), steps_of


def test_no_path_of_the_recording_machine_in_the_run() -> None:
    machine = re.compile(rb"/(tmp|work|home|root|Users)/")
    for path in RUN.rglob("*"):
        if path.is_file() and path.suffix != ".parquet":
            assert not machine.search(path.read_bytes()), path
    for path in RUN.glob("spans/*/*/*.parquet"):
        table = pq.read_table(path)
        for column in ("attributes", "inputs", "output", "error"):
            for value in table.column(column).to_pylist():
                assert value is None or not machine.search(value.encode()), (path, value[:200])


def test_under_10_mb() -> None:
    assert sum(p.stat().st_size for p in RUN.rglob("*") if p.is_file()) < 10 * 1024 * 1024


def test_agent_loop_outputs_are_recorded_as_run_returned_them_and_served_so() -> None:
    """Outputs are copied when ``run`` returns: nothing verl's post-processing adds afterwards
    (``raw_prompt``, rlreplay's own key, the reward loop's ``reward_score`` and ``reward_extra_info``)
    is in them; the reward is the signals span's. Served under ``--serve agent`` they come back
    whole, so verl computes the reward of a replay again."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    import rlreplay
    from rlreplay.recorders.verl import EXTRA_FIELD, VerlAdapter

    added = {"raw_prompt", EXTRA_FIELD, "reward_extra_info"}
    run = rlreplay.open_run(RUN)
    rows = run.trajectories().to_pylist()
    trajs = run.load([r["id"] for r in rows])
    spans = [s for t in trajs for s in t.spans if s.kind == "agent"]
    assert len(spans) == len(rows)
    assert all(not added & set(s.output["extra_fields"]) and s.output["reward_score"] is None for s in spans)
    assert all(r["reward"] is not None for r in rows)  # from verl's reward loop, joined by the driver
    types = {(s.output_type or {}).get("", "").rsplit(".", 1)[-1] for s in spans}
    assert types == {"AgentLoopOutput"}  # each output recorded with the type it had
    adapter = VerlAdapter()
    for span in spans:
        output = span.output
        served = adapter.rebuild_output("agent_loop", "agent", output, span.output_type)
        assert isinstance(served, AgentLoopOutput)
        assert served.reward_score is None and served.extra_fields == output["extra_fields"]
        assert served.response_ids == output["response_ids"] and served.prompt_ids == output["prompt_ids"]


def test_an_output_recorded_after_post_processing_is_served_without_it() -> None:
    """A run recorded before outputs were copied at return holds what verl's post-processing added:
    served, those keys and the reward are left out, else verl skips the reward of a replay."""
    import rlreplay
    from rlreplay.recorders.verl import EXTRA_FIELD, VerlAdapter

    run = rlreplay.open_run(RUN)
    traj = run.trajectory(run.trajectories()["id"][0].as_py())
    returned = next(s.output for s in traj.spans if s.kind == "agent")
    late = {
        **returned,
        "reward_score": 1.0,
        "extra_fields": {
            **returned["extra_fields"],
            "raw_prompt": [{"role": "user", "content": "What is 2 + 2?"}],
            EXTRA_FIELD: {"step": traj.step, "sample_index": traj.sample_index},
            "reward_extra_info": {"acc": 1.0},
        },
    }
    served = VerlAdapter().rebuild_output("agent_loop", "agent", late, None)  # no type record then
    assert served.reward_score is None and served.extra_fields == returned["extra_fields"]
    assert EXTRA_FIELD in late["extra_fields"]  # the recorded value itself is left as it was


def test_a_reward_the_agent_loop_returned_itself_is_served() -> None:
    """Recorded as ``run`` returned it (no post-processing mark): a reward the loop set is kept."""
    from rlreplay.recorders.verl import VerlAdapter

    output = {
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "response_mask": [1, 1],
        "num_turns": 2,
        "metrics": {},
        "reward_score": 0.5,
        "extra_fields": {"reward_extra_info": {"acc": 1.0}},
    }
    recorded_as = {"": "verl.experimental.agent_loop.agent_loop.AgentLoopOutput"}
    served = VerlAdapter().rebuild_output("agent_loop", "agent", output, recorded_as)
    assert served.reward_score == 0.5 and served.extra_fields == {"reward_extra_info": {"acc": 1.0}}
