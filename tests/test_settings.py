"""``rlreplay.settings`` declares every ``RLREPLAY_*`` variable once; nothing else reads one by name; a
bad value is one line naming it (exit 2 in the CLI), and never an exception in the recording process."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import rlreplay_proc

from rlreplay import settings
from rlreplay.errors import RlreplayError, SettingError

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("rlreplay", "cli", "recorders", "uploaders")
NAME = re.compile(r"RLREPLAY_[A-Z0-9_]+")


def _product_files() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))]


def test_every_setting_is_declared_with_type_default_and_doc() -> None:
    assert len(settings.SETTINGS) >= 20
    for name, setting in settings.SETTINGS.items():
        assert name == setting.name and name.startswith(settings.PREFIX)
        assert setting.type and setting.doc.endswith(".")
    names = [s.name for s in vars(settings).values() if isinstance(s, settings.Setting)]
    assert len(names) == len(set(names)), "a variable declared twice"


def test_no_variable_is_read_or_named_outside_the_settings_module() -> None:
    """Every RLREPLAY_ name the code mentions is declared; none is a string of its own (a lookup by
    name, or a second declaration) outside rlreplay/settings.py."""
    mentioned: set[str] = set()
    by_name: list[str] = []
    for path in _product_files():
        text = path.read_text()
        mentioned |= set(NAME.findall(text))
        if path == ROOT / "rlreplay" / "settings.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                by_name.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
            if isinstance(node, ast.JoinedStr) and any(
                isinstance(v, ast.Constant) and str(v.value).endswith("RLREPLAY_") for v in node.values
            ):
                by_name.append(f"{path.relative_to(ROOT)}:{node.lineno}: a name built with an f-string")
    assert not by_name, by_name
    assert mentioned - {settings.PREFIX} <= set(settings.SETTINGS), mentioned - set(settings.SETTINGS)


def test_a_bad_value_is_one_line_naming_the_variable_and_exit_2() -> None:
    done = rlreplay_proc(
        "ls", "--run", "sample_runs/gsm8k-grpo-qwen3", cwd=ROOT, env={"RLREPLAY_LEASE_TTL_S": "soon"}
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("rlreplay: error: $RLREPLAY_LEASE_TTL_S='soon'")


RECORD = """
import asyncio, sys
import rlreplay

rlreplay.init(sys.argv[1])


@rlreplay.trace_op(kind="llm")
async def generate(prompt_ids):
    return {"token_ids": [1, 2, 3]}


async def main():
    async with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
        await generate([4, 5])
    async with rlreplay.trajectory(step=0, sample_index=1, rollout_n=0):
        await generate([6])


asyncio.run(main())
rlreplay.close()
print(len(rlreplay.open_run(sys.argv[1]).trajectories()))
"""


def test_the_recorder_warns_once_and_records_with_the_default(tmp_path: Path) -> None:
    bad = {"RLREPLAY_MAX_QUEUE_MB": "lots", "RLREPLAY_POLICY": "keep", "RLREPLAY_PUBLISH_INTERVAL_S": "-1"}
    done = subprocess.run(
        [sys.executable, "-c", RECORD, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env={**os.environ, **bad},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    # the queue and policy are read as recording starts; the publish interval only for a URI run
    assert len(warned) == 2 and "$RLREPLAY_MAX_QUEUE_MB='lots'" in warned[0] + warned[1]
    assert any("$RLREPLAY_POLICY='keep'" in line and "'spill'" in line for line in warned)
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest  # the run is whole


@given(st.text(max_size=8))
def test_a_flag_is_true_false_or_bad(text: str) -> None:
    flag = settings.Setting("RLREPLAY_TEST_FLAG", "flag", False, "A flag.", settings.TOKEN_SIGNALS.parse)
    env = {flag.name: text}
    low = text.strip().lower()
    if not text:
        assert flag.get(env) is False  # unset or empty: the default
    elif low in settings.TRUE or low in settings.FALSE:
        assert flag.get(env) is (low in settings.TRUE)
    else:
        with pytest.raises(SettingError, match=r"\$RLREPLAY_TEST_FLAG="):
            flag.get(env)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=6)))
def test_seconds_are_positive_finite_numbers(text: str) -> None:
    env = {settings.LEASE_TTL_S.name: text}
    try:
        expected = float(text)
    except ValueError:
        expected = None
    if not text:
        assert settings.LEASE_TTL_S.get(env) == settings.LEASE_TTL_S.default
    elif expected is not None and 0 < expected < float("inf"):
        assert settings.LEASE_TTL_S.get(env) == expected
    else:
        with pytest.raises(SettingError) as caught:
            settings.LEASE_TTL_S.get(env)
        assert isinstance(caught.value, RlreplayError) and "\n" not in str(caught.value)
