"""rlreplay's activation, on PYTHONPATH for every process started by ``rlreplay record``.

Turns recording on when RLREPLAY_DIR is set, then runs the sitecustomize this file shadows.
"""

import os
import sys


def _run_shadowed_sitecustomize() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_rlreplay_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


try:  # this folder is on PYTHONPATH only in a recorded job's processes: rlreplay loads there anyway
    from rlreplay import settings

    if settings.DIR.get():
        from rlreplay.recorders.activate import activate

        activate()
except Exception as exc:  # recording must never stop the user's program
    print(f"rlreplay: recording not activated in pid {os.getpid()}: {exc}", file=sys.stderr)

_run_shadowed_sitecustomize()
