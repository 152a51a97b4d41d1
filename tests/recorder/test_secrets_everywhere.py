"""A secret in any position of a recorded job — its command line, its environment, a traced call's
inputs, outputs, attributes or exception, a failing reducer — never reaches a span file, the
manifest, the counters, an upload ledger, the log, or what the reading commands print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq

from rlreplay.cli.main import main

#: One secret per position, so that a leak says where it came from.
SECRETS = {
    "argv_pass": "Zq9argvPass4f1d2c3b",
    "argv_url": "Zq9urlUserinfo77aa",
    "env": "Zq9envValue1234abcd",
    "pgpassword": "Zq9pgPassword9911",
    "input_cookie": "Zq9cookieSess0042",
    "input_kwarg": "Zq9kwargDbPass5511",
    "output_github": "ghp_Zq9outputGithubKey00000000000000000",
    "output_aws": "AKIAZQ9OUTPUTAWS1234",
    "output_openai": "sk-Zq9outputOpenAiKey0000",
    "output_hf": "hf_Zq9outputHuggingFace00",
    "output_slack": "xoxb-1234567890-Zq9outputSlack",
    "output_jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJacTlqd3QifQ.Zq9jwtSignature00",
    "attribute": "Zq9attributeBearer9900",
    "error": "Zq9errorPassword3300",
    "error_url": "Zq9errorUrlPw4400",
    "reducer": "ghp_Zq9reducerMessage0000000000000000000",
}

JOB = textwrap.dedent(
    """
    import os, sys
    import rlreplay

    S = {secrets!r}

    @rlreplay.trace_op(kind="tool")
    def run_shell(command, db_pass=None):
        env_line = "DB password is " + os.environ["MY_DB_PASSWORD"]
        return {{
            "stdout": "\\n".join([
                "export GITHUB_TOKEN=" + S["output_github"],
                "aws " + S["output_aws"],
                "key " + S["output_openai"] + " and " + S["output_hf"],
                "slack " + S["output_slack"] + " jwt " + S["output_jwt"],
                env_line,
                "PGPASSWORD=" + os.environ["PGPASSWORD"] + " psql",
            ]),
            "ok": True,
        }}

    @rlreplay.trace_op(kind="llm")
    def generate(prompt_ids, headers):
        return {{"token_ids": [t + 1 for t in prompt_ids], "text": "use " + S["output_openai"]}}

    @rlreplay.trace_op(kind="tool")
    def connect(url):
        raise ConnectionError("login failed with password=" + S["error"] + " at " + url)

    def failing_reducer(out):
        raise ValueError("bad " + S["reducer"])

    @rlreplay.trace_op(kind="tool", reduce_output=failing_reducer)
    def reduced():
        return 1

    note = "Authorization: Bearer " + S["attribute"]
    with rlreplay.trajectory(step=1, sample_index=0, rollout_n=0, note=note):
        run_shell("env", db_pass=S["input_kwarg"])
        generate(list(range(80)), headers={{"Cookie": "session=" + S["input_cookie"] + "; theme=dark"}})
        try:
            connect("postgres://app:" + S["error_url"] + "@db.internal/prod")
        except ConnectionError:
            pass
        reduced()
    print("JOB DONE", sys.argv[1:] != [])
    """
)


def _run_files_text(run: Path) -> str:
    """Every text a run holds: the string columns of its Parquet files, the bytes of the others."""
    parts = []
    for path in sorted(run.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix in (".parquet", ".index"):
            table = pq.read_table(path)
            for name in table.column_names:
                if str(table.schema.field(name).type) in ("string", "large_string"):
                    parts += [v for v in table[name].to_pylist() if v]
        else:
            parts.append(path.read_bytes().decode("latin-1"))
    return "\n".join(parts)


def test_no_secret_reaches_a_file_a_log_or_the_output(tmp_path: Path, capsys) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB.format(secrets=SECRETS))
    run = tmp_path / "run"
    env = {
        **os.environ,
        "MY_DB_PASSWORD": SECRETS["env"],
        "PGPASSWORD": SECRETS["pgpassword"],
        "RLREPLAY_DIR": "",
    }
    argv = [
        sys.executable,
        "-m",
        "rlreplay",
        "record",
        "--out",
        str(run),
        "--",
        sys.executable,
        str(job),
        "--db-pass",
        SECRETS["argv_pass"],
        f"https://bob:{SECRETS['argv_url']}@git.example/x?api_key=q{SECRETS['argv_url'][::-1]}",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0 and "JOB DONE True" in proc.stdout, proc.stdout + proc.stderr
    logged = proc.stdout + proc.stderr
    assert "reduce_output" in logged  # the failing reducer was warned about

    stored = _run_files_text(run)
    assert "PGPASSWORD=" in stored and "login failed" in stored  # the positions were recorded
    # what the reading commands print
    printed = []
    for args in (
        ["ls", str(run), "--json"],
        ["info", str(run), "--json"],
        ["sql", str(run), "SELECT * FROM spans"],
    ):
        assert main(args) == 0
        printed.append(capsys.readouterr().out)
    traj = json.loads(printed[0].splitlines()[0])["id"]
    assert main(["show", str(run), traj, "--json", "--no-text"]) == 0
    printed.append(capsys.readouterr().out)

    # an upload ledger for a target whose address holds a password
    from rlreplay.uploaders.base import Ledger

    Ledger.open(run, "weave", f"weave:https://u:{SECRETS['argv_url']}@trace.example#team/p")
    ledgers = "\n".join(p.read_text() for p in (run / "_uploads").glob("*"))

    everything = {"files": stored, "log": logged, "printed": "\n".join(printed), "ledger": ledgers}
    leaks = {
        (position, where)
        for position, secret in SECRETS.items()
        for where, text in everything.items()
        if secret in text or secret[-12:] in text
    }
    assert sorted(leaks) == [], "\n".join(f"{p} in {w}" for p, w in sorted(leaks))
