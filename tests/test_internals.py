"""Private torch names live in the adapters and in ``wrapperroute/_torch_internals.py`` alone, where each says
what it is for and where it was checked: read from the code's syntax tree, not its comments."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "wrapperroute"
ALLOWED = {PACKAGE / "_torch_internals.py"}
# Private attributes of torch objects that the code reaches without spelling ``torch.``: every one the adapters
# and the internals module use.
PRIVATE_ATTRIBUTES = {
    "_active_ddp_module", "_execution_engine", "_enabled", "_cache_enabled", "_foreach_norm", "_call_impl",
    "_get_fsdp_state", "_fsdp_param_groups", "_fsdp_param_group", "_state_ctx", "_training_state", "_handle",
    "_local_shard", "_fqns", "_shapes", "_numels_with_padding", "_is_padding_mask", "_init_kwargs",
    "_forward_pre_hooks", "_forward_hooks", "_run_ddp_forward", "_inside_ddp_forward", "_fsdp_wrapped_module",
    "_orig_mod", "_saved_tensors_hooks_enable", "_saved_tensors_hooks_is_enabled", "_dynamo",
}  # fmt: skip


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_torch_names(path: Path, root: Path = REPO) -> list[str]:
    """``"file:line: name"`` for every private torch name the file's code reaches."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            parts = node.module.split(".") + [alias.name for alias in node.names]
            if any(part.startswith("_") and not part.startswith("__") for part in parts):
                found.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and dotted is not None and dotted.startswith("torch."):
                found.append(f"{where}: {dotted}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{where}: .{node.attr}")
    return found


def test_no_private_torch_name_outside_the_adapters_and_the_internals_module() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in ALLOWED or (PACKAGE / "adapters") in path.parents:
            continue
        found += private_torch_names(path)
    assert not found, "private torch names outside adapters/ and _torch_internals.py:\n" + "\n".join(found)


def test_the_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The premise: each form is caught where it stands, and a public name is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "from torch.distributed._composable.contract import REGISTRY_KEY\n"
        "hooks = torch._C._autograd\n"
        "marker = obj._active_ddp_module\n"
        "public = torch.nn.functional.relu\n"
    )
    found = sorted(private_torch_names(sample, tmp_path))
    assert found == sorted([
        "sample.py:2: from torch.distributed._composable.contract import REGISTRY_KEY",
        "sample.py:3: torch._C._autograd",
        "sample.py:3: torch._C",
        "sample.py:4: ._active_ddp_module",
    ]), found  # fmt: skip
