"""Framework adapters: the registry, verl's command-line knowledge, OpenAI messages from real runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlreplay
from rlreplay.adapters.registry import adapter_for_run, available, get_adapter, openai_messages
from rlreplay.errors import RunError
from rlreplay.hookspecs import FrameworkAdapter
from rlreplay.text.conversation import turns

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
#: What a recording process asks of its adapter, and which heavy modules that loaded.
RECORDING_PROCESS = """
import sys
from rlreplay.adapters.registry import get_adapter
verl = get_adapter("verl")
print(verl.span_kind("LLMServerClient.generate"), verl.token_fields("llm")["inputs"][0])
print(sorted(m for m in ("pyarrow", "numpy", "rlreplay.model") if m in sys.modules))
"""


def test_builtins_are_registered_as_entry_points() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="rlreplay.adapters")}
    assert {"generic", "verl"} <= names
    assert {"generic", "verl"} <= set(available())
    verl = get_adapter("verl")
    assert isinstance(verl, FrameworkAdapter) and verl.name == "verl"
    assert get_adapter() is get_adapter("generic")
    assert verl.span_kind("ToolAgentLoop.run") == "agent"
    assert verl.span_kind("LLMServerClient.generate") == "llm"
    assert verl.span_kind("HermesToolParser.extract_tool_calls") == "parser"
    assert verl.span_kind("Gsm8kTool.execute") == "tool"
    assert verl.span_kind("AgentLoopWorker.helper") == "op"
    assert "response_mask" in verl.token_fields("agent")["output"]
    assert "prompt_ids" in verl.token_fields("llm")["inputs"]


def test_a_recording_process_loads_its_adapter_without_pyarrow() -> None:
    """A recording process asks its adapter for span kinds and token fields as it decorates and
    calls the framework's methods, before the recorder (and pyarrow) loads."""
    out = subprocess.run(
        [sys.executable, "-c", RECORDING_PROCESS], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.splitlines() == ["llm prompt_ids", "[]"]


def test_unknown_framework_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match=r"unknown framework 'nope'; installed adapters: .*verl"):
        get_adapter("nope")
    run_dir = tmp_path / "run"
    (run_dir / "spans").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"framework": "nope"}))
    run = rlreplay.open_run(run_dir)
    assert adapter_for_run(run).name == "generic"
    assert any("unknown framework 'nope'" in w for w in run.warnings)


def test_verl_adapter_reads_hydra_overrides() -> None:
    verl = get_adapter("verl")
    argv = [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        "actor_rollout_ref.model.path=/models/Qwen3-0.6B",
        "trainer.experiment_name='gsm8k-grpo'",
        "+actor_rollout_ref.model.tokenizer_path=Qwen/Qwen3-0.6B",
    ]
    assert verl.tokenizer_from_argv(argv) == "Qwen/Qwen3-0.6B"
    assert verl.experiment_from_argv(argv) == "gsm8k-grpo"
    assert verl.tokenizer_from_argv(argv[:4]) == "/models/Qwen3-0.6B"
    assert get_adapter("generic").tokenizer_from_argv(argv) is None


@pytest.fixture(scope="module")
def sample() -> tuple[rlreplay.Run, object]:
    from rlreplay.text.token2text import Decoder, resolve_tokenizer

    run = rlreplay.open_run(SAMPLE)
    return run, Decoder.load(resolve_tokenizer(run, None))


def test_openai_messages_of_a_tool_using_rollout(sample) -> None:
    run, decoder = sample
    ids = run.trajectories(step=3)["id"].to_pylist()
    verl = get_adapter("verl")
    checked = 0
    for tid in ids:
        traj = run.trajectory(tid)
        conv = turns(traj, adapter=verl)
        messages = openai_messages(traj, decoder, verl)
        n_tool_turns = sum(t.role == "tool" for t in conv)
        calls = [c for m in messages for c in m.get("tool_calls", [])]
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        assert sum(m["role"] == "assistant" for m in messages) == sum(t.role == "assistant" for t in conv)
        tool_messages = [m for m in messages if m["role"] == "tool"]
        assert len(tool_messages) >= n_tool_turns
        for call in calls:
            assert call["type"] == "function"
            assert isinstance(call["function"]["arguments"], str)
            json.loads(call["function"]["arguments"])
        assert {m.get("tool_call_id") for m in tool_messages} <= {c["id"] for c in calls}
        for m in messages:
            assert isinstance(m["content"], str)
            assert "<|im_end|>" not in m["content"] and "<tool_call>" not in m["content"]
        if tool_messages:
            # the tool span's own ToolResponse.text, not the templated observation
            spans = sorted(traj.by_kind("tool"), key=lambda s: s.start_ns)
            assert tool_messages[0]["content"] == spans[0].output[0]["text"]
            checked += 1
    assert checked > 0


def test_tool_text_falls_back_to_the_decoded_turn(sample) -> None:
    run, decoder = sample
    verl = get_adapter("verl")
    for tid in run.trajectories(step=2)["id"].to_pylist():
        traj = run.trajectory(tid)
        if not traj.by_kind("tool"):
            continue
        for span in traj.by_kind("tool"):  # as if the tool's output had not been recorded
            span.output = None
        messages = openai_messages(traj, decoder, verl)
        tool = [m for m in messages if m["role"] == "tool"]
        assert tool and all(m["content"].startswith("Current parsed answer=") for m in tool)
        assert all("<tool_response>" not in m["content"] for m in tool)
        return
    pytest.fail("no tool-using trajectory at step 2")


def test_prompt_without_recorded_messages_is_one_user_message(sample) -> None:
    run, decoder = sample
    traj = run.trajectory(run.trajectories(step=1)["id"][0].as_py())
    for span in traj.by_kind("agent"):
        span.inputs = {}
    messages = openai_messages(traj, decoder, get_adapter("verl"))
    assert messages[0]["role"] == "user"
    assert "<|im_start|>" not in messages[0]["content"]
    assert "step by step" in messages[0]["content"]


def test_record_with_an_unknown_framework_fails_cleanly(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "record", "--framework", "nope", "--out", str(out), "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown framework 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
