"""Shared by the adapters whose wrapper *is* the model (FSDP2, composable ``replicate``): while a loss runs
inside the module's forward, its forward hooks are set aside, so a loss that calls the model again gets a plain
forward instead of a second pre/post-forward (a second unshard/reshard, a re-armed reducer).

The hook dicts are set aside, not cleared in place (they are the wrapper's own objects), all four in one dict
update each way, and recorded: a Ctrl-C landing between two Python calls (even in contextlib's own frames,
leaving the generator suspended) must not leave the module without hooks; ``put_hooks_back`` in the adapter's
``recover()`` puts back whatever is still aside.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")

# Hook dicts set aside while a loss runs, until put back (by the loss's exit, or by recover() after a fault).
_set_aside: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


_CALL_IMPL = nn.Module._call_impl.__code__


def modules_being_called(frame: types.FrameType | None) -> Iterator[nn.Module]:
    """The modules whose ``__call__`` is running in ``frame`` or its callers, innermost first (this thread)."""
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                yield module
        frame = frame.f_back


def put_hooks_back(module: nn.Module, saved: dict[str, Any] | None = None) -> None:
    """Put back the module's hooks still set aside (``saved``: only those; a generator closed late must not put
    back over a later step's). No-op when none are aside."""
    aside = _set_aside.get(module)
    if aside is None or (saved is not None and aside is not saved):
        return
    module.__dict__.update(aside)
    del _set_aside[module]  # last: until the hooks are back, recover() must still find them


@contextlib.contextmanager
def hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """The module's forward hooks set aside for the length of the block (its pre-hooks have run already, and
    ``nn.Module.__call__`` reads the post-hooks after the forward returns, so both still run for this call)."""
    attributes = module.__dict__
    saved = {name: attributes[name] for name in _HOOK_DICTS}
    _set_aside[module] = saved
    try:
        attributes.update({name: type(hooks)() for name, hooks in saved.items()})
        yield
    finally:
        put_hooks_back(module, saved)
