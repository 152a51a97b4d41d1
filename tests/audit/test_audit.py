"""``rlreplay audit`` finds each problem planted in runs recorded through the real recording API
(real shards, the real Qwen3 tokenizer) and flags no clean trajectory; bad input exits 2."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from audit_truth import verl_sample_truth
from support import qwen_tokenizer_dir, rlreplay_proc

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAMPLES, ROLLOUTS = 4, 6, 4

CLEAN_TEXT = [
    "Natalia sold {x} clips to her friends in April, and then she sold half as many clips in May. "
    "Altogether she sold {y} clips in April and May, so the answer is {y}.",
    "Weng earns {x} dollars an hour for babysitting. Yesterday she did {y} minutes of babysitting, "
    "which is less than an hour, so she earned a part of her hourly rate.",
    "Betty needs {x} dollars for a new wallet. She has only half of the money, her parents give her "
    "{y} dollars and her grandparents twice as much as her parents.",
]


def tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))


@dataclass
class Plan:
    """What one trajectory does; ``planted`` lists the (check, turn) problems put in it."""

    step: int
    sample: int
    rollout: int
    responses: list[list[int]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    retokenize: bool = False
    tool_raises: bool = False
    parser: str = "ok"  # ok | raises | malformed
    reward: float = 0.0
    logprob_diff_max: float = 0.02
    planted: set[tuple[str, int | None]] = field(default_factory=set)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.step, self.sample, self.rollout)


def record(run_dir: Path, plans: list[Plan], prompt_of: Callable[[Plan], list[int]], tok: Any) -> dict:
    """Record the plans with the generic API; returns {key: (prompt ids of each model call)}."""
    import rlreplay
    from rlreplay.format import manifest
    from rlreplay.recorder.signals import record_signals

    @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
    def generate(
        request_id: str, *, prompt_ids: list[int], sampling_params: dict, plan: Plan, turn: int
    ) -> dict:
        return {"token_ids": plan.responses[turn], "stop_reason": plan.stop[turn]}

    @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
    def extract_tool_calls(responses_ids: list[int], mode: str) -> list:
        if mode == "raises":
            raise ValueError("unterminated <tool_call> block")
        arguments = '{"expr": "6*7"' if mode == "malformed" else '{"expr": "6*7"}'
        return ["", [{"name": "calc", "arguments": arguments}]]

    @rlreplay.trace_op(name="CalcTool.execute", kind="tool")
    def execute(instance_id: str, parameters: dict, fail: bool) -> tuple:
        if fail:
            raise ZeroDivisionError("division by zero")
        return ({"text": "42"}, 0.0, {})

    prompts = {}
    observation = tok.encode("<tool_response>42</tool_response>").ids
    rlreplay.init(run_dir, experiment="audit-fixture", worker="w0")
    for plan in plans:
        with rlreplay.trajectory(
            step=plan.step, sample_index=plan.sample, rollout_n=plan.rollout, name="agent_loop"
        ) as traj:
            context = prompt_of(plan)
            seen = []
            for turn in range(len(plan.responses)):
                seen.append(list(context))
                out = generate(
                    f"r{turn}", prompt_ids=context, sampling_params={"max_tokens": 256}, plan=plan, turn=turn
                )
                if turn == len(plan.responses) - 1:
                    break
                with contextlib.suppress(ValueError):
                    extract_tool_calls(out["token_ids"], plan.parser if turn == 0 else "ok")
                with contextlib.suppress(ZeroDivisionError):
                    execute(f"t{turn}", {"expr": "6*7"}, plan.tool_raises and turn == 0)
                sampled = out["token_ids"]
                if plan.retokenize and turn == 0:  # the loop re-encodes the decoded text
                    sampled = tok.encode(tok.decode(sampled, skip_special_tokens=False)).ids
                context = context + sampled + observation
            prompts[plan.key] = seen
        record_signals(
            traj.id,
            step=plan.step,
            sample_index=plan.sample,
            rollout_n=plan.rollout,
            validate=False,
            reward=plan.reward,
            logprob_diff_max=plan.logprob_diff_max,
            importance_ratio=1.0,
        )
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(qwen_tokenizer_dir()))
    return prompts


def clean_plan(tok: Any, step: int, sample: int, rollout: int) -> Plan:
    text = CLEAN_TEXT[(sample + rollout) % len(CLEAN_TEXT)].format(x=3 + sample * 7 + rollout, y=11 + step)
    call = tok.encode('<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>').ids
    return Plan(
        step,
        sample,
        rollout,
        responses=[call, tok.encode(text).ids],
        stop=["stop", "stop"],
        reward=((sample * ROLLOUTS + rollout) % 5) / 4,
        logprob_diff_max=0.01 + 0.001 * ((sample * 7 + rollout * 3 + step) % 10),
    )


def plant(tok: Any) -> list[Plan]:
    """The planted run: every problem once or more, every other trajectory clean."""
    plans = {
        p.key: p
        for p in (
            clean_plan(tok, st, s, n) for st in range(STEPS) for s in range(SAMPLES) for n in range(ROLLOUTS)
        )
    }

    def at(key: tuple[int, int, int]) -> Plan:
        return plans[key]

    # retokenization: " strawberry" sampled a letter at a time; the loop re-encodes the text
    p = at((1, 0, 1))
    digits = tok.encode("The fruit is").ids + [i for ch in " strawberry" for i in tok.encode(ch).ids]
    assert tok.encode(tok.decode(digits)).ids != digits
    p.responses[0] = digits
    p.retokenize = True
    p.planted.add(("retokenization", 1))
    # repetition loop
    p = at((2, 1, 0))
    p.responses[1] = tok.encode("Let me think." + " I need to check the answer again." * 12).ids
    p.planted.add(("repetition", 1))
    # garbled text
    p = at((0, 2, 3))
    p.responses[1] = tok.encode("Ответ равен 42 答案是四十二 الجواب هو \x07\x1b 42 \ufffd\ufffd").ids
    p.planted.add(("garbled", 1))
    # a length-stopped call
    p = at((3, 4, 2))
    p.stop[1] = "length"
    p.planted.add(("truncated", 1))
    # an empty response
    p = at((1, 5, 3))
    p.responses[1] = []
    p.planted.add(("empty_response", 1))
    # a raising tool
    p = at((2, 3, 1))
    p.tool_raises = True
    p.planted.add(("tool_error", 0))
    # a failing and a malformed parse
    at((0, 4, 0)).parser = "raises"
    at((0, 4, 0)).planted.add(("parse_error", 0))
    at((3, 1, 2)).parser = "malformed"
    at((3, 1, 2)).planted.add(("parse_error", 0))
    # a mismatch outlier
    at((2, 5, 0)).logprob_diff_max = 4.5
    at((2, 5, 0)).planted.add(("mismatch", None))
    # a collapsed group
    for n in range(ROLLOUTS):
        at((1, 2, n)).reward = 1.0
    return list(plans.values())


def prompt_for(tok: Any) -> Callable[[Plan], list[int]]:
    return lambda plan: (
        tok.encode(f"<|im_start|>user\nQuestion {plan.sample}: how many clips?<|im_end|>\n").ids
    )


audit = partial(rlreplay_proc, "audit", cwd=ROOT)


def findings(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Plan], dict]:
    tok = tokenizer()
    plans = plant(tok)
    run_dir = tmp_path_factory.mktemp("audit") / "planted"
    prompts = record(run_dir, plans, prompt_for(tok), tok)
    return run_dir, plans, prompts


def test_audit_finds_every_planted_problem_and_no_clean_trajectory(planted_run: Any) -> None:
    run_dir, plans, prompts = planted_run
    proc = audit(str(run_dir), "--json")
    assert proc.returncode == 1, proc.stderr
    found = findings(proc)
    trajectory_level = {
        (f["check"], (f["step"], f["sample_index"], f["rollout_n"]))
        for f in found
        if f["trajectory_id"] is not None
    }
    expected = {(check, p.key) for p in plans for check, _ in p.planted}
    true_positive = trajectory_level & expected
    precision = len(true_positive) / len(trajectory_level)
    recall = len(true_positive) / len(expected)
    assert (precision, recall) == (1.0, 1.0), (
        sorted(trajectory_level - expected),
        sorted(expected - trajectory_level),
    )
    flagged = {key for _, key in trajectory_level}
    clean = [p.key for p in plans if not p.planted]
    assert not flagged & set(clean)
    # each finding says where: the turn, and for re-tokenization the first differing position
    turns = {(f["check"], (f["step"], f["sample_index"], f["rollout_n"])): f["turn"] for f in found}
    for p in plans:
        for check, turn in p.planted:
            assert turns[(check, p.key)] == turn
    retok = next(f for f in found if f["check"] == "retokenization")
    first, second = prompts[(1, 0, 1)]
    sampled = first + plans_by_key(plans)[(1, 0, 1)].responses[0]
    position = next(i for i, (a, b) in enumerate(zip(sampled, second)) if a != b)
    assert retok["position"] == position and position > len(first)
    # the collapsed group, as a group
    groups = {(f["step"], f["sample_index"]) for f in found if f["check"] == "group_collapse"}
    rewards: dict[tuple[int, int], set[float]] = {}
    for p in plans:
        rewards.setdefault((p.step, p.sample), set()).add(p.reward)
    assert groups == {g for g, r in rewards.items() if len(r) == 1} == {(1, 2)}
    assert all(
        set(f)
        >= {
            "check",
            "trajectory_id",
            "step",
            "sample_index",
            "rollout_n",
            "validate",
            "severity",
            "detail",
            "turn",
            "position",
        }
        for f in found
    )


def plans_by_key(plans: list[Plan]) -> dict[tuple[int, int, int], Plan]:
    return {p.key: p for p in plans}


def test_terminal_report_and_fail_on(planted_run: Any) -> None:
    run_dir, plans, _ = planted_run
    proc = audit(str(run_dir), "--checks", "retokenization,group_collapse")
    assert proc.returncode == 1, proc.stderr
    retok = next(p for p in plans if ("retokenization", 1) in p.planted)
    from rlreplay.read.open import open_run

    listing = open_run(run_dir).trajectories(step=retok.step).to_pylist()
    traj_id = next(
        r["id"] for r in listing if (r["sample_index"], r["rollout_n"]) == (retok.sample, retok.rollout)
    )
    assert "retokenization: 1 finding\n" in proc.stdout and traj_id[:12] in proc.stdout
    assert "group_collapse: 1 finding\n" in proc.stdout
    # group findings alone do not fail by default; --fail-on names what does
    assert audit(str(run_dir), "--checks", "group_collapse").returncode == 0
    assert audit(str(run_dir), "--checks", "group_collapse", "--fail-on", "group_collapse").returncode == 1
    assert audit(str(run_dir), "--fail-on", "none").returncode == 0
    # ls --finding selects the flagged trajectories
    ls = rlreplay_proc("ls", run_dir, "--json", "--finding", "truncated", cwd=ROOT)
    assert ls.returncode == 0, ls.stderr
    keys = {(r["step"], r["sample_index"], r["rollout_n"]) for r in map(json.loads, ls.stdout.splitlines())}
    assert keys == {p.key for p in plans if ("truncated", 1) in p.planted}


def test_a_clean_run_exits_0_and_bad_input_exits_2(tmp_path: Path, planted_run: Any) -> None:
    tok = tokenizer()
    plans = [clean_plan(tok, st, s, n) for st in range(3) for s in range(3) for n in range(3)]
    record(tmp_path / "clean", plans, prompt_for(tok), tok)
    proc = audit(str(tmp_path / "clean"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "audited 27 trajectories" in proc.stdout
    run_dir = planted_run[0]
    for args in (
        [str(run_dir), "--checks", "nonsense"],
        [str(run_dir), "--fail-on", "nonsense"],
        [str(tmp_path / "no-such-run")],
        [str(run_dir), "--step", "x..y"],
        [str(run_dir), "--threshold", "nope=1"],
    ):
        proc = audit(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_garbled_is_skipped_with_a_note_without_a_tokenizer(planted_run: Any, tmp_path: Path) -> None:
    import shutil

    from rlreplay.format import manifest

    run_dir = tmp_path / "run"
    shutil.copytree(planted_run[0], run_dir)
    data = json.loads((run_dir / manifest.MANIFEST).read_text())
    data.pop("tokenizer", None)
    (run_dir / manifest.MANIFEST).write_text(json.dumps(data))
    proc = audit(str(run_dir), "--checks", "garbled,truncated", "--json")
    assert proc.returncode == 1
    assert "garbled skipped" in proc.stderr
    assert {f["check"] for f in findings(proc)} == {"truncated"}


def drift_run(path: Path, tok: Any, lengths: list[int], rewards: list[float], tool_fail: list[float]) -> None:
    """One step per entry: responses of ``lengths[i]`` tokens, reward ``rewards[i]`` on average,
    a share ``tool_fail[i]`` of tools raising."""
    plans = []
    word = tok.encode(" apples").ids
    for step, (length, reward, fail) in enumerate(zip(lengths, rewards, tool_fail)):
        for s in range(4):
            for n in range(2):
                text = [i for k in range(length) for i in tok.encode(f" {k * 7 + s}").ids][:length] or word
                p = Plan(
                    step,
                    s,
                    n,
                    responses=[word, text],
                    stop=["stop", "stop"],
                    reward=reward + (0.05 if n else -0.05),
                )
                p.tool_raises = (s * 2 + n) < round(fail * 8)
                plans.append(p)
    record(path, plans, prompt_for(tok), tok)


def test_length_and_reward_drift(tmp_path: Path) -> None:
    tok = tokenizer()
    drift_run(tmp_path / "long", tok, [20, 24, 30, 40, 52, 60], [0.5] * 6, [0.0] * 6)
    drift_run(
        tmp_path / "hack", tok, [20] * 6, [0.1, 0.2, 0.3, 0.5, 0.7, 0.9], [0.0, 0.0, 0.25, 0.5, 0.5, 0.75]
    )
    drift_run(tmp_path / "steady", tok, [20] * 6, [0.5] * 6, [0.0] * 6)
    checks = ["--checks", "length_drift,reward_drift", "--json"]
    long, hack, steady = (findings(audit(str(tmp_path / r), *checks)) for r in ("long", "hack", "steady"))
    assert [(f["check"], f["step"], f["trajectory_id"]) for f in long] == [("length_drift", "0..5", None)]
    assert [(f["check"], f["step"]) for f in hack] == [("reward_drift", "0..5")]
    assert steady == []


VERL_RUN = ROOT / "sample_runs" / "verl-arith-smollm2"  # the showcase, audited in docs/audit.md


@pytest.mark.parametrize("name", ["verl-arith-smollm2", "verl-toolagent-smollm2"])
def test_the_real_verl_sample_run(name: str) -> None:
    """Findings on the shipped real-verl runs, against values computed from their span files."""
    run = ROOT / "sample_runs" / name
    expected = verl_sample_truth(run)
    collapsed, tool_errors = expected["group_collapse"], expected["tool_error"]
    truncated, retokenized = expected["truncated"], expected["retokenization"]
    assert collapsed and (tool_errors or truncated)  # each sample run has findings of both kinds

    proc = audit(str(run), "--json")
    found = findings(proc)
    by_check: dict[str, set[Any]] = {}
    for f in found:
        by_check.setdefault(f["check"], set()).add(f["trajectory_id"] or (f["step"], f["sample_index"]))
    assert by_check.get("tool_error", set()) == tool_errors
    assert by_check.get("group_collapse", set()) == collapsed
    assert by_check.get("truncated", set()) == truncated
    assert by_check.get("retokenization", set()) == retokenized
    assert proc.returncode == (1 if tool_errors | truncated | retokenized else 0)


def test_the_readme_shows_the_real_output_on_the_sample_run() -> None:
    """docs/audit.md's example prints what its text block shows."""
    readme = (ROOT / "docs" / "audit.md").read_text()
    command = "rlreplay audit sample_runs/verl-arith-smollm2 --fail-on none"
    after = readme.split(f"```bash\n{command}\n```\n", 1)[1]
    shown = after.split("```text\n", 1)[1].split("```", 1)[0]
    proc = audit(str(VERL_RUN), "--fail-on", "none")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.replace(str(VERL_RUN), "sample_runs/verl-arith-smollm2") == shown


def test_a_run_with_a_trajectory_without_a_step_is_audited(tmp_path: Path) -> None:
    import shutil

    import rlreplay

    run_dir = tmp_path / "run"
    shutil.copytree(ROOT / "tests" / "fixtures" / "v1-run", run_dir)
    steps = rlreplay.open_run(run_dir).trajectories()["step"].to_pylist()
    assert None in steps and any(s is not None for s in steps)  # the case: one recorded no step
    proc = audit(str(run_dir), "--json", "--fail-on", "none")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    trends = audit(str(run_dir), "--json", "--checks", "length_drift,reward_drift", "--fail-on", "none")
    assert trends.returncode == 0 and not trends.stderr, trends.stderr[-2000:]
