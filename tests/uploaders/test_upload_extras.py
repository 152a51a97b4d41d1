"""A backend whose packages are missing: one line naming the extra, exit 2, nothing written into the
run; ``upload --help`` marks it. The package is made unimportable the way Python documents
(``sys.modules[name] = None``), in a child process, so the real import machinery answers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import run_without

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
BLOCKED = {"mlflow": "mlflow", "weave": "weave", "otlp": "opentelemetry.proto", "trackio": "trackio"}
OPTIONS = {"weave": ["--project", "team/proj"], "otlp": ["--endpoint", "http://127.0.0.1:9/v1/traces"]}


def snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


@pytest.mark.parametrize("backend", sorted(BLOCKED))
@pytest.mark.parametrize("dry_run", [True, False])
def test_missing_backend_package_is_one_line_naming_the_extra(
    backend: str, dry_run: bool, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    before = snapshot(run)
    args = ["upload", str(run), "--backend", backend, *OPTIONS.get(backend, []), "--max-samples", "1"]
    proc = run_without(BLOCKED[backend], *args, *(["--dry-run"] if dry_run else []), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlreplay: error: "), proc.stderr
    assert f"rlreplay[{backend}]" in lines[0] and BLOCKED[backend] in lines[0]
    assert snapshot(run) == before  # no ledger, no store, nothing


def test_upload_help_marks_a_backend_that_is_not_installed(tmp_path: Path) -> None:
    proc = run_without("weave", "upload", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    sections = {part.split()[0].rstrip(":"): part for part in text.split("Backend ")[1:]}
    assert set(sections) == set(BLOCKED)
    assert "not usable here" in sections["weave"] and "rlreplay[weave]" in sections["weave"]
    assert all("not usable here" not in sections[name] for name in ("mlflow", "otlp", "trackio"))
