"""``rlreplay proxy`` against hostile clients, as a real process on 127.0.0.1: a web page posting
across origins (or through a name that resolves here), and a flood of half-open connections."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_listening
from support import free_port

from rlreplay.read.open import open_run

pytestmark = pytest.mark.timeout(600)
CALL = b'{"model": "m", "messages": [{"role": "user", "content": "Say pwned."}], "max_tokens": 2}'


def test_a_web_page_can_neither_set_the_step_nor_record_a_call(
    model_server: str, start_proxy: Any, tmp_path: Path
) -> None:
    proxy = start_proxy("--upstream", model_server, "--out", "run")
    page = {"Content-Type": "text/plain", "Origin": "http://attacker.example"}  # a "simple" CORS request
    for path, body in (
        ("/rlreplay/step", b'{"step": 41}'),
        ("/v1/chat/completions", CALL),
        ("/v1/models", b""),
    ):
        refused = httpx.post(f"{proxy.url}{path}", content=body, headers=page)
        assert refused.status_code == 403 and "web page" in refused.json()["error"]["message"]
    port = proxy.port
    rebound = httpx.post(
        f"{proxy.url}/rlreplay/step", content=b'{"step": 41}', headers={"Host": f"attacker.example:{port}"}
    )
    assert rebound.status_code == 403 and "Host" in rebound.json()["error"]["message"]
    marked = httpx.post(
        f"{proxy.url}/v1/chat/completions", content=CALL, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert marked.status_code == 403
    # the step is as it was: the next step is 1, and the proxy's own origin may post
    own = {"Origin": proxy.url, "Content-Type": "application/json"}
    assert httpx.post(f"{proxy.url}/rlreplay/step", content=b"", headers=own).json() == {"step": 1}
    assert proxy.stop() == 0, proxy.stderr
    assert open_run(tmp_path / "run").trajectories().num_rows == 0  # no call was recorded


def test_half_open_connections_never_keep_new_clients_out(model_server: str, tmp_path: Path) -> None:
    """The proxy may hold 1,024 files; 3,000 connections that never finish their request head come
    first: a new client is still answered, at once, and the log stays short."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlreplay",
            "proxy",
            "--port",
            str(port),
            "--upstream",
            model_server,
            "--out",
            "run",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=few_files,
    )
    held: list[socket.socket] = []
    try:
        wait_listening(f"{url}/rlreplay/none", proc, timeout=60)
        for _ in range(3000):
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.connect_ex(("127.0.0.1", port))
                held.append(sock)
                sock.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                pass  # not accepted yet: held half-open all the same
        time.sleep(2.0)
        started = time.monotonic()
        answer = httpx.post(f"{url}/v1/chat/completions", content=CALL, timeout=60)
        assert answer.status_code == 200 and time.monotonic() - started < 30
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert len(stderr) < 20_000 and "Traceback" not in stderr, stderr[-2000:]
