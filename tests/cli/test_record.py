"""`rlreplay record -- CMD` on plain Python jobs: activation everywhere, exit codes, signals, secrets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from support import qwen_tokenizer_dir, rlreplay_proc

import rlreplay

JOB = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, rlreplay

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": [x + 1 for x in prompt_ids]}

    def worker(step):
        with rlreplay.trajectory(step=step, sample_index=os.getpid() % 1000, rollout_n=0):
            generate([1, 2, 3])

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")  # fresh interpreters: activated through PYTHONPATH, not inherited state
        procs = [ctx.Process(target=worker, args=(s,)) for s in (1, 2)]
        [p.start() for p in procs]
        [p.join() for p in procs]
        worker(3)
        print("secret-in-env", "WANDB_API_KEY" in os.environ)
        sys.exit(int(sys.argv[1]))
    """
)


def record(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return rlreplay_proc("record", *args, cwd=tmp_path, env=env, timeout=120)


def record_job(
    tmp_path: Path, tokenizer: str, job: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``rlreplay record --out RUN --tokenizer T -- python job.py ARGS``, the job's source written first."""
    (tmp_path / "job.py").write_text(job)
    command = ["--out", str(tmp_path / "run"), "--tokenizer", tokenizer, "--", sys.executable, "job.py"]
    return record(tmp_path, *command, *args, env=env)


def test_record_activates_every_process_and_keeps_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    secret = "sk-" + "a1b2c3d4e5f6g7h8i9j0k1l2"
    out = tmp_path / "run"
    proc = record(
        tmp_path,
        "--out",
        str(out),
        "--experiment-name",
        "exp-rec",
        "--",
        sys.executable,
        str(script),
        "3",
        "-p",
        "no:cacheprovider",
        f"--api-key={secret}",
        env={"WANDB_API_KEY": secret},
    )
    assert proc.returncode == 3, proc.stderr
    assert "secret-in-env True" in proc.stdout  # the job's own environment is untouched
    run = rlreplay.open_run(out)
    rows = run.trajectories().to_pylist()
    assert sorted(r["step"] for r in rows) == [1, 2, 3]
    assert len({r["worker"] for r in rows}) == 3  # driver and two spawned processes
    assert {r["experiment"] for r in rows} == {"exp-rec"}
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["exit_code"] == 3 and manifest["trajectories"] == 3
    # the manifest says what ran: ordinary options readable, secrets hidden
    assert manifest["command"][-3:] == ["-p", "no:cacheprovider", "--api-key=***"]
    for path in out.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in proc.stderr and secret not in proc.stdout
    assert "3 trajectories" in proc.stderr


def test_the_manifest_keeps_the_command_as_given_and_no_folder_of_this_machine(tmp_path: Path) -> None:
    """A run is shared: its manifest holds the command as typed, not the folder it was typed in."""
    work = tmp_path / "home" / "alice" / "project"
    work.mkdir(parents=True)
    (work / "job.py").write_text(JOB)
    proc = record(
        work,
        "--out",
        "run",
        "--",
        "python",
        "job.py",
        "0",
        env={"PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]},
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((work / "run" / "run.json").read_text())
    assert manifest["command"] == ["python", "job.py", "0"]
    for path in (work / "run").rglob("*"):
        if path.is_file() and path.suffix != ".parquet":
            assert str(tmp_path) not in path.read_text(errors="replace"), path


def test_record_forwards_sigterm_and_seals(tmp_path: Path) -> None:
    script = tmp_path / "long.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, sys, time, rlreplay

            @rlreplay.trace_op
            def step_work(i):
                return i

            def on_term(signum, frame):
                print("child got SIGTERM", flush=True)
                sys.exit(143)

            signal.signal(signal.SIGTERM, on_term)
            with rlreplay.trajectory(step=1, sample_index=0, rollout_n=0):
                step_work(1)
            rlreplay.flush()
            print("ready", flush=True)
            time.sleep(60)
            """
        )
    )
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "record", "--out", str(out), "--", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert "child got SIGTERM" in stdout
    assert proc.returncode == 143, stderr
    assert rlreplay.open_run(out).trajectories(step=1).num_rows == 1
    assert not list(out.rglob("*.partial"))


def test_record_refuses_to_overwrite_and_needs_a_command(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    proc = record(tmp_path, "--out", str(out), "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "never overwritten" in proc.stderr
    assert (out / "run.json").read_text() == "{}"
    proc = record(tmp_path, "--out", str(tmp_path / "new"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = record(tmp_path, "--out", str(tmp_path / "new2"), "--", "no-such-program-xyz")
    assert proc.returncode == 2 and "command not found" in proc.stderr


def test_activation_is_light_in_processes_without_verl(tmp_path: Path) -> None:
    """The bootstrap imports no pyarrow/verl/ray into a process that records nothing."""
    from rlreplay.cli.launch import bootstrap_dir

    code = "import sys; print(sorted(m for m in ('pyarrow', 'verl', 'ray', 'torch') if m in sys.modules))"
    env = {**os.environ, "RLREPLAY_DIR": str(tmp_path / "r"), "PYTHONPATH": str(bootstrap_dir())}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == "[]"
    check = "import sys; print(any(type(f).__name__ == 'ImportHook' for f in sys.meta_path))"
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == "True"


LINGERING = textwrap.dedent(
    """
    import os, subprocess, sys, time, rlreplay

    rlreplay.init()  # from $RLREPLAY_DIR, at start, as rlreplay's verl hook does in every worker

    @rlreplay.trace_op
    def work(i):
        return i

    started = __file__ + ".started"
    if len(sys.argv) > 1:  # the lingering process: outlives the driver, then records
        open(started, "w").close()  # its lease is taken: init() ran at import
        time.sleep(2.0)
        with rlreplay.trajectory(step=9, sample_index=1, rollout_n=0):
            work(1)
        sys.exit(0)
    subprocess.Popen([sys.executable, __file__, "linger"], start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    with rlreplay.trajectory(step=9, sample_index=0, rollout_n=0):
        work(0)
    """
)


def test_record_waits_for_processes_that_outlive_the_driver(tmp_path: Path) -> None:
    """Ray actors may still be writing after the driver exits: the summary waits for them."""
    script = tmp_path / "linger.py"
    script.write_text(LINGERING)
    out = tmp_path / "run"
    proc = record(tmp_path, "--out", str(out), "--", sys.executable, str(script))
    assert proc.returncode == 0, proc.stderr
    assert "2 trajectories" in proc.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["trajectories"] == 2
    assert sorted(rlreplay.open_run(out).trajectories()["sample_index"].to_pylist()) == [0, 1]
    assert not list(out.rglob("*.partial")) and not list(out.rglob("_lease-*"))


TOKENIZER_JOB = textwrap.dedent(
    """
    import json, sys, rlreplay
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(sys.argv[1])

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids):
        return {"token_ids": tok.encode("The answer is 42.", add_special_tokens=False).ids}

    with rlreplay.trajectory(step=1, sample_index=0, rollout_n=0):
        generate(tok.encode("What is six times seven?", add_special_tokens=False).ids)
    """
)


def test_record_keeps_the_tokenizer_files_and_readers_use_them_without_the_model_folder(
    tmp_path: Path,
) -> None:
    """The run holds the tokenizer that rendered its prompts (chat template included): it decodes and
    renders on a machine where the folder it was recorded with is gone."""
    model = tmp_path / "model"
    shutil.copytree(qwen_tokenizer_dir(), model)  # tokenizer.json, its config with the chat template, vocab
    (model / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    (model / "chat_template.jinja").write_text("{{ 'x' }}")
    (model / "config.json").write_text("{}")  # a model's file, not the tokenizer's
    expected = {
        name: (model / name).read_bytes()
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        )
    }
    out = tmp_path / "run"
    proc = record_job(tmp_path, str(model), TOKENIZER_JOB, str(model / "tokenizer.json"))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["tokenizer_snapshot"] == sorted(expected)
    for name, data in expected.items():  # byte for byte
        assert (out / name).read_bytes() == data, name
    for name in ("vocab.json", "merges.txt", "config.json"):  # tokenizer.json makes these unneeded
        assert not (out / name).exists(), name
    shutil.rmtree(model)
    moved = tmp_path / "elsewhere" / "run"
    out.rename(moved.parent.mkdir() or moved)  # another machine: only the run folder
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    shown = subprocess.run(
        [sys.executable, "-m", "rlreplay", "show", "-r", str(moved), "step=1,sample_index=0,rollout_n=0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "What is six times seven?" in shown.stdout and "The answer is 42." in shown.stdout
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moved)  # the run folder is a tokenizer folder
    assert tok.decode(tok.encode("What is six times seven?")) == "What is six times seven?"
    assert tok.chat_template == "{{ 'x' }}"  # chat_template.jinja wins over the config's, as it did


def test_record_names_a_tokenizer_it_cannot_find_in_one_line_and_records_anyway(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "run"
    proc = record(
        tmp_path, "--out", str(out), "--tokenizer", "no-such-org/no-such-model", "--",
        sys.executable, "job.py", "0",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "no-such-model" in line]
    assert len(notes) == 1 and "no-such-org/no-such-model" in notes[0], proc.stderr
    assert "Traceback" not in proc.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["tokenizer"] == "no-such-org/no-such-model" and "tokenizer_snapshot" not in manifest
    assert len(rlreplay.open_run(out).trajectories()) == 3


def test_record_keeps_a_cached_hub_tokenizer(tmp_path: Path) -> None:
    """A hub name is taken from the local Hugging Face cache (never downloaded), its files kept."""
    hf = tmp_path / "hf"
    snapshot = hf / "hub" / "models--acme--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (hf / "hub" / "models--acme--tiny" / "refs").mkdir()
    (hf / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_tokenizer_dir() / name, snapshot / name)
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "run"
    proc = record(
        tmp_path, "--out", str(out), "--tokenizer", "acme/tiny", "--", sys.executable, "job.py", "0",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "run.json").read_text())["tokenizer_snapshot"] == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_bytes() == (qwen_tokenizer_dir() / "tokenizer.json").read_bytes()


def test_a_tokenizer_the_job_fetches_is_kept_at_the_end(tmp_path: Path) -> None:
    """A job that brings its tokenizer itself (a hub model it downloads on start): the files are
    copied once the job is done."""
    later = tmp_path / "fetched"
    job = TOKENIZER_JOB.replace(
        "tok = Tokenizer.from_file(sys.argv[1])",
        "import shutil\nshutil.copytree(sys.argv[2], sys.argv[3])\ntok = Tokenizer.from_file(sys.argv[1])",
    )
    out = tmp_path / "run"
    proc = record_job(
        tmp_path,
        str(later),
        job,
        str(qwen_tokenizer_dir() / "tokenizer.json"),
        str(qwen_tokenizer_dir()),
        str(later),
    )
    assert proc.returncode == 0, proc.stderr
    assert "keeps no copy" not in proc.stderr
    assert json.loads((out / "run.json").read_text())["tokenizer_snapshot"] == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
