"""Reading processes: the proxy reads what it records of each answer (the credential scan of its
bytes, its JSON, ids and log-probs, the continuation's digest: :mod:`rlreplay.proxy.answers`) in
other processes, so that its serving loop forwards bytes and uses one core while reading uses the
others. A call goes to the process with the fewest calls waiting, over a pipe (each message its
length, then a pickle). A process that fails or stops costs no record: the serving loop reads
that answer itself, as it does with no reading process (``--readers 0``).

``python -m rlreplay.proxy.readers`` is one reading process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_SIZE = struct.Struct("<Q")
_GONE = (False, None)  # the process stopped before it answered
T = TypeVar("T")


def default_count() -> int:
    """Reading processes for this machine: one core is the serving loop's, the others read (up to
    4); at least two, so that answers that end together (a group of rollouts) are read side by side
    rather than one waiting for the other."""
    return max(2, min(4, (os.cpu_count() or 1) - 1))


#: What the pipe to a reading process holds: an answer of ~0.5 MB passes in one write rather than
#: one per 64 KB (the default), each of which wakes the serving loop.
PIPE_BYTES = 1 << 20


def _widen(calls: asyncio.StreamWriter) -> None:
    """Give the pipe to a reading process room for :data:`PIPE_BYTES`, and let that much wait to
    be written without holding the call back (Linux; elsewhere, or beyond the system's limit, the
    pipe stays as it is)."""
    pipe = calls.transport.get_extra_info("pipe")
    try:
        from fcntl import F_SETPIPE_SZ, fcntl
    except ImportError:  # not Linux
        pipe = None
    if pipe is not None:
        with contextlib.suppress(OSError):
            fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
    calls.transport.set_write_buffer_limits(high=PIPE_BYTES)


class _Process:
    """One reading process and the calls it has not answered yet, in the order they were sent."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.waiting: deque[asyncio.Future[tuple[bool, Any]]] = deque()
        self.alive = True
        self.listener = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            while True:
                (size,) = _SIZE.unpack(await stdout.readexactly(_SIZE.size))
                answer = pickle.loads(await stdout.readexactly(size))
                future = self.waiting.popleft()
                if not future.done():
                    future.set_result(answer)
        except (asyncio.IncompleteReadError, OSError, pickle.UnpicklingError, IndexError, EOFError):
            pass
        finally:
            self._stopped()

    def _stopped(self) -> None:
        if self.alive:
            self.alive = False
            print(
                "rlreplay proxy: a reading process stopped; the proxy reads answers itself",
                file=sys.stderr,
                flush=True,
            )
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_result(_GONE)

    async def ask(self, message: bytes) -> tuple[bool, Any]:
        stdin = self.proc.stdin
        assert stdin is not None
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        try:
            stdin.write(_SIZE.pack(len(message)) + message)
            await stdin.drain()
        except (OSError, RuntimeError):
            self._stopped()
        return await future


class Readers:
    """``count`` reading processes (0: the serving loop reads)."""

    def __init__(self, count: int | None = None) -> None:
        self.count = default_count() if count is None else count
        self.processes: list[_Process] = []
        self.failed = 0  # calls a reading process could not read (the serving loop read them)

    async def start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}
        for _ in range(self.count):
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "rlreplay.proxy.readers",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    env=env,
                )
            except OSError as exc:
                why = exc.strerror or exc
                print(
                    f"rlreplay proxy: no reading process ({why}); the proxy reads answers itself",
                    file=sys.stderr,
                )
                return
            if proc.stdin is not None:
                _widen(proc.stdin)
            self.processes.append(_Process(proc))

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` (a module-level function), in a reading process when one is
        running and takes it, else here."""
        live = [p for p in self.processes if p.alive]
        if live:
            try:
                message = pickle.dumps((function, args), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # what pickle cannot write (nested too deep): read here
                message = None
            if message is not None:
                ok, value = await min(live, key=lambda p: len(p.waiting)).ask(message)
                if ok:
                    return value
                if value is not None:  # it raised: said once, then read here
                    self.failed += 1
                    if self.failed == 1:
                        print(
                            f"rlreplay proxy: a reading process could not read an answer ({value}); "
                            "the proxy reads such answers itself",
                            file=sys.stderr,
                            flush=True,
                        )
        return function(*args)

    async def stop(self) -> None:
        for process in self.processes:
            process.alive = False
            stdin = process.proc.stdin
            if stdin is not None:
                stdin.close()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.proc.wait(), 5)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.proc.kill()
                await process.proc.wait()
            process.listener.cancel()
        self.processes = []


def _read_calls() -> None:
    """Answer calls from standard input until it ends (the proxy stopped or died)."""
    import gc
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the proxy's to act on
    gc.set_threshold(20_000, *gc.get_threshold()[1:])  # parsed answers hold no cycles
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to standard error, not into the channel
    calls = sys.stdin.buffer
    while True:
        head = calls.read(_SIZE.size)
        if len(head) < _SIZE.size:
            return
        message = calls.read(_SIZE.unpack(head)[0])
        try:
            function, args = pickle.loads(message)
            answer: tuple[bool, Any] = (True, function(*args))
            out = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # the proxy reads this one itself, and meets the error there
            out = pickle.dumps((False, type(exc).__name__))  # its message may quote the answer
        try:
            channel.write(_SIZE.pack(len(out)) + out)
            channel.flush()
        except OSError:  # the proxy has gone: nothing here to finish
            os._exit(0)


if __name__ == "__main__":
    _read_calls()
