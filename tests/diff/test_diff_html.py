"""The ``--html`` report of ``rlreplay diff``: self-contained, and drawn by real headless Chromium."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from contextlib import redirect_stdout
from html.parser import HTMLParser
from pathlib import Path

import pytest

import rlreplay
from rlreplay.cli.main import main

SAMPLE_RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
DEL_BG = (0xFF, 0xD7, 0xD5)  # the CSS backgrounds of <del> and <ins>
INS_BG = (0xCC, 0xF2, 0xD4)


class Collect(HTMLParser):
    """Texts inside <del> and <ins>, tag names, and every attribute that could load something."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.dels: list[str] = []
        self.inss: list[str] = []
        self.tags: set[str] = set()
        self.links: list[str] = []
        self.calls = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.add(tag)
        if ("class", "call") in attrs:  # a changed tool call, not a piece of the turns' text
            self.calls += 1
            tag = f"{tag}.call"
        self.stack.append(tag)
        if tag == "del":
            self.dels.append("")
        if tag == "ins":
            self.inss.append("")
        self.links += [v for k, v in attrs if k in ("src", "href") and v]

    def handle_endtag(self, tag: str) -> None:
        if self.stack and self.stack[-1].split(".")[0] == tag:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if "del" in self.stack:
            self.dels[-1] += data
        if "ins" in self.stack:
            self.inss[-1] += data


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The report and the JSON diff of two rollouts of one sample at step 5 that scored differently."""
    run = rlreplay.open_run(SAMPLE_RUN)
    groups: dict[int, list[dict]] = {}
    for row in run.trajectories(step=5, validate=False).to_pylist():
        groups.setdefault(row["sample_index"], []).append(row)
    group = next(g for g in groups.values() if len({r["reward"] for r in g}) > 1)
    group.sort(key=lambda r: r["rollout_n"])
    a = group[0]
    b = next(r for r in group if r["reward"] != a["reward"])
    out = tmp_path_factory.mktemp("html") / "diff.html"
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["diff", a["id"], b["id"], "--run", str(SAMPLE_RUN), "--html", str(out), "--json"])
    assert rc == 0
    return out, json.loads(buf.getvalue())


def test_report_is_self_contained_and_marks_every_change(report) -> None:
    path, diff = report
    parser = Collect()
    parser.feed(path.read_text(encoding="utf-8"))
    assert "script" not in parser.tags and "img" not in parser.tags and "link" not in parser.tags
    assert all(link.startswith("#") for link in parser.links), parser.links
    assert diff["text"] is True
    changes = [s for t in diff["turns"] if t["status"] != "equal" for s in t["diff"] if s["op"] == "change"]
    assert changes
    # each change appears twice in the page: once in the side-by-side columns, once in the unified view
    expected_dels = [s["a"] for s in changes if s["a"]]
    expected_inss = [s["b"] for s in changes if s["b"]]
    assert sorted(parser.dels) == sorted(expected_dels * 2)
    assert sorted(parser.inss) == sorted(expected_inss * 2)
    assert parser.calls == 2 * sum(1 for t in diff["turns"] if t.get("tool_calls_changed"))


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "the HTML report is tested in headless Chromium: apt-get install chromium"
    return found


def _chromium_args(tmp_path: Path) -> list[str]:
    return [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]


def test_chromium_parses_and_draws_the_report(report, tmp_path: Path) -> None:
    from PIL import Image

    path, diff = report
    url = path.resolve().as_uri()
    dom = subprocess.run(
        [*_chromium_args(tmp_path), "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="first-divergence"' in dom.stdout
    div = diff["first_divergence"]
    assert f"token {div['token_offset']} of the turn, response token {div['response_offset']}" in dom.stdout
    shot = tmp_path / "shot.png"
    drawn = subprocess.run(
        [*_chromium_args(tmp_path), "--window-size=1280,1600", f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drawn.returncode == 0 and shot.exists(), drawn.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20)}
    # the deletions' and insertions' backgrounds were painted (so the marked text is on screen)
    assert DEL_BG in colours and INS_BG in colours
