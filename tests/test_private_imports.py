"""No module of rlreplay (its ``rlreplay``, ``cli``, ``recorders`` and ``uploaders`` folders) nor of its
tests imports another package's private module or name (a component starting with ``_``; dunders
such as ``__future__`` are fine): those change without notice in any release. verl is excepted
(its recorder hooks verl's internals on purpose and pins the versions it supports)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("rlreplay", "cli", "recorders", "uploaders", "tests")
#: Packages whose private names may be imported: rlreplay's own modules, the tests' conftest, verl.
ALLOWED = {"rlreplay", "cli", "recorders", "uploaders", "conftest", "verl"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in modules:
            parts = module.split(".")
            if parts[0] in ALLOWED:
                continue
            if any(private(part) for part in parts) or any(private(name) for name in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} {names or ''}".rstrip())
    return found


def test_no_module_imports_another_package_private_module() -> None:
    files = [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 50
    assert [line for path in files for line in private_imports(path)] == []
