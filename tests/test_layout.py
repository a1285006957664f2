"""The code stays readable at a glance: no module over 400 lines, and ``route_loss`` in three verbs (resolve,
enter, run) within 60 lines and 6 exits. Read from the files and their syntax trees."""

from __future__ import annotations

import ast

from conftest import REPO

MAX_MODULE_LINES = 400


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


def test_no_module_over_400_lines() -> None:
    paths = [p for folder in ("wrapperroute", "tests", "benchmarks", "examples") for p in (REPO / folder).rglob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert len(paths) > 50 and not long, long


def test_route_loss_is_short_with_few_exits() -> None:
    tree = ast.parse((REPO / "wrapperroute" / "route.py").read_text())
    [function] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "route_loss"]
    assert function.end_lineno is not None
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
    assert isinstance(function, ast.FunctionDef) and _exits(function) == [5, 7]


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    opening = "\n".join(readme[:12])
    assert len(readme) <= 200, f"README.md is {len(readme)} lines"
    assert "wrapperroute check" in opening and "pytest" in opening, opening
