"""How the proxy's event loop gives what it records to the recorder without ever waiting for it.

The recorder's ``on_end`` costs its caller a queue append, unless its queue is full: then (policy
``spill``) the caller encodes queued spans and writes them itself, under the writer's lock, which
the writer holds while it writes to disk. The event loop answers every client: it must not pay that.
:class:`Handoff` offers each event to the recorder's queue (``Recorder.offer``: never blocks); what
finds it full waits here, in order, and a thread of its own hands it on (``submit``) and pays
(spills, waits for the disk) in the event loop's place. Events keep their order: while anything
waits here, later events wait behind it. What waits is bounded by ``max_bytes`` (``MAX_BYTES``, or
the recorder's queue bound when larger): beyond it a span is not kept but counted as dropped
(``rlreplay info``), as the recorder's ``drop`` policy counts it; a trajectory's open event and
root span are always kept.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from rlreplay.recorder.events import SPAN

#: what may wait here at least (the recorder's own queue bound, when larger)
MAX_BYTES = 64 << 20
#: an event handed on (a ``SpanEvent`` or ``Control``), or a call made on the hand-off thread
Item = Any


class Handoff:
    """Events for ``recorder``, queued without waiting; handed on by the ``rlreplay-proxy-handoff``
    thread when the recorder's queue is full."""

    def __init__(self, recorder: Any, max_bytes: int | None = None) -> None:
        self.recorder = recorder
        queue_bytes = getattr(getattr(recorder, "config", None), "max_queue_bytes", 0)
        self.max_bytes = max_bytes if max_bytes is not None else max(queue_bytes, MAX_BYTES)
        self._waiting: deque[tuple[Item, int]] = deque()
        # counted on one side each (put: the event loop, done: the hand-off thread): no lock needed
        self._put = self._done = 0  # events
        self._put_bytes = self._done_bytes = 0
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """Events waiting here for the recorder."""
        return self._put - self._done

    def give(self, event: Any) -> None:
        """Hand ``event`` to the recorder: into its queue now when nothing waits here and it has
        room, else to wait here (a span beyond ``max_bytes``: dropped and counted, but a root span)."""
        if self._put == self._done and self.recorder.offer(event):
            return
        nbytes = int(getattr(event, "nbytes", 0) or 0)
        if (
            getattr(event, "kind", SPAN) == SPAN
            and getattr(event, "parent_id", None) is not None
            and self._put_bytes - self._done_bytes + nbytes > self.max_bytes
        ):
            self.recorder.count_loss(
                "dropped",
                1,
                "proxy-handoff",
                "the recorder's queue and the proxy's hand-off are full: dropping spans",
            )
            return
        self._queue((self.recorder.submit, event), nbytes)

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the hand-off thread, after what waits now (e.g. recording signals)."""
        self._queue((fn, None), 0)

    def _queue(self, item: tuple[Callable[..., Any], Any], nbytes: int) -> None:
        self._put_bytes += nbytes
        self._waiting.append((item, nbytes))
        self._put += 1
        if self._thread is None:
            self._start()
        self._wake.set()

    def _start(self) -> None:
        thread = threading.Thread(target=self._run, name="rlreplay-proxy-handoff", daemon=True)
        thread.start()
        self._thread = thread

    def _run(self) -> None:
        waiting = self._waiting
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            while waiting:
                (fn, event), nbytes = waiting.popleft()
                try:
                    fn(event) if event is not None else fn()
                except Exception as exc:  # never raises: counted, as the recorder counts
                    with contextlib.suppress(Exception):
                        self.recorder.count_loss(
                            "lost", 1, "proxy-handoff", f"could not record ({type(exc).__name__}: {exc})"
                        )
                self._done_bytes += nbytes
                self._done += 1  # after the call: a later event goes to the recorder after this one
            if self._closing and not waiting:
                return

    def close(self, timeout: float | None = None) -> bool:
        """Hand on everything waiting (the thread waits for the recorder as long as it must, or
        ``timeout``); True when nothing is left waiting."""
        self._closing = True
        thread = self._thread
        if thread is None:
            return True
        self._wake.set()
        thread.join(timeout)
        return not thread.is_alive()
