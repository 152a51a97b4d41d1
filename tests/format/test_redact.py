"""Redaction by rule: secret names, URL user info, auth headers, key-shaped values, the short
password flag and the values of secret environment variables, in argv, manifests and mappings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlreplay.format import manifest
from rlreplay.format.redact import REDACTED, redact_argv, redact_mapping, redact_url, redact_value

SECRET = "s3cr3t-Value-9f8e7d"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--key", SECRET], ["--key", REDACTED]),
        ([f"wandb_key={SECRET}"], [f"wandb_key={REDACTED}"]),
        (["--github-pat", SECRET], ["--github-pat", REDACTED]),
        ([f"https://user:{SECRET}@example.com/repo.git"], [f"https://{REDACTED}@example.com/repo.git"]),
        (["-H", f"Authorization: Bearer {SECRET}"], ["-H", f"Authorization: {REDACTED}"]),
        ([f"KEY:{SECRET}"], [f"KEY:{REDACTED}"]),
        (["mysql", "-u", "root", "-p", SECRET], ["mysql", "-u", "root", "-p", REDACTED]),
        (["/usr/bin/mysqldump", f"-p{SECRET}", "db"], ["/usr/bin/mysqldump", f"-p{REDACTED}", "db"]),
        (["docker", "login", "-u", "bob", "-p", SECRET], ["docker", "login", "-u", "bob", "-p", REDACTED]),
        (["--api-key", SECRET], ["--api-key", REDACTED]),
        ([f"--token={SECRET}"], [f"--token={REDACTED}"]),
        ([f"WANDB_API_KEY={SECRET}"], [f"WANDB_API_KEY={REDACTED}"]),
        (["--password", SECRET, "--next"], ["--password", REDACTED, "--next"]),
        ([f"--clientSecret={SECRET}"], [f"--clientSecret={REDACTED}"]),
        ([f"X-Auth-Token:{SECRET}"], [f"X-Auth-Token:{REDACTED}"]),
        ([f"--db-credentials={SECRET}"], [f"--db-credentials={REDACTED}"]),
        ([f"MLFLOW_TRACKING_PASSWORD={SECRET}"], [f"MLFLOW_TRACKING_PASSWORD={REDACTED}"]),
        (
            [f"--url=http://127.0.0.1:5000/?api_token={SECRET}&x=1"],
            [f"--url=http://127.0.0.1:5000/?api_token={REDACTED}&x=1"],
        ),
        (["--flag", f"header=Basic {SECRET}"], ["--flag", f"header=Basic {REDACTED}"]),
        (["--token", "--verbose"], ["--token", "--verbose"]),  # a flag is not the token's value
        ([f'+x.extra={{"api_key": "{SECRET}", "n": 1}}'], ['+x.extra={"api_key": "***", "n": 1}']),
        ([f"cfg={{'token': '{SECRET}'}}"], ["cfg={'token': '***'}"]),
    ],
)
def test_each_form_is_redacted(argv: list[str], expected: list[str]) -> None:
    assert redact_argv(argv) == expected
    assert SECRET not in " ".join(redact_argv(argv))


def test_secret_shaped_values_and_environment_values(monkeypatch: pytest.MonkeyPatch) -> None:
    shaped = [
        "sk-" + "a" * 24,
        "hf_" + "b" * 20,
        "ghp_" + "c" * 24,
        "github_pat_" + "d" * 30,
        "xoxb-" + "1234567890-abc",
        "AKIA" + "ABCDEFGHIJKLMNOP",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NSJ9.c2lnbmF0dXJlc2ln",
        "0123456789abcdef0123456789abcdef01234567",
    ]
    for value in shaped:
        assert redact_value(f"run --opt {value} done") == f"run --opt {REDACTED} done", value
    # a 40-hex inside a path is a commit of a cached model, not a key
    snapshot = "/cache/models--Qwen/snapshots/0123456789abcdef0123456789abcdef01234567/tokenizer.json"
    assert redact_value(snapshot) == snapshot
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    monkeypatch.setenv("PWD", "/home/user/project")  # not a secret name: left alone
    assert redact_argv(["train.py", f"--opt={SECRET}x", "/home/user/project"]) == [
        "train.py",
        f"--opt={REDACTED}x",
        "/home/user/project",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-m", "pytest", "-p", "no:cacheprovider", "-q"],
        ["pytest", "-pno:cacheprovider", "-x"],
        ["pytest", "-n", "4", "-k", "not slow and test_redact", "-o", "key=value"],
        ["pytest", "-o", "cache_dir=/tmp/cache", "-W", "error::DeprecationWarning"],
        ["python", "train.py", "--lr", "1e-5", "trainer.total_epochs=3", "-v"],
        ["torchrun", "--nproc-per-node", "8", "-m", "verl.trainer.main_ppo", "data.max_prompt_length=1024"],
        ["ssh", "-p", "2222", "-i", "~/.ssh/id_ed25519", "gpu-node"],
        ["psql", "-h", "db", "-p", "5432", "-U", "bob"],
        ["mkdir", "-p", "/ckpt/run1"],
    ],
)
def test_ordinary_command_lines_stay_readable(argv: list[str]) -> None:
    assert redact_argv(argv) == argv


def test_ordinary_names_are_kept() -> None:
    argv = [
        "data.prompt_key=prompt",
        "data.image_key=images",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.model.tokenizer_path=Qwen/Qwen3-0.6B",
        "max_tokens=5",
        "trainer.default_local_dir=/ckpt/path",
        "--tool-config-path=tools.yaml",
        "https://huggingface.co/Qwen/Qwen3-0.6B",
        "key_value_cache=1",
    ]
    assert redact_argv(argv) == argv


def test_mappings_hide_secret_names_at_any_depth() -> None:
    kwargs = {
        "api_key": SECRET,
        "headers": {"Authorization": f"Bearer {SECRET}", "Accept": "json"},
        "base_url": f"https://bob:{SECRET}@api.example.com/v1",
        "messages": [{"role": "user", "content": "my key is in the text"}],
        "prompt_ids": [1, 2, 3],
        "max_tokens": 16,
        "bytes_per_token": 1.5,  # a number is never hidden
        "token": None,
        "key": "p0-s0-i0-r0",  # a keyword argument named just key is a lookup key
    }
    out = redact_mapping(kwargs)
    assert SECRET not in json.dumps(out)
    assert out["api_key"] == REDACTED and out["headers"]["Authorization"] == REDACTED
    assert out["headers"]["Accept"] == "json"
    assert out["base_url"] == f"https://{REDACTED}@api.example.com/v1"
    assert out["messages"] == kwargs["messages"] and out["prompt_ids"] == [1, 2, 3]
    assert (out["max_tokens"], out["bytes_per_token"], out["token"]) == (16, 1.5, None)
    assert out["key"] == "p0-s0-i0-r0"
    assert kwargs["api_key"] == SECRET  # the caller's mapping is not changed


def test_urls_lose_user_info_and_secret_parameters() -> None:
    assert (
        redact_url(f"http://admin:{SECRET}@mlflow.internal:5000") == f"http://{REDACTED}@mlflow.internal:5000"
    )
    assert redact_url(f"https://{SECRET}@host/x") == f"https://{REDACTED}@host/x"
    assert redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact_url(f"s3://bucket/run?access_token={SECRET}") == f"s3://bucket/run?access_token={REDACTED}"


def test_manifest_fields_are_redacted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    manifest.write_json_atomic(
        run / manifest.MANIFEST,
        manifest.new_manifest(
            "exp", ["train.py", "--key", SECRET], tracking_uri=f"http://u:{SECRET}@h", hf_token=SECRET
        ),
    )
    manifest.update_manifest(run, upload_password=SECRET, spans=12)
    text = (run / manifest.MANIFEST).read_text()
    assert SECRET not in text
    data = json.loads(text)
    assert data["command"] == ["train.py", "--key", REDACTED]
    assert data["tracking_uri"] == f"http://{REDACTED}@h" and data["spans"] == 12


def test_mappings_keep_what_needs_no_change_and_survive_odd_values() -> None:
    import collections

    import numpy as np

    cyclic: list = [1, 2]
    cyclic.append(cyclic)
    point = collections.namedtuple("Point", "x y")(1, 2)
    data = {
        "ids": np.arange(4),
        "cycle": cyclic,
        "point": point,
        "names": ("a", "b"),
        "api_key": np.array([1, 2]),  # an array under a secret name is hidden too
        "nested": {"client": {"secret": SECRET}},
    }
    out = redact_mapping(data)
    assert out["ids"] is data["ids"] and out["cycle"] is cyclic and out["point"] is point
    assert out["names"] is data["names"]
    assert out["api_key"] == REDACTED and out["nested"] == {"client": {"secret": REDACTED}}


def test_info_hides_secrets_of_runs_recorded_before_the_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlreplay.cli.main import main

    run = tmp_path / "run"
    data = manifest.new_manifest("exp")
    data["command"] = ["train.py", "--key", SECRET, f"https://u:{SECRET}@host"]  # as an old version wrote it
    manifest.write_json_atomic(run / manifest.MANIFEST, data)
    (run / "spans").mkdir()
    for args in (["info", str(run)], ["info", str(run), "--json"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "train.py --key ***" in out
