"""Rank bodies for tests/test_custom_wrapper.py: the example's hand-rolled wrapper trained under the audit."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

from conftest import REPO

NAME = "wrapperroute_example_custom_wrapper"


def example() -> ModuleType:
    """examples/custom_wrapper.py, imported once per process (its import registers the adapter)."""
    module = sys.modules.get(NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(NAME, REPO / "examples" / "custom_wrapper.py")
        assert spec is not None and spec.loader is not None
        module = sys.modules[NAME] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def audited_run(routed: bool) -> dict[str, Any]:
    """The example's training, routed or not, under the audit (in this process, as ``wrapperroute audit`` runs a
    script): what it returns, and what the audit found."""
    from wrapperroute.audit import Audit

    audit = Audit(steps=None, on_desync="warn", json_path=None)
    audit.install()
    try:
        result = example().train(routed=routed)
        audit.finish()
    finally:
        audit.uninstall()
    return {**result, "desync": audit.desync, "kinds": sorted(audit.kinds), "final": audit.final_line()}
