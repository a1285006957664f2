"""The code stays readable at a glance. The rule, in one sentence: a module holds one concept, which its docstring
names first, and talks to other modules only through their names without a leading underscore, with no circle of
imports. Also ``route_loss`` in its verbs (plan, run) within 60 lines and 6 exits, and a README that opens with
its two commands. Read from the files and their syntax trees."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "wrapperroute"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every import of a module of the package by ``name`` (at any depth, under
    ``TYPE_CHECKING`` too): the module imported, and the names taken from it (a module imported as a name is the
    module itself)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = []
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:  # ``from . import state``: the module itself
                    found.append((submodule, [], node.lineno))
                else:
                    names.append(alias.name)
            if source in known and names:
                found.append((source, names, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name in known]
    return found


def test_no_private_name_crosses_a_module() -> None:
    """A leading underscore means "this file only": no module takes such a name from another."""
    known = _modules()
    crossing = [f"{path.relative_to(REPO)}:{line}: {name} from {source}"
                for module, path in known.items() for source, names, line in _imports(module, path, known)
                for name in names if name.startswith("_") and not name.startswith("__")]  # fmt: skip
    assert not crossing, crossing


def test_the_module_graph_has_no_circle() -> None:
    known = _modules()
    graph = {module: {source for source, _, _ in _imports(module, path, known) if source != module}
             for module, path in known.items()}  # fmt: skip
    # a package's modules import their package's face (its __init__) by design: a face is not a room
    faces = {module for module, path in known.items() if path.name == "__init__.py"}
    graph = {module: {s for s in sources if s not in faces} for module, sources in graph.items() if module not in faces}
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for source in sorted(graph.get(module, ())):
            if state.get(source) == 1:
                circles.append([*path[path.index(source) :], source])
            elif source not in state:
                walk(source, [*path, source])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not circles, circles


def test_every_module_names_what_it_holds() -> None:
    """Each module opens with a docstring whose first sentence says what it holds."""
    silent = [str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
              if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]  # fmt: skip
    assert not silent, silent


def _exits(function: ast.FunctionDef) -> list[int]:
    """Lines of the ``return`` and ``raise`` statements of ``function`` itself (not of functions nested in it)."""
    found, todo = [], list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return | ast.Raise):
            found.append(node.lineno)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))
    return sorted(found)


def test_route_loss_is_short_with_few_exits() -> None:
    tree = ast.parse((PACKAGE / "route.py").read_text())
    [function] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "route_loss"]
    assert function.end_lineno is not None, "route_loss has no end line"
    lines = function.end_lineno - function.lineno + 1
    exits = _exits(function)
    assert lines <= 60, f"route_loss is {lines} lines"
    assert 0 < len(exits) <= 6, f"route_loss exits at lines {exits}"


def test_exits_are_counted_where_they_stand() -> None:
    """The premise: a nested function's return is not an exit of the outer one; every other one is."""
    source = (
        "def f(x):\n    def g():\n        return 1\n    if x:\n        raise ValueError\n"
        "    with x:\n        return 2\n"
    )
    [function] = ast.parse(source).body
    assert isinstance(function, ast.FunctionDef), f"parsed a {type(function).__name__}, not a function"
    assert _exits(function) == [5, 7], f"the exits found: {_exits(function)}, not lines 5 and 7"


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    """The premise of the import rules: the names taken from a module, and a module imported from its package
    (an arrow of a circle), are read as such."""
    known = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    known["pkg.a"].write_text("from .b import _hidden, shown\n")
    known["pkg.b"].write_text("from . import a\n")
    found = _imports("pkg.a", known["pkg.a"], known)
    assert found == [("pkg.b", ["_hidden", "shown"], 1)], f"pkg.a's imports: {found}"
    found = _imports("pkg.b", known["pkg.b"], known)
    assert found == [("pkg.a", [], 1)], f"pkg.b's imports: {found}"


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    opening = "\n".join(readme[:12])
    assert len(readme) <= 200, f"README.md is {len(readme)} lines"
    assert "wrapperroute check" in opening and "pytest" in opening, opening
