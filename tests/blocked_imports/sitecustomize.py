"""Makes the top-level modules named in $RLREPLAY_README_BLOCKED unimportable (the README test's stand-in
for a venv without them); rlreplay's own bootstrap runs this file too when it shadows it.

Every finder on ``sys.meta_path`` is wrapped so that it does not find those modules: ``import x``
raises ModuleNotFoundError and ``importlib.util.find_spec("x")`` is None, as where x is not
installed (libraries such as torch probe optional modules with ``find_spec``)."""

import os
import sys


class _Without:
    def __init__(self, finder: object, names: frozenset[str]) -> None:
        self._finder = finder
        self._names = names

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name.partition(".")[0] in self._names:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr: str) -> object:  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


_names = frozenset(n for n in os.environ.get("RLREPLAY_README_BLOCKED", "").split(",") if n)
if _names:
    sys.meta_path[:] = [f if isinstance(f, _Without) else _Without(f, _names) for f in sys.meta_path]
