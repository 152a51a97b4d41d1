"""``rlreplay ui``: a read-only local web app over a run or a folder of runs (needs the ``ui`` extra)."""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    from rlreplay.ui.app import create_app as make

    return make(*args, **kwargs)
