"""Every code block of README.md and sample_runs/README.md runs as documented.

bash blocks run in a shell with this venv first on PATH (and as ``.venv``), python blocks are
executed in this process; both in a scratch folder holding a copy of the shipped sample runs,
so nothing they write lands in the repository. A block is skipped only when the line before it
is ``<!-- not-run: reason -->`` (templates, installs, uploads to a service) or the CI's
``<!-- test-command -->`` (this suite itself).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "sample_runs" / "README.md"]
FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!-- (not-run: .+|test-command) -->$")
RUNNABLE = {"bash", "python"}
NOT_CODE = {"text", "toml"}
INSTALL_PREFIX = re.compile(r"^python3 -m venv \.venv && (?:\.venv/bin/pip install [^&]*&& )+", re.M)


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    out: list[Block] = []
    lines = doc.read_text().splitlines()
    before = ""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                before = lines[i].strip()
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        marker = SKIP.match(before)
        out.append(
            Block(doc, start + 1, m.group(1), "\n".join(body) + "\n", marker.group(1) if marker else None)
        )
        before = ""
        i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def test_every_block_is_code_with_a_language_and_skips_are_few_and_explained() -> None:
    assert len(ALL) >= 10
    for b in ALL:
        assert b.lang in RUNNABLE | NOT_CODE, f"{b.name}: fence needs a language (bash, python, text or toml)"
    skipped = [b for b in ALL if b.skip]
    assert all(s.skip == "test-command" or len(s.skip) > len("not-run: ") + 10 for s in skipped)
    assert len(skipped) <= 8, [s.name for s in skipped]
    assert len([b for b in ALL if b.lang in RUNNABLE and not b.skip]) >= 7


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(ROOT / "sample_runs", tmp_path / "sample_runs", ignore=shutil.ignore_patterns("*.py"))
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    monkeypatch.chdir(tmp_path)
    for name in ("RLREPLAY_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in RUNNABLE and not b.skip], ids=lambda b: b.name)
def test_block_runs(block: Block, scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if block.lang == "python":
        exec(compile(block.code, block.name, "exec"), {"__name__": "__readme__"})
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    code = INSTALL_PREFIX.sub("", block.code)  # this venv already holds what the install step adds
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{block.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    shipped = ROOT / "sample_runs"
    for run in (
        "gsm8k-grpo-qwen3",
        "verl-toolagent-smollm2",
        "verl-arith-smollm2",
    ):  # the copies were not changed either
        assert sorted(p.name for p in (scratch / "sample_runs" / run).iterdir()) == sorted(
            p.name for p in (shipped / run).iterdir()
        )
