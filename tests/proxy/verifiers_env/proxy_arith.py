"""A verifiers 0.4.0 environment plug-in for the proxy tests: a taskset of sums with a reward, and a
harness that runs verifiers' own ``null`` harness (its bundled chat program: the agent loop that calls
the model) with this Python instead of in an environment that ``uv`` would download at run time.

``vf-eval proxy_arith --env.assistant.harness.id proxy_arith ...`` finds both by this module's
``__all__`` (the folder is on ``PYTHONPATH``); everything else is verifiers: the eval runner, the
environment (``user-sim``: a modeled user and the assistant talk over several turns), its model-call
interception and the client that sends each call to ``--client.base-url``, the scoring.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

SUMS = [(2, 2), (3, 4), (5, 1), (6, 3)]


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        messages = trace.branches[-1].messages if trace.branches else []
        said = [str(m.content) for m in messages if m.role == "assistant"]
        return float(any(self.data.answer in text for text in said))


class SumConfig(vf.TasksetConfig):
    pass


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        for a, b in SUMS:
            yield SumTask(SumData(prompt=f"Ask what {a}+{b} is.", answer=str(a + b)), self.config.task)


class HostPython:
    """A rollout's runtime whose PEP 723 programs run on this interpreter (its environment holds
    every package verifiers' chat program declares) instead of one ``uv`` builds, downloading."""

    def __init__(self, runtime: vf.Runtime) -> None:
        self.runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)

    async def prepare_uv_script(
        self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-program-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self.runtime.write(path, data)
        return [sys.executable, path]


class HostNullHarness(NullHarness):
    """verifiers' ``null`` harness (a chat loop, no tools), its program run by :class:`HostPython`."""

    async def setup(self, runtime: vf.Runtime) -> None:
        await super().setup(HostPython(runtime))

    async def launch(self, ctx, trace, runtime, *args: Any, **kwargs: Any) -> vf.ProgramResult:
        return await super().launch(ctx, trace, HostPython(runtime), *args, **kwargs)


__all__ = ["HostNullHarness", "SumTaskset"]
