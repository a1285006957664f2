"""Shared by the adapters whose wrapper *is* the model (FSDP2, composable ``replicate``): while a loss runs
inside the module's forward, its forward hooks are set aside, so a loss that calls the model again gets a plain
forward instead of a second pre/post-forward (a second unshard/reshard, a re-armed reducer).

The hook dicts are emptied in place and refilled, never replaced: they are the module's own objects, and a
hook the loss registers meanwhile (its handle pointing at the same dict) is kept, after the ones set aside.
What was set aside is recorded before anything is emptied, and what the loss added is recorded before
anything is refilled, so a Ctrl-C landing between two Python calls (even in contextlib's own frames, leaving
the generator suspended) loses nothing: ``put_hooks_back`` in the adapter's ``recover()`` finishes the job.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


@dataclass
class _Aside:
    hooks: dict[str, dict[Any, Any]]  # each hook dict's entries when set aside
    added: dict[str, dict[Any, Any]] = field(default_factory=dict)  # what the loss registered, once read
    holders: int = 1  # routed calls running with these hooks aside (a no_grad call beside a grad one)


# Hooks set aside while a loss runs, until put back (by the loss's exit, or by recover() after a fault).
_set_aside: weakref.WeakKeyDictionary[nn.Module, _Aside] = weakref.WeakKeyDictionary()


_CALL_IMPL = nn.Module._call_impl.__code__


def modules_being_called(frame: types.FrameType | None) -> Iterator[nn.Module]:
    """The modules whose ``__call__`` is running in ``frame`` or its callers, innermost first (this thread)."""
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                yield module
        frame = frame.f_back


def called_here(module: nn.Module, frame: types.FrameType | None) -> bool:
    """Whether ``module``'s ``__call__`` is running in ``frame`` or its callers: this thread's stack, never state
    another thread, or a forward that raised, may have left behind."""
    return any(called is module for called in modules_being_called(frame))


def put_hooks_back(module: nn.Module, saved: _Aside | None = None) -> None:
    """Put back the module's hooks still set aside, before any the loss registered meanwhile (``saved``: only
    those; a generator closed late must not put back over a later step's). No-op when none are aside."""
    aside = _set_aside.get(module)
    if aside is None or (saved is not None and aside is not saved):
        return
    attributes = module.__dict__
    for name in _HOOK_DICTS:
        if name not in aside.added:  # read once: a second pass (after an interrupt) must not read half-refilled
            aside.added[name] = dict(attributes[name])
    for name in _HOOK_DICTS:
        hooks = attributes[name]
        hooks.clear()
        hooks.update(aside.hooks[name])
        hooks.update(aside.added[name])
    del _set_aside[module]  # last: until the hooks are back, recover() must still find them


@contextlib.contextmanager
def hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """The module's forward hooks set aside for the length of the block (its pre-hooks have run already, and
    ``nn.Module.__call__`` reads the post-hooks after the forward returns, so both still run for this call).
    Blocks that overlap share one record: the last out puts the hooks back (the first would put back empty
    dicts the second had recorded, losing the hooks for good)."""
    aside = _set_aside.get(module)
    if aside is not None:
        aside.holders += 1
    else:
        attributes = module.__dict__
        aside = _Aside({name: dict(attributes[name]) for name in _HOOK_DICTS})
        _set_aside[module] = aside
        for name in _HOOK_DICTS:
            attributes[name].clear()
    try:
        yield
    finally:
        aside.holders -= 1
        if aside.holders == 0:
            put_hooks_back(module, aside)


# The dicts of flags keyed like the hooks (which take keyword arguments, which always run).
_HOOK_FLAGS = ("_forward_hooks_always_called",)


@contextlib.contextmanager
def other_hooks_set_aside(module: nn.Module, own: set[int]) -> Iterator[None]:
    """The module's forward hooks other than those keyed ``own`` (a wrapper's, found by its handles) set aside for
    the block, before the module is called, and put back in their order after it, after any registered meanwhile.
    For a wrapper entered with wrapperroute's call as its input: another library's hooks on the same module
    (tensor parallelism's input and output layouts) would read the call as the module's input."""
    attributes = module.__dict__
    names = [name for name in (*_HOOK_DICTS, *_HOOK_FLAGS) if name in attributes]
    saved = {name: dict(attributes[name]) for name in names}
    other = {key for name in ("_forward_pre_hooks", "_forward_hooks") for key in saved.get(name, {}) if key not in own}
    if not own or not other:
        yield
        return
    try:
        for name in names:
            hooks = attributes[name]
            hooks.clear()
            hooks.update({key: value for key, value in saved[name].items() if key not in other})
        yield
    finally:
        for name in names:
            hooks = attributes[name]
            added = {key: value for key, value in hooks.items() if key not in saved[name]}
            hooks.clear()
            hooks.update(saved[name])
            hooks.update(added)
