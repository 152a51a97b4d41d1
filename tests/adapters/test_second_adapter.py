"""A second framework is one package: an adapter registered in the entry-point group ``rlreplay.adapters``.

The test writes, into a temporary folder, a toy RL framework (``toyrl``: its own method names
and field names, unaware of rlreplay) and a separate adapter package (``rlreplay_toyrl``) whose
``*.dist-info/entry_points.txt`` registers ``toyrl = rlreplay_toyrl:ToyAdapter``. With that folder
on ``PYTHONPATH``, ``rlreplay record --framework toyrl`` hooks the framework through the adapter,
and ``ls``, ``diff`` and the conversation read the run through it. No rlreplay file is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOYRL = '''
"""A toy RL framework: an episode is two policy samples around one environment step."""


class Policy:
    def sample(self, context: list[int], seed: int) -> dict:
        return {"tokens": [200 + seed, 201, 202 + (seed % 2)], "logp": [-0.1, -0.2, -0.3]}


class Env:
    def step(self, action: list[int]) -> dict:
        return {"observation": f"obs for {action[-1]}", "obs_tokens": [300, action[-1] % 7]}


class Episode:
    def rollout(self, prompt: list[int], seed: int) -> dict:
        policy, env = Policy(), Env()
        first = policy.sample(prompt, seed)["tokens"]
        obs = env.step(first)["obs_tokens"]
        second = policy.sample(prompt + first + obs, seed + 1)["tokens"]
        completion = first + obs + second
        mask = [1] * len(first) + [0] * len(obs) + [1] * len(second)
        return {"context_ids": prompt, "completion_ids": completion, "completion_mask": mask}


def run_episode(step: int, group: int, member: int) -> dict:
    return Episode().rollout([1, 2, 3, group], seed=member)
'''

ADAPTER = '''
"""rlreplay's adapter for toyrl (a separate package; rlreplay knows nothing about it)."""

import functools

from rlreplay.adapters.generic import GenericAdapter
from rlreplay.text.conversation import ConversationFields


class ToyAdapter(GenericAdapter):
    name = "toyrl"
    fields = ConversationFields(
        prompt=("context_ids",),
        response=("completion_ids",),
        mask=("completion_mask",),
        llm_prompt=("context",),
        llm_output=("tokens",),
        log_probs=("logp",),
    )
    kind_by_name = {"sample": "llm", "step": "tool", "rollout": "agent"}

    def install(self) -> None:
        import rlreplay
        import toyrl

        for cls, method in ((toyrl.Policy, "sample"), (toyrl.Env, "step"), (toyrl.Episode, "rollout")):
            fn = getattr(cls, method)
            setattr(cls, method, rlreplay.trace_op(fn, kind=self.span_kind(fn.__qualname__)))
        original = toyrl.run_episode

        @functools.wraps(original)
        def run_episode(step, group, member):
            with rlreplay.trajectory(step=step, sample_index=group, rollout_n=member, name="episode"):
                return original(step, group, member)

        toyrl.run_episode = run_episode

    def tool_output_text(self, output):
        return output.get("observation") if isinstance(output, dict) else None

    def tokenizer_from_argv(self, argv):
        return next((a.split("=", 1)[1] for a in argv if a.startswith("--toy-tokenizer=")), None)

    def experiment_from_argv(self, argv):
        return next((a.split("=", 1)[1] for a in argv if a.startswith("--toy-name=")), None)
'''

JOB = """
import sys

import toyrl

for step in (1, 2):
    for group in range(2):
        for member in range(2):
            toyrl.run_episode(step, group, member)
print("JOB DONE")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    (root / "toyrl").mkdir()
    (root / "toyrl" / "__init__.py").write_text(textwrap.dedent(TOYRL))
    (root / "rlreplay_toyrl").mkdir()
    (root / "rlreplay_toyrl" / "__init__.py").write_text(textwrap.dedent(ADAPTER))
    dist = root / "rlreplay_toyrl-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlreplay-toyrl\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlreplay.adapters]\ntoyrl = rlreplay_toyrl:ToyAdapter\n")
    (root / "job.py").write_text(textwrap.dedent(JOB))
    return root


def run(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("RLREPLAY_DIR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


@pytest.fixture(scope="module")
def recorded(site: Path) -> Path:
    out = site.parent / "toy-run"
    proc = run(
        site,
        "-m",
        "rlreplay",
        "record",
        "--framework",
        "toyrl",
        "--out",
        str(out),
        "--",
        sys.executable,
        "job.py",
        "--toy-tokenizer=/models/toy",
        "--toy-name=toy-exp",
        cwd=site,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "JOB DONE" in proc.stdout
    return out


def test_records_and_lists_through_the_registered_adapter(site: Path, recorded: Path) -> None:
    manifest = json.loads((recorded / "run.json").read_text())
    assert manifest["framework"] == "toyrl"
    assert (
        manifest["tokenizer"] == "/models/toy" and manifest["experiment"] == "toy-exp"
    )  # the adapter's guesses
    proc = run(site, "-m", "rlreplay", "ls", str(recorded), "--json", cwd=site)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(rows) == 8
    assert {(r["step"], r["sample_index"], r["rollout_n"]) for r in rows} == {
        (s, g, m) for s in (1, 2) for g in range(2) for m in range(2)
    }


def test_conversation_and_messages_come_from_the_adapter(site: Path, recorded: Path) -> None:
    code = textwrap.dedent(
        f"""
        import json, rlreplay
        from rlreplay.adapters.registry import adapter_for_run, openai_messages
        from rlreplay.text.conversation import turns
        run = rlreplay.open_run({str(recorded)!r})
        adapter = adapter_for_run(run)
        traj = run.trajectory(run.trajectories(step=1, sample_index=1, rollout_n=1)["id"][0].as_py())
        print(json.dumps({{
            "adapter": type(adapter).__module__ + "." + type(adapter).__name__,
            "turns": [(t.role, t.token_ids) for t in turns(traj, adapter=adapter)],
            "generic": [t.token_ids for t in turns(traj)],
            "messages": openai_messages(traj, None, adapter),
            "kinds": sorted({{s.kind for s in traj.spans}}),
        }}))
        """
    )
    proc = run(site, "-c", code, cwd=site)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["adapter"] == "rlreplay_toyrl.ToyAdapter"
    assert got["kinds"] == ["agent", "llm", "tool", "trajectory"]
    assert got["turns"] == [
        ["prompt", [1, 2, 3, 1]],
        ["assistant", [201, 201, 203]],
        ["tool", [300, 203 % 7]],
        ["assistant", [202, 201, 202]],
    ]
    assert not any(got["generic"])  # the generic field names find no token ids in toyrl's spans
    roles = [m["role"] for m in got["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert got["messages"][2]["content"] == "obs for 203"  # the adapter's tool_output_text


def test_diff_uses_the_adapter(site: Path, recorded: Path) -> None:
    proc = run(
        site,
        "-m",
        "rlreplay",
        "diff",
        "-r",
        str(recorded),
        "step=1,sample_index=0,rollout_n=0",
        "rollout_n=1",
        "--no-text",
        "--json",
        cwd=site,
    )
    assert proc.returncode == 0, proc.stderr
    diff = json.loads(proc.stdout)
    text = json.dumps(diff)
    assert "assistant" in text and "tool" in text
    divergence = diff.get("divergence") or diff.get("first_divergence")
    assert divergence is not None  # the members' first samples differ (seed 0 vs 1)
