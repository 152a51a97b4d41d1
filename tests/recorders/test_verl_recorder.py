"""The verl recorder with the real verl package: `rlreplay record -- <unchanged verl job>`.

- A real local Ray cluster with actors that run verl's real AgentLoopWorker / ToolAgentLoop /
  LLMServerClient / HermesToolParser / BaseTool code (tests/verl_scripts/ray_agent_loop_workers.py).
- The hook's own semantics in one process (tests/verl_scripts/hook_scenarios.py): re-wrapping
  what was imported before the hook, verl's trace=False sampling, backend=mlflow still logging
  to MLflow, the reduced AgentData marker.
- verl's own CPU tests shipped in the PyPI sdist of verl 0.9.1, run under `rlreplay record`.
  (verl's tests/utils/test_rollout_trace_on_cpu.py is not in that sdist, so it cannot be run
  from PyPI; the sdist's agent-loop tests that call decorated methods are run instead.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support import json_rows, rlreplay_proc

import rlreplay

SCRIPTS = Path(__file__).parents[1] / "verl_scripts"


def record(out: Path, *command: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return rlreplay_proc("record", "--out", out, "--", *command, cwd=cwd, timeout=timeout)


def ls_json(run: Path, *filters: str) -> list[dict]:
    return json_rows("ls", run, *filters, "--json", timeout=60)


def check_tool_agent_tree(traj: rlreplay.Trajectory) -> None:
    """verl's ToolAgentLoop call tree: root → agent → generate / parser / tool, properly nested."""
    by_id = {s.span_id: s for s in traj.spans}
    (root,) = traj.roots
    assert (root.kind, root.name) == ("trajectory", "agent_loop")
    agents = [s for s in traj.spans if s.kind == "agent"]
    assert [a.name for a in agents] == ["ToolAgentLoop.run"]
    assert agents[0].parent_id == root.span_id
    names = [s.name for s in traj.spans if s.parent_id == agents[0].span_id]
    assert names == [
        "LLMServerClient.generate",
        "HermesToolParser.extract_tool_calls",
        "CalcTool.execute",
        "LLMServerClient.generate",
        "HermesToolParser.extract_tool_calls",
    ]
    for span in traj.spans:
        if span.parent_id is not None and span.kind != "signals":  # signals: the trainer's, later
            parent = by_id[span.parent_id]
            assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns
    (tool,) = traj.by_kind("tool")
    agent_data = tool.inputs["kwargs"]["agent_data"]
    assert agent_data["__type__"] == "reduced"
    assert agent_data["class"].endswith("tool_agent_loop.AgentData")
    first_generate = traj.by_kind("llm")[0]
    assert agent_data["request_id"] == first_generate.inputs["request_id"]
    assert (agent_data["assistant_turns"], agent_data["user_turns"]) == (1, 0)  # values at call time
    assert "messages" not in agent_data and "prompt_ids" not in agent_data
    assert tool.reward == 1.0  # the scripted model computes the right expression
    truth = agent_data["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"]
    assert tool.output[0]["text"] == f"{truth:g}"
    output = agents[0].output
    assert sum(output["response_mask"]) < len(output["response_mask"])  # tool tokens are masked out


def test_ray_agent_loop_workers_recorded_without_touching_the_job(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = tmp_path / "run"
    proc = record(run, sys.executable, str(SCRIPTS / "ray_agent_loop_workers.py"), str(workdir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DONE" in proc.stdout
    actors = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("ACTOR ")]
    assert len(actors) == 2
    named, unnamed = actors
    assert named["name"] == "rollout-a" and unnamed["name"] is None
    worker_a = "rollout-a"

    step1 = ls_json(run, "--step", "1")
    by_worker: dict[str, set] = {}
    for row in step1:
        by_worker.setdefault(row["worker"], set()).add(
            (row["sample_index"], row["rollout_n"], row["validate"])
        )
    assert by_worker.pop(worker_a) == {(10, 0, False), (10, 1, False), (11, 0, False), (11, 1, False)}
    # The unnamed actor: verl's sampling (max_samples_per_step_per_worker=1) kept one sample, both rollouts.
    ((worker_b, sampled),) = by_worker.items()
    assert worker_b.startswith("RolloutWorker") and unnamed["actor_id"][:8] in worker_b
    assert len(sampled) == 2
    (sample_b,) = {s for s, _, _ in sampled}
    assert sample_b in (30, 31, 32) and {n for _, n, _ in sampled} == {0, 1}

    step2 = ls_json(run, "--step", "2")
    assert {(r["worker"], r["sample_index"], r["rollout_n"], r["validate"]) for r in step2} == {
        (worker_a, 10, 0, True),
        (worker_a, 11, 0, True),
        (worker_a, 15, 0, False),  # trace=False without sampling asked for: still recorded
    }
    assert {r["sample_index"] for r in ls_json(run, "--step", "2", "--validate")} == {10, 11}

    opened = rlreplay.open_run(run)
    assert opened.manifest["tokenizer"] == str((workdir / "model").resolve())  # from the agent loop
    assert {r["experiment"] for r in step1 + step2} == {"ray-agent-loop"}  # verl's experiment_name
    for traj in opened.load([r["id"] for r in step1 + step2]):
        check_tool_agent_tree(traj)
    # The driver's compute_advantage (verl's own, reached through the trainer module) joined its
    # figures to the actors' trajectories through the key carried in the batch, after reordering.
    spans = opened.spans().to_pylist()
    signals = [s for s in spans if s["kind"] == "signals"]
    train_a = {r["id"]: r for r in step1 if r["worker"] == worker_a}
    assert {s["trajectory_id"] for s in signals} == set(train_a)
    driver = {s["worker"] for s in signals}
    assert len(driver) == 1 and driver.isdisjoint({worker_a, worker_b})
    roots = {s["trajectory_id"]: s["span_id"] for s in spans if s["kind"] == "trajectory"}
    for s in signals:
        assert s["parent_id"] == roots[s["trajectory_id"]]  # the agent-loop root, from another process
        assert s["reward"] == float(train_a[s["trajectory_id"]]["sample_index"])  # the row's own index
        assert (s["step"], s["sample_index"], s["rollout_n"], s["validate"]) == (
            1,
            train_a[s["trajectory_id"]]["sample_index"],
            train_a[s["trajectory_id"]]["rollout_n"],
            False,
        )
    # Each shard lies in its actor's folder and holds only that actor's spans.
    import pyarrow.parquet as pq

    shards = list((run / "spans").glob("step=*/worker=*/*.parquet"))
    assert len(shards) == 4  # step 1: both actors and the driver; step 2: rollout-a
    for shard in shards:
        folder = shard.parent.name.split("=", 1)[1]
        assert folder in (worker_a, worker_b, *driver)
        assert set(pq.read_table(shard, columns=["worker"]).column("worker").to_pylist()) == {folder}


def test_hook_rewraps_late_imports_honours_sampling_and_keeps_verl_backends(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "hook_scenarios.py"), str(run), str(tmp_path / "mlflow.db")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if not k.startswith(("RLREPLAY_", "MLFLOW_"))},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    report = json.loads(line[7:])

    # Imported before the hook: one warning, methods re-wrapped, imported names rebound.
    assert len(report["warnings"]) == 1 and "Agent.run" in report["warnings"][0]
    assert report["rewrapped_again"] == []
    assert report["attr_rebound"] and report["attr_wraps_original"] and report["op_rebound"]
    assert report["parser_wrapped"] and report["agent_wrapped"]
    # verl's own trace switch is untouched: off inside trace=False whenever a backend is set.
    assert [report[s]["verl_trace_enabled"] for s in ("s11", "s12", "s13", "s14", "s21")] == [
        [True],
        [False],
        [True],
        [False],
        [True],
    ]
    assert report["s31_error"] == "ValueError: agent failed on purpose"

    opened = rlreplay.open_run(run)
    rows = {r["step"]: r for r in opened.trajectories().to_pylist()}
    # Sampling asked for (step 12, trace=False) is honoured; trace=False without sampling is not.
    assert sorted(rows) == [11, 13, 14, 21, 31]
    assert [rows[s]["experiment"] for s in (11, 13, 14, 21)] == [
        "sampled-exp",
        "unset-exp",
        "plain-exp",
        "mlflow-exp",
    ]
    for step in (11, 13, 14, 21):
        traj = opened.trajectory(rows[step]["id"])
        kinds = {s.name: s.kind for s in traj.spans}
        assert kinds == {
            "agent_loop": "trajectory",
            "Formatter.format": "op",
            "Agent.run": "agent",
            "Tool.execute": "tool",
        }
        (tool,) = traj.by_kind("tool")
        assert tool.parent_id == traj.by_kind("agent")[0].span_id and tool.reward == 0.5
        assert traj.reward == 0.5  # the agent's reward_score
    failed = opened.trajectory(rows[31]["id"])
    assert failed.status == "error"
    assert failed.by_kind("agent")[0].output["type"] == "ValueError"

    # backend=mlflow: verl still logged its own traces to MLflow (steps 21 and 31).
    by_step = {t["tags"]["step"]: t for t in report["mlflow_traces"]}
    assert sorted(by_step) == ["21", "31"]
    assert {"agent_loop", "Agent.run", "Tool.execute"} <= set(by_step["21"]["spans"])
    assert by_step["21"]["tags"]["experiment_name"] == "mlflow-exp"


VERL_SDIST_TESTS = [
    "tests/experimental/agent_loop/test_tool_call_id_on_cpu.py",
    "tests/experimental/agent_loop/test_call_tool_on_cpu.py",
    "tests/tools/test_mixed_tools_on_cpu.py",
]
SDIST_CACHE = Path(os.environ.get("RLREPLAY_VERL_SDIST_DIR", "/tmp/rlreplay-verl-sdist"))


@pytest.fixture(scope="module")
def verl_sdist_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl's own tests/ folder from the PyPI sdist of the installed verl (cached under /tmp)."""
    from importlib.metadata import version

    name = f"verl-{version('verl')}"
    sdist = SDIST_CACHE / f"{name}.tar.gz"
    if not sdist.exists():
        SDIST_CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                *("--no-build-isolation", f"verl=={version('verl')}", "-d", str(SDIST_CACHE)),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and sdist.exists(), proc.stderr[-2000:]
    dest = tmp_path_factory.mktemp("verl-sdist")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"{name}/tests/")]
        for member in members:
            member.name = member.name[len(name) + 1 :]
        tar.extractall(dest, members=members, filter="data")
    assert not (dest / "tests/utils/test_rollout_trace_on_cpu.py").exists()  # not shipped on PyPI
    return dest


def test_verl_own_cpu_tests_pass_under_record(verl_sdist_tests: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = record(
        run,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *VERL_SDIST_TESTS,
        cwd=verl_sdist_tests,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    spans = rlreplay.open_run(run).spans(columns=["name", "kind", "status"]).to_pylist()
    assert {"name": "KimiToolParser.extract_tool_calls", "kind": "parser", "status": "ok"} in spans
