"""Every private name of another package that wrapperroute's code reaches is in the catalogue,
``wrapperroute._torch_internals.PRIVATE_NAMES``, and every name there is still reached: both read from the code's
syntax tree, not from a list kept by hand.

Reached: ``x._name``, read, assigned or deleted; a string that is a private name (``getattr``, ``setattr`` and
``hasattr``'s argument, a tuple of hook dicts, a method patched by name), unless matched as a prefix or suffix; a
private module or name in an absolute import; a private segment of a module path spelled in a string
(``"torch.distributed._composable.fsdp:FSDPModule"``); a private keyword argument.

Own against foreign, by name: a private name is wrapperroute's own, never reported, where wrapperroute's code
defines it: a ``def`` or ``class``, or an assignment, at module or class level (dataclass and NamedTuple fields
included); a ``__slots__`` entry; an attribute a method of a wrapperroute class assigns on ``self`` or ``cls``; a
parameter; an import's ``as`` name; a module of the package; a name spelling ``wrapperroute``. Every other private
name is foreign wherever it stands, on ``self`` too: a function patched onto a foreign class (TRL's trainers) reaches
that class's attributes through ``self``, and a store there or onto any other object defines nothing
(``DistributedDataParallel._active_ddp_module = None`` is foreign). Python's own (``sys._getframe``,
``NamedTuple._replace``) are foreign too, catalogued with the rest. The blind spot: a foreign name that
wrapperroute also defines for itself passes for its own.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from conftest import REPO

from wrapperroute._torch_internals import PRIVATE_NAMES

PACKAGE = REPO / "wrapperroute"
CATALOGUE = "PRIVATE_NAMES"  # its keys are strings naming private names: not the code reaching them
# Packages whose module paths the code spells in strings, to find a class without importing its package.
PACKAGES = ("torch", "deepspeed", "transformers", "trl", "accelerate", "lightning", "lightning_fabric", "peft",
            "liger_kernel")  # fmt: skip
MODULE_PATH = re.compile(rf"(?:{'|'.join(PACKAGES)})(?:[.:]\w+)*[.:]?")  # an f-string's part ends at a separator
NAME = re.compile(r"_*[A-Za-z]\w*")
AFFIXES = {"startswith", "endswith", "removeprefix", "removesuffix"}  # their strings are affixes, not names
RECEIVERS = {"self", "cls"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module's or class's body, through ``if``, ``try`` and ``with`` but not into a def."""
    for statement in body:
        yield statement
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                yield from _level(getattr(statement, field, []))
            for handler in getattr(statement, "handlers", []):
                yield from _level(handler.body)


def own_names(package: Path, trees: Iterable[ast.Module]) -> set[str]:
    """Every private name the package's code defines (the docstring's rule), and its private modules."""
    own = {path.stem for path in package.rglob("*.py")} | {path.name for path in package.rglob("*") if path.is_dir()}
    for tree in trees:
        own |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
        scopes: list[ast.Module | ast.ClassDef] = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
        for scope in scopes:
            for statement in _level(scope.body):
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(statement.name)
                    if isinstance(scope, ast.ClassDef) and not isinstance(statement, ast.ClassDef):
                        own |= {node.attr for node in ast.walk(statement) if isinstance(node, ast.Attribute)
                                and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                                and node.value.id in RECEIVERS}  # fmt: skip
                elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                    own |= {alias.asname for alias in statement.names if alias.asname}
                elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                    names = {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}
                    own |= names
                    if "__slots__" in names and statement.value is not None:
                        own |= {node.value for node in ast.walk(statement.value)
                                if isinstance(node, ast.Constant) and isinstance(node.value, str)}  # fmt: skip
    return {name for name in own if private(name)}


def _reached(node: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, name)`` for each private name this one node reaches, own or not."""
    if isinstance(node, ast.Attribute):
        yield node.end_lineno or node.lineno, node.attr
    elif isinstance(node, ast.keyword) and node.arg is not None:
        yield node.lineno, node.arg
    elif isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] != "wrapperroute":
                yield from ((node.lineno, part) for part in alias.name.split("."))
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
        if node.module.split(".")[0] != "wrapperroute":
            yield from ((node.lineno, part) for part in node.module.split("."))
            yield from ((node.lineno, alias.name) for alias in node.names)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        if NAME.fullmatch(node.value):
            yield node.lineno, node.value
        elif MODULE_PATH.fullmatch(node.value):
            yield from ((node.lineno, part) for part in re.split("[.:]", node.value))


def foreign_private_names(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for every private name of another package the module's code reaches."""
    unread: list[ast.expr] = []  # the catalogue's strings, and those an affix test matches
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == CATALOGUE for target in targets):
                unread.append(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in AFFIXES:
            unread += node.args
    skipped = {id(inner) for expression in unread for inner in ast.walk(expression) if isinstance(inner, ast.Constant)}
    return [(line, name) for node in ast.walk(tree) if id(node) not in skipped for line, name in _reached(node)
            if private(name) and name not in own and "wrapperroute" not in name]  # fmt: skip


@functools.cache
def found() -> tuple[tuple[str, str], ...]:
    """``(file:line, name)`` for every private name of another package that wrapperroute's code reaches."""
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    own = own_names(PACKAGE, trees.values())
    return tuple((f"{path.relative_to(REPO)}:{line}", name) for path, tree in trees.items()
                 for line, name in sorted(set(foreign_private_names(tree, own))))  # fmt: skip


def test_every_private_name_of_another_package_is_in_the_catalogue() -> None:
    missing = "\n".join(f"{where}: {name}" for where, name in found() if name not in PRIVATE_NAMES)
    assert not missing, f"private names of other packages missing from _torch_internals.PRIVATE_NAMES:\n{missing}"


def test_every_catalogued_name_is_still_reached() -> None:
    stale = sorted(set(PRIVATE_NAMES) - {name for _where, name in found()})
    assert not stale, "in _torch_internals.PRIVATE_NAMES, reached nowhere in wrapperroute/: " + ", ".join(stale)


def test_the_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The premise: each form is caught on its line, and neither a name the code defines nor a public one is."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch._dynamo\n"
        "from torch.distributed._composable.contract import REGISTRY_KEY as _KEY\n"
        "from transformers.trainer import _is_peft_model\n"
        "from ._sibling import _helper\n"
        "class Mine:\n"
        "    __slots__ = ('_slot', '_state')\n"
        "    _level = 0\n"
        "    def __init__(self, _param=None):\n"
        "        self._state = 1\n"
        "    def _method(self):\n"
        "        return self._state\n"
        "def compute_loss(self):\n"
        "    self._forward_redirection = None\n"
        "    def _compute_loss_liger(self): ...\n"
        "    return '_compute_loss_liger'\n"
        "DistributedDataParallel._active_ddp_module = None\n"
        "del module._forward_hooks\n"
        "hooks = torch._C._autograd\n"
        "epilogue = getattr(engine, '_forward_epilogue', None)\n"
        "setattr(coordinator, '_invalidate_trace', True)\n"
        "known = hasattr(state, '_fsdp_param_group')\n"
        "FSDP = loaded_class('torch.distributed.fsdp._fully_shard._fully_shard:FSDPModule')\n"
        "torch.compile(model, _private_option=True)\n"
        "own = mine._state, mine._method(), Mine._level, mine._slot, _KEY, Mine(_param=1), _helper()\n"
        "suffix = name.endswith('_weight')\n"
        "public = torch.nn.functional.relu, '_wrapperroute_stamp', 'wrapperroute._routing.plan:Plan'\n"
        "PRIVATE_NAMES = {'_catalogued': 'a name the test reads, not one the code reaches'}\n"
    )
    tree = ast.parse(sample.read_text())
    caught = sorted(foreign_private_names(tree, own_names(tmp_path, [tree])))
    assert caught == [
        (1, "_dynamo"), (2, "_composable"), (3, "_is_peft_model"), (13, "_forward_redirection"),
        (15, "_compute_loss_liger"), (16, "_active_ddp_module"), (17, "_forward_hooks"), (18, "_C"), (18, "_autograd"),
        (19, "_forward_epilogue"), (20, "_invalidate_trace"), (21, "_fsdp_param_group"), (22, "_fully_shard"),
        (22, "_fully_shard"), (23, "_private_option"),
    ], caught  # fmt: skip
