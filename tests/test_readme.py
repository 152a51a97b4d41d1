"""Every code block of README.md and sample_runs/README.md runs as documented, in the venv the
README's first command makes.

bash blocks run in a shell with this venv first on PATH (and as ``.venv``), python blocks in a child
Python; both in a scratch folder holding a copy of the shipped sample runs, so nothing they write
lands in the repository (checked). The first command installs ``.[EXTRAS]``; a block may add an
extra with ``pip install -e '.[EXTRA]'``. Every installed distribution outside what those extras
pull in is made unimportable in the blocks' processes (``blocked_imports/sitecustomize.py``), so
an example that needs an extra the README did not install fails here as it would for a user.
A block is skipped only when the line before it is ``<!-- not-run: reason -->`` (templates,
installs, uploads to a service) or the CI's ``<!-- test-command -->`` (this suite itself).
The guide (the README up to ``# Reference``) stays short, and its examples show the training
signals.
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
FIRST_EXTRAS = re.compile(r"pip install -e \"\.\[([a-z,]+)\]\"")
EXTRA_INSTALL = re.compile(r"^pip install -e '\.\[([a-z,]+)\]'.*\n", re.M)
BLOCKER = Path(__file__).resolve().parent / "blocked_imports"
#: The sample run the guide's examples use (the one place to change when the guide switches runs).
GUIDE_RUN = "verl-arith-smollm2"
GUIDE_MAX_WORDS = 1500
#: In the guide, what a command's output must show: the training signals.
SIGNALS_SHOWN = {
    "rlreplay ls": ("reward", "advantage", "logprob_diff_max", "importance_ratio"),
    "rlreplay show": ("reward=", "advantage=", "logprob_diff_max=", "importance_ratio="),
    "--group": ("reward", "advantage", "logprob_diff_max", "importance_ratio"),
    "rlreplay stats": ("reward_mean", "advantage_std", "logprob_diff_p95", "importance_ratio_p5"),
}


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    skip: str | None
    guide: bool = False

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    out: list[Block] = []
    lines = doc.read_text().splitlines()
    before = ""
    i = 0
    guide = doc.name == "README.md" and doc.parent == ROOT
    while i < len(lines):
        if lines[i].startswith("# Reference"):
            guide = False
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
            Block(
                doc, start + 1, m.group(1), "\n".join(body) + "\n", marker.group(1) if marker else None, guide
            )
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


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _own_requires() -> list[str]:
    """rlreplay's requirements as pyproject.toml declares them now (installed metadata can be stale)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        out += [f'{r}; extra == "{extra}"' for r in reqs]
    return out


def installed_by(extras: set[str]) -> set[str]:
    """The distributions ``pip install -e '.[EXTRAS]'`` puts in a venv (as installed here)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [("rlreplay", frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        if (_canonical(name), wanted) in seen:
            continue
        seen.add((_canonical(name), wanted))
        try:
            requires = (
                _own_requires() if _canonical(name) == "rlreplay" else distribution(name).requires or []
            )
        except PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen} | {"pip", "setuptools", "wheel"}


def blocked_modules(extras: set[str]) -> list[str]:
    """Top-level modules of the installed distributions that ``.[EXTRAS]`` does not install."""
    from importlib.metadata import packages_distributions

    allowed = installed_by(extras)
    return sorted(
        module
        for module, dists in packages_distributions().items()
        if not any(_canonical(d) in allowed for d in dists) and module.isidentifier()
    )


FIRST = next(b for b in ALL if b.lang == "bash" and INSTALL_PREFIX.search(b.code))
FIRST_INSTALL = set(FIRST_EXTRAS.search(FIRST.code).group(1).split(","))


def test_the_first_command_installs_what_the_readme_needs() -> None:
    assert FIRST.doc.name == "README.md" and FIRST.guide and ALL[0] == FIRST
    needed = {"query", "ui", "plot", "text"}  # --where/stats/sql, ui, stats --plot, show's text
    assert {_canonical(d) for d in installed_by(needed)} <= {
        _canonical(d) for d in installed_by(FIRST_INSTALL)
    }


def test_the_guide_is_short_activates_the_venv_and_uses_one_sample_run() -> None:
    text = (ROOT / "README.md").read_text()
    assert "\n# Reference" in text
    guide = text.split("\n# Reference")[0]
    assert len(guide.split()) <= GUIDE_MAX_WORDS, len(guide.split())
    guide_blocks = [b for b in ALL if b.guide and b.lang == "bash" and not b.skip]
    assert any(
        line.strip().startswith("source .venv/bin/activate")
        for b in guide_blocks
        for line in b.code.splitlines()
    )
    runs = set(re.findall(r"sample_runs/([A-Za-z0-9_.-]+)", " ".join(b.code for b in guide_blocks)))
    assert runs == {GUIDE_RUN}, runs
    for command in SIGNALS_SHOWN:
        assert any(command in b.code for b in guide_blocks), command


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(ROOT / "sample_runs", tmp_path / "sample_runs", ignore=shutil.ignore_patterns("*.py"))
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    monkeypatch.chdir(tmp_path)
    for name in ("RLREPLAY_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _repository_state() -> str:
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in RUNNABLE and not b.skip], ids=lambda b: b.name)
def test_block_runs(block: Block, scratch: Path) -> None:
    code = INSTALL_PREFIX.sub("", block.code)  # this venv already holds what the install step adds
    extras = set(FIRST_INSTALL)
    for added in EXTRA_INSTALL.findall(code):
        extras |= set(added.split(","))
    code = EXTRA_INSTALL.sub("", code)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(BLOCKER), os.environ.get("PYTHONPATH")) if p),
        "RLREPLAY_README_BLOCKED": ",".join(blocked_modules(extras)),
    }
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    before = _repository_state()
    proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert _repository_state() == before, f"{block.name} wrote into the repository"
    shipped = ROOT / "sample_runs"
    for run in (
        "gsm8k-grpo-qwen3",
        "verl-toolagent-smollm2",
        "verl-arith-smollm2",
    ):  # the copies were not changed either
        assert sorted(p.name for p in (scratch / "sample_runs" / run).iterdir()) == sorted(
            p.name for p in (shipped / run).iterdir()
        )
    if block.guide:
        for command, shown in SIGNALS_SHOWN.items():
            if command in code:
                assert all(word in proc.stdout for word in shown), (command, shown, proc.stdout[:3000])


def test_the_blocker_blocks() -> None:
    """A module outside the first command's extras cannot be imported in the blocks' processes."""
    blocked = blocked_modules(FIRST_INSTALL)
    assert "mlflow" in blocked and "duckdb" not in blocked and "pyarrow" not in blocked
    env = {**os.environ, "PYTHONPATH": str(BLOCKER), "RLREPLAY_README_BLOCKED": ",".join(blocked)}
    proc = subprocess.run(
        [sys.executable, "-c", "import mlflow"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
