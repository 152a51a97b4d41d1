"""Secrets never reach the manifest; ordinary verl overrides stay readable."""

from __future__ import annotations

from rlreplay.format.redact import REDACTED, redact_argv


def test_secret_options_and_values_are_hidden() -> None:
    argv = [
        "--hf-token",
        "hf_abcdefghijklmnopqrstuvwx",
        "--api-key=sk-abcdefghijklmnopqrstuvwx",
        "WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567",
        "+trainer.wandb_api_key=plain",
        "--password=p",
        "--aws-secret-key=s",
        "positional-ghp_abcdefghijklmnopqrstuvwxyz",
    ]
    out = redact_argv(argv)
    assert out == [
        "--hf-token",
        REDACTED,
        f"--api-key={REDACTED}",
        f"WANDB_API_KEY={REDACTED}",
        f"+trainer.wandb_api_key={REDACTED}",
        f"--password={REDACTED}",
        f"--aws-secret-key={REDACTED}",
        f"positional-{REDACTED}",
    ]


def test_ordinary_overrides_are_kept() -> None:
    argv = [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        "--max-new-tokens=40",
        "data.prompt_key=prompt",
        "data.max_response_length=1024",
        "actor_rollout_ref.model.tokenizer_path=Qwen/Qwen3-0.6B",
        "actor_rollout_ref.rollout.trace.token2text=True",
        "max_tokens=5",
    ]
    assert redact_argv(argv) == argv
