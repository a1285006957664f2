"""Which adapters :func:`wrapperroute.detect` consults: one door, :func:`register_adapter`, for the built-in ones
and a user's own.

An adapter registered later is asked first, so a subclass of a built-in wrapper (a DDP of one's own) can be claimed
by its own adapter. One whose package may not be installed is registered by its import path, to be made once that
package is imported: a model cannot be a ``DeepSpeedEngine`` before ``deepspeed`` is imported, so wrapperroute
never imports it itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RouteTypeError, RouteValueError
from .layer import Layer


@dataclass
class _Entry:
    adapter: Layer | None  # None until its package is imported
    path: str = ""  # "module:Class", made once ``package`` is imported
    package: str = ""


_entries: list[_Entry] = []  # in registration order
_asked: tuple[Layer, ...] = ()  # the made adapters, the latest registered first
_pending = 0  # entries whose package is not imported yet
_on_change: list[Callable[[], None]] = []  # what remembers answers of the adapters: forgotten on a change


def register_adapter(adapter: Layer | str, *, once_imported: str | None = None) -> None:
    """Teach wrapperroute one wrapper family.

    ``adapter`` is a :class:`~wrapperroute.adapters.Layer` (an instance): only peeled, unless it also has the
    routing protocol (:class:`~wrapperroute.adapters.Routing`: ``route_loss`` enters it) and the topology protocol
    (:class:`~wrapperroute.adapters.Topology`: it is a distributed wrapper, compared by the audit and
    ``check_grad_sync``, counted by ``token_divisor``). Or the import path of its class, ``"module:Class"``, with
    ``once_imported`` the package whose import makes it: made then, with no argument.

    Asked before every adapter registered earlier, the built-in ones included. Models routed or detected before
    are looked at again.
    """
    if isinstance(adapter, str):
        if once_imported is None or ":" not in adapter:
            raise RouteValueError(
                f"register_adapter({adapter!r}): a class given by its import path needs the form 'module:Class' "
                "and once_imported='package' (the package whose import makes it); or pass an adapter instance"
            )
        _entries.append(_Entry(None, adapter, once_imported))
    elif isinstance(adapter, Layer):
        if once_imported is not None:
            raise RouteValueError("once_imported= goes with an adapter given by its import path ('module:Class')")
        _entries.append(_Entry(adapter))
    else:
        hint = f"{adapter.__name__}()" if isinstance(adapter, type) and issubclass(adapter, Layer) else "an instance"
        raise RouteTypeError(
            f"register_adapter takes a wrapperroute.adapters.Layer instance (a Routing and Topology subclass for a "
            f"distributed wrapper), got {adapter!r}; pass {hint}"
        )
    _changed()


def on_change(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever the adapters change: for what remembers their answers (plain types, plans)."""
    _on_change.append(forget)


def registered() -> tuple[Layer, ...]:
    """The adapters to consult, in the order they are asked: those of packages not imported yet left out."""
    if _pending:
        _make_imported()
    return _asked


def _make_imported() -> None:
    made = False
    for entry in _entries:
        if entry.adapter is None and entry.package in sys.modules:
            module_path, class_name = entry.path.split(":")
            entry.adapter = getattr(importlib.import_module(module_path), class_name)()
            made = True
    if made:
        _changed()


def _changed() -> None:
    global _asked, _pending
    _asked = tuple(entry.adapter for entry in reversed(_entries) if entry.adapter is not None)
    _pending = sum(entry.adapter is None for entry in _entries)
    for forget in _on_change:
        forget()
