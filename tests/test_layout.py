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
    ("rlreplay.errors", "rlreplay.hookspecs", "rlreplay.plugins", "rlreplay.settings", "rlreplay.words"),
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
        "rlreplay.engine",
        "rlreplay.export",
        "rlreplay.mismatch",
        "rlreplay.playback",
        "rlreplay.proxy",
        "rlreplay.rewrite",
        "rlreplay.ui",
        "rlreplay.watch",
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, names and attributes it assigns,
    arguments, ``__slots__`` entries."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            found.update(n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant))
    return {name for name in found if _is_private(name)}


def private_reaches(packages: dict[str, Path] = PACKAGES) -> list[str]:
    """Where a module reaches into another module's private names: ``obj._name`` / ``getattr(obj,
    "_name")`` / ``from mod import _name`` of a name another of our modules defines and this one does
    not (``self`` and ``cls`` aside), and a subclass defining a private method of a base class
    declared in another module (overriding a private hook)."""
    mods = modules(packages)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in mods.items()}
    own = {name: _defined_privates(tree) for name, tree in trees.items()}
    anywhere = set().union(*own.values()) if own else set()
    methods: dict[str, list[tuple[str, set[str]]]] = {}  # class name -> (module, its private methods)
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defs = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                methods.setdefault(node.name, []).append((name, {d for d in defs if _is_private(d)}))
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            reached = None
            if isinstance(node, ast.Attribute):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    reached = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
                key = node.args[1]
                if node.func.id in ("getattr", "hasattr", "setattr") and isinstance(key, ast.Constant):
                    reached = key.value if isinstance(key.value, str) else None
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
                for alias in node.names:
                    if _is_private(alias.name) and f"{node.module}.{alias.name}" not in mods:
                        found.append(f"{name}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.ClassDef):
                mine = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                for base in (ast.unparse(b).rpartition(".")[2] for b in node.bases):
                    for module, hooks in methods.get(base, []):
                        if module != name and mine & hooks:
                            found.append(f"{name}:{node.lineno} {node.name} overrides {sorted(mine & hooks)}")
            if reached and _is_private(reached) and reached not in own[name] and reached in anywhere:
                found.append(f"{name}:{node.lineno} reaches {reached}")
    return found


def test_the_checker_finds_a_reach_into_another_modules_privates(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "base.py").write_text(
        "import sys\n"
        "def _helper():\n    return sys._getframe()\n"
        "class Run:\n"
        "    def _hook(self):\n        self._state = 1\n"
        "    def same(self, other):\n        return other._state  # the same module: fine\n"
    )
    (tmp_path / "user.py").write_text(
        "from pkg import base\nfrom pkg.base import _helper\n"
        "def f(run):\n    base._helper()\n    getattr(run, '_state')\n    return run._hook()\n"
    )
    (tmp_path / "remote.py").write_text(
        "from pkg.base import Run\nclass Remote(Run):\n    def _hook(self):\n        return 2\n"
    )
    found = private_reaches({"pkg": tmp_path})
    assert sorted(found) == [
        "pkg.remote:2 Remote overrides ['_hook']",
        "pkg.user:2 imports _helper",
        "pkg.user:4 reaches _helper",
        "pkg.user:5 reaches _state",
        "pkg.user:6 reaches _hook",
    ]


def test_no_module_reaches_into_another_modules_privates() -> None:
    """A module calls another module's public functions and methods only, and no subclass overrides
    a private hook of a class in another module: the other side of a module's boundary stays free
    to change."""
    assert private_reaches() == []
