"""`rlreplay upload --backend trackio` into Trackio's real local store (TRACKIO_DIR in a temp dir).

Trackio reads TRACKIO_DIR when it is imported, so the uploads and the read-backs (with
Trackio's own ``SQLiteStorage.get_traces`` / ``get_logs``) run in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import qwen_tokenizer_dir, rlreplay_proc

import rlreplay
from rlreplay.uploaders.base import LEDGER_DIR
from rlreplay.uploaders.trackio import trace_key

PROJECT = "rl-trackio"

READ_BACK = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project, run = sys.argv[1], sys.argv[2]
traces = SQLiteStorage.get_traces(project, run=run)
logs = SQLiteStorage.get_logs(project, run)
print(json.dumps({"runs": SQLiteStorage.get_runs(project), "traces": traces, "logs": logs}, default=str))
"""


def cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return rlreplay_proc("upload", *args, env={"TRACKIO_DIR": str(store)})


def read_back(store: Path, run_name: str) -> dict[str, Any]:
    env = {**os.environ, "TRACKIO_DIR": str(store)}
    done = subprocess.run(
        [sys.executable, "-c", READ_BACK, PROJECT, run_name],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def traced_spans(run_dir: Path, ids: list[str]) -> dict[tuple[str, str], Any]:
    run = rlreplay.open_run(run_dir)
    return {
        (t.id, s.span_id): (t, s)
        for t in run.load(ids)
        for s in t.spans
        if s.kind not in ("trajectory", "signals")
    }


def test_trackio_store_holds_verls_traces_and_step_stats(run_copy: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    store = tmp_path / "trackio"
    args = [str(run_copy), "--backend", "trackio", "--project", PROJECT, "--max-samples", "2", "--json"]
    dry = cli(store, *args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert not store.exists() or not any(store.glob("*.db"))  # a dry run writes nothing

    done = cli(store, *args)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (
        summary["sent"] == planned["to_send"] == len(planned["ids"]) and summary["bytes"] == planned["bytes"]
    )

    run = rlreplay.open_run(run_copy)
    got = read_back(store, run.experiment)
    assert got["runs"] == [run.experiment]
    expected = traced_spans(run_copy, planned["ids"])
    by_span = Counter((t["metadata"]["trajectory_id"], t["metadata"]["span_id"]) for t in got["traces"])
    assert by_span == Counter(dict.fromkeys(expected, 1))  # every traced op once
    # what arrived weighs what --dry-run said (the traces' JSON, as prepared)
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))
    saw_llm = saw_agent = False
    for trace in got["traces"]:
        traj, span = expected[(trace["metadata"]["trajectory_id"], trace["metadata"]["span_id"])]
        meta = trace["metadata"]
        assert trace["key"] == trace_key(span.name) and trace["step"] == traj.step
        assert (meta["op"], meta["backend"], meta["experiment_name"]) == (
            span.name,
            "trackio",
            traj.experiment,
        )
        assert (meta["sample_index"], meta["rollout_n"], meta["validate"]) == (
            traj.sample_index,
            traj.rollout_n,
            traj.validate,
        )
        assert meta["status"] == ("error" if span.status == "error" else "success")
        messages = trace["messages"]
        if span.kind == "llm":  # verl's rule: system line, inputs as JSON, then response_text
            assert messages[0] == {"role": "system", "content": f"verl rollout trace operation: {span.name}"}
            assert json.loads(messages[1]["content"])["inputs"]["prompt_ids"] == span.inputs["prompt_ids"]
            assert messages[-1] == {
                "role": "assistant",
                "content": tok.decode(span.output["token_ids"], skip_special_tokens=False),
            }
            saw_llm = True
        if span.kind == "agent" and span.status != "error":  # the whole conversation, decoded
            # (decoded text, with or without the chat template's markers)
            roles = [m["role"] for m in messages]
            assert "user" in roles and roles.count("assistant") == len(
                [s for s in traj.spans if s.kind == "llm"]
            )
            response = tok.decode(span.output["response_ids"], skip_special_tokens=False)
            after = messages[roles.index("assistant") :]
            assert all(m["content"].strip() in response for m in after)
            assert after[-1]["content"].strip() and response.rstrip().endswith(after[-1]["content"].strip())
            saw_agent = True
    assert saw_llm and saw_agent

    # per-step statistics, computed here from the listing
    listing = run.trajectories().to_pylist()
    stats = {
        (log["step"], k.split("/")[1]): log for log in got["logs"] for k in log if k.startswith("rollout/")
    }
    for (step, split), log in stats.items():
        rows = [r for r in listing if r["step"] == step and bool(r["validate"]) == (split == "val")]
        rewards = [r["reward"] for r in rows if r["reward"] is not None]
        assert log[f"rollout/{split}/trajectories"] == len(rows)
        assert log[f"rollout/{split}/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert {step for step, _ in stats} == {r["step"] for r in listing}

    again = cli(store, *args)
    assert json.loads(again.stdout)["sent"] == 0
    assert len(read_back(store, run.experiment)["traces"]) == len(expected)


def test_trackio_killed_mid_upload_resumes_with_nothing_lost_or_twice(run_copy: Path, tmp_path: Path) -> None:
    store = tmp_path / "trackio"
    args = [str(run_copy), "--backend", "trackio", "--project", PROJECT, "--max-samples", "2"]
    env = {**os.environ, "TRACKIO_DIR": str(store)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "upload", *args, "--batch-size", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def ledger() -> int:
        return sum(
            path.read_text().count('"trajectory_id"')
            for path in (run_copy / LEDGER_DIR).glob("trackio-*.jsonl")
        )

    deadline = time.monotonic() + 120
    while ledger() < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    done = ledger()

    resumed = cli(store, *args, "--json")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert 3 <= done < summary["selected"] and summary["already_uploaded"] == done
    assert summary["sent"] == summary["selected"] - done
    run = rlreplay.open_run(run_copy)
    ids = run.trajectories()["id"].to_pylist()
    ledger_ids = set()
    for path in (run_copy / LEDGER_DIR).glob("trackio-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            ledger_ids.add(entry.get("trajectory_id"))
    ledger_ids.discard(None)
    assert ledger_ids <= set(ids) and len(ledger_ids) == summary["selected"]
    got = read_back(store, run.experiment)
    by_span = Counter((t["metadata"]["trajectory_id"], t["metadata"]["span_id"]) for t in got["traces"])
    assert by_span == Counter(dict.fromkeys(traced_spans(run_copy, sorted(ledger_ids)), 1))
