"""Makes the top-level modules named in $RLREPLAY_README_BLOCKED unimportable (the README test's stand-in
for a venv without them); rlreplay's own bootstrap runs this file too when it shadows it."""

import os
import sys


class _Blocked:
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed by the README)", name=name)


_names = frozenset(n for n in os.environ.get("RLREPLAY_README_BLOCKED", "").split(",") if n)
if _names:
    sys.meta_path.insert(0, _Blocked(_names))
