"""The shipped verl runs are self-contained: each holds the tokenizer and chat template that rendered
its prompts (copied by ``rlreplay record``), so that on a fresh clone, with no model folder and no
Hugging Face cache, ``rlreplay export`` decodes it and ``AutoTokenizer.from_pretrained(RUN)`` renders
every exported record back to the prompt ids the model saw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import first_prompt_ids

ROOT = Path(__file__).resolve().parent.parent
VERL_RUNS = ["verl-arith-smollm2", "verl-toolagent-smollm2"]


@pytest.fixture(params=VERL_RUNS)
def fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The run folder alone, as a fresh clone has it, on a machine with an empty home."""
    run = tmp_path / "clone" / request.param
    shutil.copytree(ROOT / "sample_runs" / request.param, run)
    return run


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def test_the_run_lists_the_tokenizer_files_it_holds(fresh: Path) -> None:
    manifest = json.loads((fresh / "run.json").read_text())
    kept = manifest["tokenizer_snapshot"]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(kept)
    assert all((fresh / name).is_file() for name in kept)
    assert "Apache License" in (fresh / "TOKENIZER_LICENSE").read_text()


def test_the_run_renders_its_exported_records_to_the_recorded_prompts(fresh: Path, tmp_path: Path) -> None:
    """``messages`` up to the first assistant turn, with ``tools``, through the run's own chat
    template: the first model call's prompt ids, for at least 95% of the records. verl renders each
    prompt once, from the dataset's messages and the tool schemas, with no per-sample template
    options, so here every record comes back; a record that did not would be a tokenizer or template
    other than the one that rendered the run."""
    out = tmp_path / "records.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "export", str(fresh), "--token-ids", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == json.loads((fresh / "run.json").read_text())["trajectories"]
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fresh)
    same, other = 0, []
    for rec in records:
        if first_prompt_ids(tok, rec) == rec["prompt_ids"]:
            same += 1
        else:
            other.append(rec["id"])
    assert same / len(records) >= 0.95, other[:5]
    assert other == []  # see the docstring: none is expected to differ


def test_the_records_decode_from_the_run_alone(fresh: Path, tmp_path: Path) -> None:
    """The text comes from the run's tokenizer: a tool call and an answer in every record's turns."""
    out = tmp_path / "records.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "export", str(fresh), "--train", "--limit", "8", "-o", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for rec in map(json.loads, out.read_text().splitlines()):
        calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
        assert calls and all(c["function"]["name"] == "calculator" for c in calls)
        assert rec["messages"][1]["role"] == "user" and rec["messages"][1]["content"]
