"""The house rules of the code base, checked on its source: imports point one way, no import circles
(type-only imports count), no other package's private modules, and every module says its job in its
first line."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rlreplay": ROOT / "rlreplay", "rlreplay.cli": ROOT / "cli"}
PACKAGES |= {"rlreplay.recorders": ROOT / "recorders", "rlreplay.uploaders": ROOT / "uploaders"}

# Layers of rlreplay/, lowest first: a module imports only from its own layer or below.
LAYERS = [
    ("rlreplay.errors", "rlreplay.hookspecs", "rlreplay.plugins"),
    ("rlreplay.format",),
    ("rlreplay.model",),
    ("rlreplay.shards",),
    ("rlreplay.remote",),
    ("rlreplay.recorder",),
    ("rlreplay.text",),
    ("rlreplay.adapters",),
    ("rlreplay.read",),
    (
        "rlreplay.audit",
        "rlreplay.compare",
        "rlreplay.diff",
        "rlreplay.export",
        "rlreplay.playback",
        "rlreplay.rewrite",
        "rlreplay.ui",
    ),
]
# Hooking verl is rlreplay's job: its private parts may be imported.
PRIVATE_ALLOWED = ("verl",)


def modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            if "bootstrap" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, name: str, type_only: bool = False) -> list[tuple[str, int]]:
    """Every module ``name`` imports (at any depth, in functions too); those under ``if TYPE_CHECKING``
    only with ``type_only``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                found.append((base, child.lineno))
                found.extend((f"{base}.{alias.name}", child.lineno) for alias in child.names)
            visit(child)

    visit(tree)
    return found


def graph(packages: dict[str, Path] = PACKAGES, type_only: bool = False) -> dict[str, set[str]]:
    """Which of our modules each of our modules imports (``type_only``: type-only imports too)."""
    mods = modules(packages)
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for target, _ in imports(path, name, type_only):
            parts = target.split(".")
            for i in range(len(parts), 0, -1):  # the longest prefix that is one of ours
                candidate = ".".join(parts[:i])
                if candidate in mods:
                    if candidate != name and not name.startswith(candidate + "."):
                        edges[name].add(candidate)
                    break
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def layer(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_the_checker_finds_a_circle_and_an_arrow_up() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("rlreplay.format.schema") == 1 and layer("rlreplay.read.run") == 8
    assert layer("rlreplay.cli.main") is None


def test_the_checker_counts_type_only_imports_in_circles(tmp_path: Path) -> None:
    """Two modules importing each other, one of them only for type hints: a circle all the same
    (it is where a runtime import creeps in), though neither imports the other up a layer."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "turns.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.fields import Fields\n"
    )
    (tmp_path / "fields.py").write_text("def split():\n    from pkg import turns\n")
    packages = {"pkg": tmp_path}
    assert cycles(graph(packages, type_only=True)) == [["pkg.fields", "pkg.turns"]]
    assert graph(packages)["pkg.turns"] == set()  # imports point down: type-only ones aside


def test_no_import_circles() -> None:
    assert cycles(graph(type_only=True)) == []


def test_imports_point_down() -> None:
    edges = graph()
    up = []
    for name, targets in edges.items():
        mine = layer(name)
        if mine is None:  # cli, recorders, uploaders sit on top; the package root loads lazily
            continue
        for target in targets:
            theirs = layer(target)
            if theirs is None or theirs > mine:
                up.append(f"{name} -> {target}")
    assert up == []


def test_every_core_module_has_a_layer() -> None:
    core = [n for n in modules() if n.startswith("rlreplay.") and layer(n) is None]
    outside = ("rlreplay.cli", "rlreplay.recorders", "rlreplay.uploaders", "rlreplay.__main__")
    assert [n for n in core if not n.startswith(outside)] == []


def _private(module: str) -> bool:
    return any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
        for part in module.split(".")
    )


def test_no_private_modules_of_other_packages() -> None:
    mods = modules()
    bad = []
    for name, path in mods.items():
        for target, line in imports(path, name):
            top = target.split(".")[0]
            if top == "rlreplay" or top in PRIVATE_ALLOWED or not _private(target):
                continue
            head = target.rpartition(".")[0]
            if _private(head):
                bad.append(f"{path.relative_to(ROOT)}:{line} {target}")
                continue
            try:  # ``from pkg import _name``: bad only when _name is a module
                is_module = importlib.util.find_spec(target) is not None
            except (ImportError, ValueError):
                is_module = False
            if is_module:
                bad.append(f"{path.relative_to(ROOT)}:{line} {target}")
    assert bad == []


def test_every_module_opens_with_a_one_line_docstring() -> None:
    missing = []
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        first = (doc or "").split("\n", 1)[0].strip()
        if len(first) < 20:
            missing.append(name)
    assert missing == []


def _module_classes() -> list[tuple[str, str, list[str]]]:
    """(module, class, the last part of each base's name) for every class our code defines."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.append((name, node.name, [ast.unparse(b).rpartition(".")[2] for b in node.bases]))
    return found


def test_every_error_class_is_in_errors_under_rlreplay_error() -> None:
    """An exception a user may see is declared in ``rlreplay.errors``, under ``RlreplayError`` (a command
    prints it on one line, exit 2; a caller catches one base). Private ones (``_Failed``) never leave
    the module that raises them."""
    import builtins

    from rlreplay import errors

    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = _module_classes()
    while True:  # subclasses of exceptions, to any depth, by name
        more = {c for _, c, bases in classes if c not in known and known & set(bases)}
        if not more:
            break
        known |= more
    outside = [f"{m}.{c}" for m, c, _ in classes if c in known and m != "rlreplay.errors" and c[0] != "_"]
    assert outside == []
    declared = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(declared) > 10 and all(issubclass(v, errors.RlreplayError) for v in declared)


def test_span_kinds_are_spelled_once() -> None:
    """A span kind (``KIND_LLM = "llm"``) is spelled in ``rlreplay.format.kinds`` alone (it imports
    nothing: recording processes read it before pyarrow loads); every other module imports it."""
    spelled = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            if not all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                continue
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            spelled += [f"{name}.{n}" for n in names if n.startswith("KIND_")]
    assert len(spelled) == 7 and all(s.startswith("rlreplay.format.kinds.") for s in spelled), spelled
