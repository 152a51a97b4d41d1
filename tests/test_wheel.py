"""The package as pip installs it from a wheel: built from the sources (``pip wheel``), installed
non-editable in a fresh virtual environment, every command run from there, in a folder outside the
source tree. The fresh environment sees the dev venv's packages (the dependencies) through a ``.pth``
line: a path a ``.pth`` adds is not a site folder, so the dev venv's editable install of rlreplay
(its own ``.pth`` finder) stays out."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rlreplay.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> where its files go in the installed namespace (CONTRIBUTING.md, "Layout").
INSTALLED_AS = {
    "rlreplay": "rlreplay",
    "cli": "rlreplay/cli",
    "recorders": "rlreplay/recorders",
    "uploaders": "rlreplay/uploaders",
}
SHOWCASE = "verl-arith-smollm2"  # the shipped run with per-token trainer log-probs


def _source_files() -> set[str]:
    """Every file the package folders hold (code and data), named as installed."""
    names = set()
    for folder, installed in INSTALLED_AS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                names.add(f"{installed}/{path.relative_to(ROOT / folder).as_posix()}")
    return names


class Installed:
    def __init__(self, wheel: Path, venv: Path, cwd: Path) -> None:
        self.wheel, self.venv, self.cwd = wheel, venv, cwd
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLREPLAY_DIR")}

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / "rlreplay"), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, code: str) -> str:
        proc = subprocess.run(
            [str(self.venv / "bin" / "python"), "-c", code],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in INSTALLED_AS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", base / "dist", source], check=True
    )
    (wheel,) = (base / "dist").glob("rlreplay-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run(
        [*pip, "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", wheel], check=True
    )
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "dev-venv-packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    cwd = base / "work"
    cwd.mkdir()
    shutil.copytree(ROOT / "sample_runs" / SHOWCASE, cwd / SHOWCASE)  # reading may index the run
    return Installed(wheel, venv, cwd)


def test_the_wheel_holds_every_package_and_data_file(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        declared = wheel.read(entry_points).decode()
    assert _source_files() - names == set()
    assert "rlreplay/mismatch/__init__.py" in names
    assert "proxy = rlreplay.proxy.adapter:ProxyAdapter" in declared


def test_the_installed_package_is_the_wheel_not_the_sources(installed: Installed) -> None:
    files = installed.python(
        "import rlreplay, rlreplay.cli, rlreplay.recorders, rlreplay.uploaders, rlreplay.mismatch\n"
        "for m in (rlreplay, rlreplay.cli, rlreplay.recorders, rlreplay.uploaders, rlreplay.mismatch):\n"
        "    print(m.__file__)"
    ).split()
    assert len(files) == 5
    assert all(Path(f).is_relative_to(installed.venv) for f in files), files


def test_every_built_in_plug_in_loads_from_the_entry_points(installed: Installed) -> None:
    """The one registration path: the wheel's entry points name every adapter, uploader and check,
    and each imports from the installed package."""
    out = installed.python(
        "from rlreplay import plugins\n"
        "for kind in ('adapters', 'uploaders', 'checks'):\n"
        "    for name, spec in sorted(plugins.specs(kind).items()):\n"
        "        if kind != 'uploaders':\n"
        "            plugins.load(spec)  # uploaders import their service's optional package\n"
        "        print(kind, name)"
    )
    found = set(out.splitlines())
    assert {"adapters generic", "adapters verl", "adapters proxy"} <= found
    assert {"uploaders mlflow", "uploaders weave", "uploaders otlp", "uploaders trackio"} <= found
    assert {"checks mismatch", "checks garbled", "checks group_collapse"} <= found


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_helps_from_the_wheel(installed: Installed, command: str) -> None:
    proc = installed.run(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"rlreplay {command}" in proc.stdout


def test_reading_commands_read_a_shipped_run_from_the_wheel(installed: Installed) -> None:
    run = SHOWCASE
    listing = installed.run("ls", run, "--json")
    assert listing.returncode == 0, listing.stderr
    first_id = re.search(r'"id":\s*"([0-9a-f]+)"', listing.stdout).group(1)
    for args in (
        ("show", first_id, "--run", run),
        ("info", run),
        ("stats", run),
        ("audit", run),
        ("mismatch", run),
        ("sql", "--run", run, "SELECT count(*) AS n FROM trajectories"),
        ("export", run, "--out", "out.jsonl"),
        ("diff", run, first_id, "--group"),
    ):
        proc = installed.run(*args)
        assert proc.returncode == (1 if args[0] == "audit" else 0), (args, proc.stderr)  # 1: findings
        assert proc.stdout or args[0] == "export", args
    assert (installed.cwd / "out.jsonl").stat().st_size > 0


def test_the_ui_serves_its_pages_from_the_wheel(installed: Installed) -> None:
    proc = subprocess.Popen(
        [str(installed.venv / "bin" / "rlreplay"), "ui", SHOWCASE, "--port", "0"],
        cwd=installed.cwd,
        env=installed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/", proc.stdout.readline()).group(0)
        with urllib.request.urlopen(url, timeout=60) as front:
            overview = front.geturl()  # the one run's overview
            assert front.status == 200 and "/r/" in overview
        for page in ("mismatch", "findings", "trajectories"):
            with urllib.request.urlopen(overview + page, timeout=120) as reply:
                assert reply.status == 200, page
        with urllib.request.urlopen(url + "static/style.css", timeout=60) as css:
            assert css.read() == (ROOT / "rlreplay/ui/static/style.css").read_bytes()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
