"""The verl hook's semantics in one process, with the real verl and MLflow packages.

usage: python hook_scenarios.py RUN_DIR MLFLOW_DB   (prints one JSON report line: ``REPORT {...}``)

verl is imported, and a class decorated with verl's original ``rollout_trace_op``, BEFORE
rlreplay installs its hook: the hook must warn once, re-wrap those methods through
``__wrapped__`` and rebind the names this module imported. Then, with verl's own
RolloutTraceConfig (reset between scenarios with verl's ``RolloutTraceConfig.reset``):

- step 11/12: backend=rlreplay, max_samples_per_step_per_worker=1: trace=True is recorded,
  trace=False is not (the user asked for sampling);
- step 13: backend unset, no sampling: trace=False is recorded anyway;
- step 14: backend=rlreplay, no sampling: trace=False is recorded; verl's own switch is still off;
- step 21: backend=mlflow (sqlite file): verl still logs its trace to MLflow, rlreplay records too;
- step 31: an exception inside a decorated method is recorded and re-raised unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import verl.experimental.agent_loop.tool_parser as tool_parser
from verl.utils.rollout_trace import RolloutTraceConfig, _trace_enabled, rollout_trace_attr, rollout_trace_op

ORIGINALS = {"attr": rollout_trace_attr}  # in a dict: the hook rebinds module-level aliases too


class Tool:
    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        return {"text": str(parameters["x"] * 2)}, 0.5, {}


class Agent:
    def __init__(self) -> None:
        self.tool = Tool()

    @rollout_trace_op
    async def run(self, sampling_params: dict, **kwargs):
        seen = [_trace_enabled.get()]
        response, reward, _ = await self.tool.execute("i-1", {"x": kwargs["x"]})
        if kwargs.get("fail"):
            raise ValueError("agent failed on purpose")
        return {"response": response["text"], "reward_score": reward, "verl_trace_enabled": seen}


class Formatter:
    @rollout_trace_op
    def format(self, value: int) -> str:  # a sync method: recorded as kind "op"
        return f"<{value}>"


async def rollout(step: int, sample: int, trace: bool, **kwargs) -> dict:
    with rollout_trace_attr(step=step, sample_index=sample, rollout_n=0, name="agent_loop", trace=trace):
        Formatter().format(sample)
        return await Agent().run({"temperature": 1.0}, x=sample, **kwargs)


def main() -> None:
    run_dir, mlflow_db = sys.argv[1], sys.argv[2]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("rlreplay").addHandler(handler)

    import rlreplay
    from rlreplay.recorders import verl as verl_hook

    rlreplay.init(run_dir, experiment="fallback-experiment")
    verl_hook.install(sys.modules["verl.utils.rollout_trace"])
    again = verl_hook.patch_already_imported()  # idempotent: nothing left to re-wrap
    this = sys.modules[__name__]
    report: dict = {
        "warnings": [r.getMessage() for r in records if "re-wrapped" in r.getMessage()],
        "rewrapped_again": again,
        "attr_rebound": this.rollout_trace_attr is not ORIGINALS["attr"],
        "attr_wraps_original": getattr(this.rollout_trace_attr, "__wrapped__", None) is ORIGINALS["attr"],
        "op_rebound": this.rollout_trace_op is sys.modules["verl.utils.rollout_trace"].rollout_trace_op,
        "parser_wrapped": getattr(
            tool_parser.HermesToolParser.extract_tool_calls, "__rlreplay_verl__", False
        ),
        "agent_wrapped": getattr(Agent.run, "__rlreplay_verl__", False),
    }

    async def scenarios() -> None:
        RolloutTraceConfig.reset()
        RolloutTraceConfig.init("proj", "sampled-exp", "rlreplay", max_samples_per_step_per_worker=1)
        report["s11"] = await rollout(11, 1, True)
        report["s12"] = await rollout(12, 2, False)

        RolloutTraceConfig.reset()
        RolloutTraceConfig.init("proj", "unset-exp", None)
        report["s13"] = await rollout(13, 3, False)

        RolloutTraceConfig.reset()
        RolloutTraceConfig.init("proj", "plain-exp", "rlreplay")
        report["s14"] = await rollout(14, 4, False)

        RolloutTraceConfig.reset()
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{mlflow_db}"
        RolloutTraceConfig.init("rlreplay-verl-hook", "mlflow-exp", "mlflow")
        report["s21"] = await rollout(21, 5, True)

        try:
            await rollout(31, 6, True, fail=True)
        except ValueError as exc:
            report["s31_error"] = f"{type(exc).__name__}: {exc}"

    asyncio.run(scenarios())

    import mlflow

    mlflow.flush_trace_async_logging()
    traces = mlflow.search_traces(return_type="list")  # the experiment verl set: its project name
    report["mlflow_traces"] = [
        {"tags": dict(t.info.tags), "spans": sorted(s.name for s in t.data.spans)} for t in traces
    ]
    rlreplay.close()
    print("REPORT " + json.dumps(report, default=str), flush=True)


if __name__ == "__main__":
    main()
