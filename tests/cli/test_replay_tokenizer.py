"""A replay keeps the tokenizer its source run keeps, as ``record --tokenizer`` does: the same files,
byte for byte, copied from the source run (the folder the source was recorded with may be gone),
and the source's name for it in ``run.json``; no warning that the run keeps no copy."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from support import qwen_tokenizer_dir, rlreplay_proc

JOB = Path(__file__).resolve().parents[1] / "replay_job.py"
CONFIG = {"steps": 1, "samples": 2, "rollouts": 2, "seed": 0, "parser": "v1", "spawn": False}


def test_a_replay_keeps_the_source_runs_tokenizer(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(qwen_tokenizer_dir(), tokenizer)
    job = [sys.executable, str(JOB), json.dumps(CONFIG)]
    proc = rlreplay_proc(
        "record",
        "--framework",
        "generic",
        "--tokenizer",
        "tokenizer",
        "--out",
        "src",
        "--",
        *job,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(tokenizer)  # recorded elsewhere: only the source run's copy is left
    source = json.loads((tmp_path / "src" / "run.json").read_text())
    assert source["tokenizer_snapshot"] and source["tokenizer"] == "tokenizer"

    proc = rlreplay_proc("replay", "src", "--out", "rep", "--", *job, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer" not in proc.stderr, proc.stderr  # no warning about it
    replayed = json.loads((tmp_path / "rep" / "run.json").read_text())
    assert replayed["tokenizer_snapshot"] == source["tokenizer_snapshot"]
    assert replayed["tokenizer"] == source["tokenizer"]
    for name in source["tokenizer_snapshot"]:
        assert (tmp_path / "rep" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    shown = rlreplay_proc("show", "--run", "rep", "step=0,sample_index=0,rollout_n=0", cwd=tmp_path)
    assert shown.returncode == 0 and "no tokenizer" not in shown.stderr, shown.stderr


def test_replay_tokenizer_names_the_tokenizer_the_replay_keeps(tmp_path: Path) -> None:
    """``replay --tokenizer`` still wins over the source's copy."""
    job = [sys.executable, str(JOB), json.dumps(CONFIG)]
    assert (
        rlreplay_proc("record", "--framework", "generic", "--out", "src", "--", *job, cwd=tmp_path).returncode
        == 0
    )
    proc = rlreplay_proc(
        "replay", "src", "--out", "rep", "--tokenizer", str(qwen_tokenizer_dir()), "--", *job, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    replayed = json.loads((tmp_path / "rep" / "run.json").read_text())
    assert (
        replayed["tokenizer"] == str(qwen_tokenizer_dir())
        and "tokenizer.json" in replayed["tokenizer_snapshot"]
    )
