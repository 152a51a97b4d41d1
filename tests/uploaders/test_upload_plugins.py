"""Upload backends are plug-ins: a tiny backend from a throwaway distribution (a dist-info with
an ``rlreplay.uploaders`` entry point, put on the path of a subprocess) uploads through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import rlreplay_proc

import rlreplay

TINY = '''
import json
from pathlib import Path

from rlreplay.uploaders.base import BackendOption, Prepared, SendResult, UploadError


class TinyUploader:
    """Appends each trajectory's span names to a JSON-lines file."""

    backend = "tiny"
    options = (BackendOption("--out", "The file to append to.", metavar="PATH"),)
    can_upsert = False

    def __init__(self, out):
        self.out = Path(out)

    @classmethod
    def from_options(cls, options):
        if not options.values.get("out"):
            raise UploadError("the tiny backend needs --out PATH")
        return cls(options.values["out"])

    def target(self):
        return f"tiny:{self.out}"

    def prepare(self, trajectories):
        out = []
        for t in trajectories:
            body = json.dumps({"id": t.id, "step": t.step, "spans": sorted(s.name for s in t.spans)})
            out.append(Prepared(t.id, t.id, body, len(body) + 1))
        return out

    def send(self, batch):
        with open(self.out, "a") as f:
            f.write("".join(p.body + "\\n" for p in batch))
        return [SendResult(p.trajectory_id, p.backend_id, True, p.nbytes) for p in batch]

    def existing(self, trajectory_ids):
        if not self.out.exists():
            return set()
        have = {json.loads(line)["id"] for line in self.out.read_text().splitlines()}
        return have & set(trajectory_ids)

    def close(self):
        pass
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A directory holding the tiny backend and its dist-info (as pip would install it)."""
    root = tmp_path / "site"
    dist = root / "tiny_uploader-0.1.dist-info"
    dist.mkdir(parents=True)
    (root / "tiny_uploader.py").write_text(TINY)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-uploader\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[rlreplay.uploaders]\ntiny = tiny_uploader:TinyUploader\nbroken = broken_uploader:Nope\n"
    )
    (root / "broken_uploader.py").write_text("raise RuntimeError('this plug-in is broken')\n")
    return root


def cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return rlreplay_proc("upload", *args, env={"PYTHONPATH": path})


def test_a_backend_from_another_package_uploads_through_the_cli(
    run_copy: Path, site: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tiny.jsonl"
    args = [str(run_copy), "--backend", "tiny", "--out", str(out), "--max-samples", "1", "--json"]
    done = cli(site, *args)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    run = rlreplay.open_run(run_copy)
    assert summary["backend"] == "tiny" and summary["sent"] == summary["selected"] == len(lines) > 0
    for line in lines:
        assert line["spans"] == sorted(s.name for s in run.trajectory(line["id"]).spans)
    assert sum(len(json.dumps(line)) + 1 for line in lines) == summary["bytes"]

    again = cli(site, *args)
    assert json.loads(again.stdout)["sent"] == 0 and len(out.read_text().splitlines()) == len(lines)

    # what the backend already has, asked of the backend itself (the ledger gone)
    for ledger in (run_copy / "_uploads").glob("tiny-*.jsonl"):
        ledger.unlink()
    check = cli(site, *args, "--dry-run", "--check-server")
    report = json.loads(check.stdout)
    assert report["on_server"] == report["selected"] == len(lines) and report["to_send"] == len(lines)

    refused = cli(site, *args[:-1], "--resend")  # no upsert: --resend would duplicate
    assert refused.returncode == 2 and "cannot replace" in refused.stderr
    assert refused.stderr.count("\n") == 1
    old = cli(site, *args[:-1], "--force")  # the option's earlier name: the same, said
    assert old.returncode == 2 and old.stderr.splitlines() == [
        "rlreplay: --force is now --resend",
        refused.stderr.strip(),
    ]


def test_unknown_backend_lists_the_installed_ones(run_copy: Path, site: Path) -> None:
    done = cli(site, str(run_copy), "--backend", "nope")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("rlreplay: error: --backend must be one of: ")
    for name in ("mlflow", "otlp", "tiny", "trackio", "weave", "broken"):
        assert name in line
    broken = cli(site, str(run_copy), "--backend", "broken")  # one line, no traceback
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1
    assert (
        "the broken backend (broken_uploader:Nope) failed to import: this plug-in is broken" in broken.stderr
    )


def test_help_lists_each_backends_options(site: Path, run_copy: Path) -> None:
    everything = cli(site, "--help").stdout
    for text in (
        "Backend tiny",
        "--out PATH",
        "Backend otlp",
        "--endpoint URL",
        "--header K=V",
        "Backend trackio",
        "Backend broken",
        "failed to import",
    ):
        assert text in everything
    one = cli(site, "--backend", "tiny", "--help").stdout
    assert "--out PATH" in one and "The file to append to." in one
    assert "--endpoint URL" not in one and "Backend otlp" not in one
    assert "--max-samples" in one  # the common options are there too
    wrong = cli(site, str(run_copy), "--backend", "tiny", "--endpoint", "http://x")
    assert wrong.returncode == 2 and "--endpoint is an option of the otlp backend" in wrong.stderr
    missing = cli(site, str(run_copy), "--backend", "tiny")
    assert missing.returncode == 2 and "needs --out PATH" in missing.stderr
