"""The proxy tests' parts: one real model server per session (it stands in for vLLM and SGLang, which
need GPUs: ``model_server.py``), and ``rlreplay proxy`` as a real process in front of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import free_port

HERE = Path(__file__).resolve().parent


def wait_listening(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


@pytest.fixture(scope="session")
def model_server() -> Iterator[str]:
    """A real SmolLM2 server on CPU (vLLM's OpenAI protocol and SGLang's /generate); its base URL."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "model_server.py"), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(f"{url}/health", proc, timeout=600)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


class ProxyProcess:
    """``rlreplay proxy ARGS`` as its own process; ``stop()`` ends it as Ctrl-C or a service manager would."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlreplay", "proxy", "--port", str(self.port), *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = ""
        wait_listening(f"{self.url}/rlreplay/none", self.proc, timeout=60)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, self.stderr = self.proc.communicate(timeout=60)
        return self.proc.returncode


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator:
    started: list[ProxyProcess] = []

    def start(*args: str) -> ProxyProcess:
        proxy = ProxyProcess(*args, cwd=tmp_path)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
