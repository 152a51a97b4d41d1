"""What a fresh clone holds: no tracked link leads out of the checkout or nowhere."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_tracked_symlink_dangles_or_leads_out_of_the_checkout() -> None:
    proc = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in proc.stdout.splitlines() if line.startswith("120000 ")]
    for name in links:  # mode 120000: a symlink, whose blob is its target
        target = os.readlink(ROOT / name) if (ROOT / name).is_symlink() else None
        assert target is not None, f"{name}: tracked as a link, not one in the checkout"
        resolved = (ROOT / name).parent.joinpath(target).resolve()
        assert not os.path.isabs(target) and resolved.is_relative_to(ROOT), f"{name} -> {target}"
        assert resolved.exists(), f"{name} -> {target} leads nowhere"
