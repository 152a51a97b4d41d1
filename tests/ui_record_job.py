"""Records runs for the UI tests with the real recorder, in its own process.

``python ui_record_job.py hostile RUN``: one group of trajectories whose text, tool arguments,
tool error and experiment name hold HTML (the page must show it as text).
``python ui_record_job.py trend RUN``: GRPO-like training over steps 0..5 with the same prompts
at every step (sample_index 10, 11, 12; 4 rollouts), rewards rising with the step, and the trainer's
signals (advantage, per-token log-probs drifting from the rollout's, entropy) for every rollout; validation
(sample_index 900, 2 rollouts) at steps 0 and 5, and one long validation rollout (sample_index 99).
``python ui_record_job.py live RUN CONTROL``: one trajectory, then ``CONTROL/ready``; on
``CONTROL/go`` one more (step 1, sample_index 7); then ``CONTROL/written``; stops on ``CONTROL/stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

from support import qwen_tokenizer_dir as tokenizer_dir

import rlreplay
from rlreplay.format import manifest

HOSTILE_TEXT = '<script>window.__xss = 1</script> "><img src=x onerror="window.__xss = 2"> & done'
HOSTILE_ARG = '"><img src=x onerror=window.__xss=3>'
HOSTILE_ERROR = "<script>window.__xss = 4</script> tool failed"
HOSTILE_EXPERIMENT = "<i>exp</i>"


def _tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))


class LLMServerClient:
    @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        ids = sampling_params["ids"]
        return {"token_ids": ids, "log_probs": [-0.05 * (i % 7) for i in range(len(ids))]}


class HermesToolParser:
    @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
    async def extract_tool_calls(self, responses_ids: list[int]) -> list[dict]:
        return [{"name": "calc", "arguments": {"expression": HOSTILE_ARG}}]


class CalcTool:
    @rlreplay.trace_op(name="CalcTool.execute", kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
        if parameters.get("fail"):
            raise ValueError(HOSTILE_ERROR)
        return ({"text": "4"}, 0.0, {})


class ToolAgentLoop:
    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    async def run(self, tok, text: str, rollout: int) -> dict:
        prompt = tok.encode("<|im_start|>user\nCompute 2+2 please.<|im_end|>\n<|im_start|>assistant\n").ids
        first = tok.encode(f"{text} rollout {rollout}<|im_end|>").ids
        await LLMServerClient().generate("r0", prompt_ids=prompt, sampling_params={"ids": first})
        await HermesToolParser().extract_tool_calls(first)
        with contextlib.suppress(ValueError):
            await CalcTool().execute("t0", {"expression": HOSTILE_ARG, "fail": rollout == 1})
        observation = tok.encode("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n").ids
        second = tok.encode(f"The answer is {4 + rollout}.<|im_end|>").ids
        await LLMServerClient().generate(
            "r1", prompt_ids=prompt + first + observation, sampling_params={"ids": second}
        )
        response = first + observation + second
        mask = [1] * len(first) + [0] * len(observation) + [1] * len(second)
        logprobs = [-0.05 * (i % 7) if m else 0.0 for i, m in enumerate(mask)]
        return {
            "prompt_ids": prompt,
            "response_ids": response,
            "response_mask": mask,
            "response_logprobs": logprobs,
            "reward_score": 1.0 if rollout == 0 else 0.0,
        }


def trainer_logprobs(rollout_logprobs: list[float]) -> list[float]:
    """What the trainer recomputed for the same tokens (``--token-signals``): drifts on some."""
    return [lp - (0.5 if i % 5 == 0 else 0.0) for i, lp in enumerate(rollout_logprobs)]


async def _one(tok, step: int, sample: int, rollout: int, text: str) -> None:
    keys = {"step": step, "sample_index": sample, "rollout_n": rollout}
    async with rlreplay.trajectory(**keys, name="agent_loop") as traj:
        out = await ToolAgentLoop().run(tok, text, rollout)
    if rollout == 0:  # as the trainer does later, from its own process, for the same trajectory
        from rlreplay.recorder.signals import record_signals

        record_signals(
            traj.id,
            **keys,
            validate=False,
            advantage=0.75,
            logprob_diff_max=0.5,
            output={"old_log_probs": trainer_logprobs(out["response_logprobs"])},
        )


def hostile(run_dir: Path) -> None:
    tok = _tok()
    rlreplay.init(run_dir, experiment=HOSTILE_EXPERIMENT, worker="w0")

    async def go() -> None:
        await asyncio.gather(*(_one(tok, 0, 3, n, HOSTILE_TEXT) for n in range(3)))

    asyncio.run(go())
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(tokenizer_dir()))


TREND_STEPS = range(6)
TREND_SAMPLES = (10, 11, 12)
TREND_ROLLOUTS = 4
TREND_VAL_SAMPLE = 900


def trend_reward(step: int, sample: int, rollout: int) -> float:
    """Rises with the step; sample 12 is solved by every rollout (a zero-spread group)."""
    return 1.0 if sample == 12 or rollout < 1 + step * TREND_ROLLOUTS // 6 else 0.0


def trend_entropy(n: int) -> list[float]:
    """Per-token entropy the trainer records with its log-probs."""
    return [0.25 * (i % 9) for i in range(n)]


def _trend_ids(tok, sample: int, text: str) -> tuple[list[int], list[int]]:
    prompt = tok.encode(
        f"<|im_start|>user\nQuestion {sample}: what is {sample} * 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    return prompt.ids, tok.encode(f"{text}<|im_end|>").ids


class TrendLoop:
    @rlreplay.trace_op(name="TrendLoop.run", kind="agent")
    async def run(self, tok, step: int, sample: int, rollout: int, validate: bool) -> dict:
        answer = sample * 3 if trend_reward(step, sample, rollout) else sample * 3 + rollout + 1
        think = " step by step" * (1 + rollout + step)
        prompt, ids = _trend_ids(tok, sample, f"Thinking{think}. The answer is {answer}.")
        await LLMServerClient().generate("r0", prompt_ids=prompt, sampling_params={"ids": ids})
        return {
            "prompt_ids": prompt,
            "response_ids": ids,
            "response_mask": [1] * len(ids),
            "response_logprobs": [-0.05 * (i % 7) for i in range(len(ids))],
            "reward_score": 0.0 if validate and rollout else trend_reward(step, sample, rollout),
        }


def trend(run_dir: Path) -> None:
    from rlreplay.recorder.signals import record_signals

    tok = _tok()
    rlreplay.init(run_dir, experiment="trend", worker="w0")

    async def one(step: int, sample: int, rollout: int, validate: bool) -> tuple[str, dict]:
        keys = {"step": step, "sample_index": sample, "rollout_n": rollout, "validate": validate}
        async with rlreplay.trajectory(**keys, name="agent_loop") as traj:
            out = await TrendLoop().run(tok, step, sample, rollout, validate)
        return traj.id, out

    async def go() -> None:
        for step in TREND_STEPS:
            for sample in TREND_SAMPLES:
                done = await asyncio.gather(*(one(step, sample, n, False) for n in range(TREND_ROLLOUTS)))
                rewards = [out["reward_score"] for _, out in done]
                mean = sum(rewards) / len(rewards)
                for n, (tid, out) in enumerate(done):
                    trainer = [lp - 0.02 * step * (i % 3) for i, lp in enumerate(out["response_logprobs"])]
                    diffs = [abs(a - b) for a, b in zip(trainer, out["response_logprobs"])]
                    record_signals(
                        tid,
                        step=step,
                        sample_index=sample,
                        rollout_n=n,
                        validate=False,
                        advantage=rewards[n] - mean,
                        logprob_diff_mean=sum(diffs) / len(diffs),
                        logprob_diff_max=max(diffs),
                        importance_ratio=1.0 + 0.01 * step * (n - 1.5),
                        output={"old_log_probs": trainer, "entropy": trend_entropy(len(trainer))},
                    )
            if step in (TREND_STEPS[0], TREND_STEPS[-1]):
                await asyncio.gather(*(one(step, TREND_VAL_SAMPLE, n, True) for n in range(2)))

    asyncio.run(go())
    asyncio.run(_long(tok))
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(tokenizer_dir()))


TREND_LONG_SAMPLE = 99
TREND_LONG_TOKENS = 20_000  # more blocks than the page draws at once


class LongLoop:
    @rlreplay.trace_op(name="LongLoop.run", kind="agent")
    async def run(self, prompt: list[int], ids: list[int]) -> dict:
        return {"prompt_ids": prompt, "response_ids": ids, "response_mask": [1] * len(ids)}


async def _long(tok) -> None:
    """One validation rollout of TREND_LONG_TOKENS tokens (a long response: minimap, blocks)."""
    prompt, words = _trend_ids(tok, TREND_LONG_SAMPLE, " ".join(f"w{i}" for i in range(TREND_LONG_TOKENS)))
    keys = {"step": TREND_STEPS[-1], "sample_index": TREND_LONG_SAMPLE, "rollout_n": 0, "validate": True}
    async with rlreplay.trajectory(**keys, name="agent_loop"):
        await LongLoop().run(prompt, words[:TREND_LONG_TOKENS])


def _wait(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.05)


def live(run_dir: Path, control: Path) -> None:
    tok = _tok()
    rlreplay.init(run_dir, experiment="live", worker="w0")
    manifest.update_manifest(run_dir, tokenizer=str(tokenizer_dir()))
    asyncio.run(_one(tok, 0, 1, 0, "first answer"))
    rlreplay.flush()
    (control / "ready").touch()
    _wait(control / "go")
    asyncio.run(_one(tok, 1, 7, 0, "a brand new trajectory"))
    rlreplay.flush()
    (control / "written").touch()
    _wait(control / "stop")
    rlreplay.close()


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    if mode == "hostile":
        hostile(target)
    elif mode == "trend":
        trend(target)
    else:
        live(target, Path(sys.argv[3]))
