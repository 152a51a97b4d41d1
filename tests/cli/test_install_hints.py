"""A feature whose optional extra is missing: one line naming the extra as a user installs it, from
PyPI and from a clone (``pip install -e '.[EXTRA]'``), exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_without

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"

CASES = {  # extra: (the module that goes missing, the command that needs it)
    "query": ("duckdb", ["ls", str(SAMPLE), "--where", "reward > 0"]),
    "plot": ("matplotlib", ["stats", str(SAMPLE), "--plot", "chart.png"]),
    "ui": ("starlette", ["ui", str(SAMPLE), "--port", "0"]),
    "text": ("tokenizers", ["export", str(SAMPLE), "--out", "x.jsonl"]),
    "proxy": ("aiohttp", ["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0"]),
    "ray": ("ray", ["audit", str(SAMPLE), "--engine", "ray", "--ray-address", "127.0.0.1:9"]),
}


@pytest.mark.parametrize("extra", sorted(CASES))
def test_missing_extra_is_one_line_with_the_install_from_a_clone(extra: str, tmp_path: Path) -> None:
    module, args = CASES[extra]
    proc = run_without(module, *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("rlreplay: error: "), proc.stderr
    assert f"pip install 'rlreplay[{extra}]'" in lines[0] and f"pip install -e '.[{extra}]'" in lines[0]
    assert list(tmp_path.iterdir()) == []
