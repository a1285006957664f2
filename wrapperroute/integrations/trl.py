"""TRL integration: a drop-in ``_ForwardRedirection`` and ``patch_trl()`` for the DPO/KTO Liger paths.

``DPOTrainer``/``KTOTrainer`` with ``use_liger_kernel=True`` call ``_compute_loss_liger``, which reads the
model's weights directly. TRL releases differ in what they pass it, and so in how they fail (TRL issue #7245
and the TRL pull request that followed):

- the *unwrapped* model, outside the wrapper's forward (routed only under ZeRO-3 or FSDP): under DDP the
  reducer is never armed and every rank keeps its own gradients (a silent desync);
- the *wrapper itself*, where the Liger code reads ``model.base_model``: ``AttributeError`` under DDP;
- later releases route the loss through the wrapper themselves, or no longer have the method.

The obvious fix (route through TRL's ``_forward_redirection``) crashes: the Liger loss is a compiled
``torch.func`` loss and, with the reference head unfrozen, DDP's graph optimizer splits it inside the
transform ("Cannot access storage of TensorWrapper"). :func:`patch_trl` therefore wraps ``_compute_loss_liger``
wherever the installed trainer defines it, and decides on every call from what that call receives: the
wrapper itself (unwrapped with ``accelerator.unwrap_model`` and routed through it), the unwrapped model while
``compute_loss`` got a wrapper (routed through that wrapper), or a call already inside the wrapper's forward
(called as it is). No version number decides anything.

This module imports TRL only when :func:`patch_trl` runs; :class:`ForwardRedirection` never imports it.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..detect import detect
from ..route import Mode, route_loss

log = logging.getLogger("wrapperroute")

_MISSING = object()
# Where TRL releases keep the trainers with a Liger loss method (KTO was experimental before it moved): looked
# up in the installed package, each only if it is there.
_LIGER_TRAINERS = (
    ("trl.trainer.dpo_trainer", "DPOTrainer"),
    ("trl.trainer.kto_trainer", "KTOTrainer"),
    ("trl.experimental.kto.kto_trainer", "KTOTrainer"),
)
# (trainer class name, path) -> calls seen: what the patched method did (see _routed_liger).
liger_paths: dict[tuple[str, str], int] = {}


class ForwardRedirection:
    """Drop-in for TRL's ``_ForwardRedirection``, backed by :func:`wrapperroute.route_loss`.

    ``redirection(wrapper_module, original_module, method, *args, **kwargs)`` returns
    ``method(*args, **kwargs)`` computed inside ``wrapper_module``'s forward, like TRL's (Lightning's) class,
    and keeps its ``on_after_inner_forward``/``on_after_outer_forward`` hooks. Unlike it:

    - the module's ``forward`` is restored even when the wrapper or ``method`` raises, and no instance
      ``forward`` attribute is left behind;
    - a compiled ``torch.func`` method (Liger's chunked losses) that DDP's graph optimizer cannot split is
      rerun isolated from that optimizer (``mode="auto"``, see :func:`route_loss`);
    - for wrappers wrapperroute knows (DDP, FSDP1/2, DeepSpeed, under ``torch.compile`` too), the arguments
      reach ``method`` untouched: they are not moved or cast by the wrapper. Unknown wrappers get TRL's
      behaviour (arguments through the wrapper), with the restore above.
    """

    def __init__(self, mode: Mode = "auto") -> None:
        self.mode: Mode = mode

    def __call__(
        self, wrapper_module: nn.Module, original_module: nn.Module, method: Callable[..., Any], *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        found = detect(wrapper_module)
        if any(layer is original_module for layer in found.layers):
            # A partial keys route_loss's functorch fallback on ``method`` itself; a closure (only when a subclass
            # hooks in after the inner call) would share one key between every method redirected.
            fn: Callable[[], Any] = functools.partial(method, *args, **kwargs)
            if type(self).on_after_inner_forward is not ForwardRedirection.on_after_inner_forward:
                fn = functools.partial(self._then_inner_hook, wrapper_module, original_module, fn)
            output = route_loss(wrapper_module, original_module, fn, mode=self.mode)
        else:
            output = self._through_unknown(wrapper_module, original_module, method, args, kwargs)
        self.on_after_outer_forward(wrapper_module, original_module)
        return output

    def _then_inner_hook(self, wrapper: nn.Module, original: nn.Module, call: Callable[[], Any]) -> Any:
        out = call()
        self.on_after_inner_forward(wrapper, original)
        return out

    def _through_unknown(
        self, wrapper: nn.Module, original: nn.Module, method: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:  # fmt: skip
        """TRL's redirection, for a wrapper wrapperroute does not know, plus restore-on-exception."""
        saved = original.__dict__.get("forward", _MISSING)

        def restore() -> None:
            if saved is _MISSING:
                original.__dict__.pop("forward", None)
            else:
                original.__dict__["forward"] = saved

        def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
            restore()  # before ``method``: it may call the real forward itself
            out = method(*inner_args, **inner_kwargs)
            self.on_after_inner_forward(wrapper, original)
            return out

        original.__dict__["forward"] = forward
        try:
            return wrapper(*args, **kwargs)
        finally:
            restore()

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        pass

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        pass


@dataclass(frozen=True)
class TrlPatch:
    """What :func:`patch_trl` (or :func:`unpatch_trl`) left in place.

    ``patched`` names every attribute currently replaced (``"trl.trainer.dpo_trainer.DPOTrainer.compute_loss"``);
    ``note`` says why anything was left alone.
    """

    version: str | None
    patched: tuple[str, ...]
    note: str

    def __bool__(self) -> bool:
        return bool(self.patched)


# label -> (owner, attribute, original value): what to put back.
_applied: dict[str, tuple[Any, str, Any]] = {}
# The model ``compute_loss`` received (the wrapper), for the ``_compute_loss_liger`` call it makes.
_outer_model: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("wrapperroute_trl_outer", default=None)


def _set(label: str, owner: Any, attribute: str, value: Any) -> None:
    if label not in _applied:
        _applied[label] = (owner, attribute, owner.__dict__.get(attribute, _MISSING))
    setattr(owner, attribute, value)


def _routed_compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_loss(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        token = _outer_model.set(model)
        try:
            return original(self, model, *args, **kwargs)
        finally:
            _outer_model.reset(token)

    compute_loss.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return compute_loss


def _routed_liger(original: Callable[..., Any], mode: Mode) -> Callable[..., Any]:
    owner = original.__qualname__.split(".")[0]

    @functools.wraps(original)
    def _compute_loss_liger(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if detect(model).distributed:
            # This TRL passes the wrapper where its Liger code reads the model (``model.base_model``): give
            # it the model it expects, inside that wrapper's forward.
            inner = self.accelerator.unwrap_model(model)
            _seen(owner, "wrapper passed: unwrapped and routed")
            return route_loss(model, inner, functools.partial(original, self, inner, *args, **kwargs), mode=mode)
        outer = _outer_model.get()
        if outer is None or outer is model or not detect(outer).distributed:
            _seen(owner, "no wrapper: called as it is")
            return original(self, model, *args, **kwargs)
        # The unwrapped model while compute_loss got a wrapper: routed through it. Already inside its forward
        # (the trainer's own ZeRO-3/FSDP redirection), route_loss calls the loss as it is.
        _seen(owner, "unwrapped model passed: routed")
        return route_loss(outer, model, functools.partial(original, self, model, *args, **kwargs), mode=mode)

    _compute_loss_liger.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return _compute_loss_liger


def _seen(owner: str, path: str) -> None:
    key = (owner, path)
    liger_paths[key] = liger_paths.get(key, 0) + 1


def _trl_redirection_modules(cls: Any) -> list[Any]:
    """Every loaded ``trl`` module holding ``cls`` as ``_ForwardRedirection`` (trainers import it by name)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if (name == "trl" or name.startswith("trl.")) and module is not None
        and module.__dict__.get("_ForwardRedirection") is cls
    ]  # fmt: skip


def patch_trl(mode: Mode = "isolate", forward_redirection: bool = True) -> TrlPatch:
    """Make the installed TRL's trainers route their fused losses through wrapperroute. Idempotent.

    - DPO and KTO with ``use_liger_kernel=True``: wherever the installed trainer class defines
      ``_compute_loss_liger``, it is wrapped (with ``compute_loss``, which records the model it received) and
      routed per call as the module docstring says; a class without that method is left alone and named in the
      note. ``mode`` defaults to ``"isolate"``: both losses are compiled ``torch.func`` losses that DDP's
      graph optimizer can fail to split, so they skip it from the first call instead of failing once (a
      wasted compile) and falling back.
    - ``forward_redirection``: ``trl.models.utils._ForwardRedirection`` and every loaded TRL module's
      ``_ForwardRedirection`` become :class:`ForwardRedirection` (GRPO, distillation...), so trainers built
      from now on restore the forward on exceptions and get the functorch fallback.

    Returns what is patched now, with a note on what was left alone and why. Raises ``ImportError`` when TRL is
    not installed.
    """
    import trl

    version = str(getattr(trl, "__version__", "unknown"))
    notes: list[str] = []
    found = 0
    for module_name, class_name in _LIGER_TRAINERS:
        if not _importable(module_name):
            continue
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None:
            continue
        found += 1
        # Patched on the class that defines each method: a re-exported or subclassed trainer (KTO moved out of
        # trl.experimental) then shares one patch with the class it inherits from.
        liger_owner = _defining(cls, "_compute_loss_liger")
        if liger_owner is None:
            notes.append(
                f"{module_name}.{class_name} has no _compute_loss_liger (its Liger path, if any, is TRL's own): "
                "left alone"
            )
            continue
        loss_owner = _defining(cls, "compute_loss")
        for owner, attribute in ((liger_owner, "_compute_loss_liger"), (loss_owner, "compute_loss")):
            label = f"{owner.__module__}.{owner.__qualname__}.{attribute}"
            if label in _applied:
                continue
            original = owner.__dict__[attribute]
            liger = attribute == "_compute_loss_liger"
            _set(label, owner, attribute, _routed_liger(original, mode) if liger else _routed_compute_loss(original))
    if not found:
        notes.append(f"TRL {version} has no DPOTrainer or KTOTrainer")
    if forward_redirection:
        utils = importlib.import_module("trl.models.utils") if _importable("trl.models.utils") else None
        key = "trl.models.utils._ForwardRedirection"
        original = (
            _applied[key][2] if key in _applied else utils.__dict__.get("_ForwardRedirection", _MISSING)
            if utils is not None else _MISSING
        )  # fmt: skip
        if original is _MISSING:
            notes.append(f"TRL {version} has no _ForwardRedirection: nothing to replace")
        else:
            for module in _trl_redirection_modules(original):
                _set(f"{module.__name__}._ForwardRedirection", module, "_ForwardRedirection", ForwardRedirection)
    result = TrlPatch(version, tuple(_applied), "; ".join(notes))
    log.info("wrapperroute.patch_trl: patched %s%s", list(result.patched) or "nothing",
             f" ({result.note})" if result.note else "")  # fmt: skip
    return result


def _defining(cls: type, attribute: str) -> Any:
    """The class in ``cls``'s MRO that defines ``attribute`` itself, or None."""
    return next((c for c in cls.__mro__ if attribute in vars(c)), None)


def _importable(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def unpatch_trl() -> TrlPatch:
    """Undo :func:`patch_trl`. Trainers built while patched keep the redirection instance they made."""
    key = "trl.models.utils._ForwardRedirection"
    trl_class = _applied[key][2] if key in _applied else _MISSING
    for _label, (owner, attribute, original) in reversed(list(_applied.items())):
        if original is _MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)
    _applied.clear()
    if trl_class is not _MISSING:  # modules imported while patched took ours from trl.models.utils
        for module in _trl_redirection_modules(ForwardRedirection):
            module._ForwardRedirection = trl_class
    trl = sys.modules.get("trl")
    return TrlPatch(getattr(trl, "__version__", None) if trl else None, (), "unpatched")


__all__ = ["ForwardRedirection", "TrlPatch", "patch_trl", "unpatch_trl"]
