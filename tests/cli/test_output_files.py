"""Files rlreplay writes (``export --out``, ``stats --plot``): only a regular file is ever replaced,
``--force`` or not; a named pipe, a device (also through a link) or a link that leads nowhere is
left as it was, and the command says so in one line, exit code 2. A folder that takes no new file
is one line too, before any work."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from rlreplay.cli.main import main

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("outputs") / "run"
    shutil.copytree(SAMPLE, path)
    return path


def _writers(run: Path) -> dict[str, Callable[[Path], list[str]]]:
    return {
        "export": lambda out: ["export", str(run), "--out", str(out), "--step", "1"],
        "stats --plot": lambda out: ["stats", str(run), "--plot", str(out)],
    }


SUFFIX = {"export": ".jsonl", "stats --plot": ".svg"}


def _fifo(path: Path) -> Callable[[], bool]:
    os.mkfifo(path)
    return lambda: stat.S_ISFIFO(path.lstat().st_mode)


def _link_to_device(path: Path) -> Callable[[], bool]:
    path.symlink_to("/dev/null")  # only ever looked at (stat), never opened
    return lambda: path.is_symlink() and os.readlink(path) == "/dev/null"


def _dangling_link(path: Path) -> Callable[[], bool]:
    path.symlink_to(path.with_name("nothing-here"))
    return lambda: path.is_symlink() and not path.with_name("nothing-here").exists()


#: A special file made at a path, and the check that it is still there as it was.
SPECIAL = {"named pipe": _fifo, "link to a device": _link_to_device, "dangling link": _dangling_link}


@pytest.mark.parametrize("writer", sorted(SUFFIX))
@pytest.mark.parametrize("special", sorted(SPECIAL))
@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
def test_only_a_regular_file_is_ever_replaced(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str, special: str, force: bool
) -> None:
    path = tmp_path / f"out{SUFFIX[writer]}"
    unchanged = SPECIAL[special](path)
    argv = _writers(run)[writer](path) + (["--force"] if force else [])
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "not a regular file" in err and "Traceback" not in err, err
    assert unchanged()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing else written beside it


def test_a_regular_file_is_replaced_with_force_and_kept_without(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    assert main(_writers(run)["export"](out)) == 2
    assert "exists; pass --force" in capsys.readouterr().err and out.read_text() == "kept\n"
    assert main([*_writers(run)["export"](out), "--force"]) == 0
    capsys.readouterr()
    assert out.read_text().startswith("{") and sorted(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("writer", ["export", "stats --plot"])
def test_a_folder_that_takes_no_file_is_one_line(
    run: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    out = Path("/proc/rlreplay-output.jsonl" if writer == "export" else "/proc/rlreplay-output.svg")
    rc = main(_writers(run)[writer](out))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("rlreplay: error: "), err
    assert "cannot write there" in err and str(out) in err
