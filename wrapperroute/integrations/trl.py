"""TRL integration: a drop-in ``_ForwardRedirection`` and ``patch_trl()`` for TRL's trainers with a fused Liger
loss (DPO, KTO, GRPO, GKD, the distillation trainers...).

With ``use_liger_kernel=True`` these trainers compute their loss from the model's weights directly (the output
head's weight, a backbone called as a submodule). TRL releases differ in where that happens, and so in how
they fail (TRL issue #7245 and the TRL pull request that followed):

- outside the wrapper's forward: under DDP the reducer is never armed and every rank keeps its own gradients (a
  silent desync); under ZeRO-3 a head read outside any gather has 0 elements (GKD);
- with the wrapper itself where the Liger code reads ``model.base_model``: ``AttributeError`` under DDP;
- the reference model's backbone called without its FSDP2 root's forward: ``mixed torch.Tensor and DTensor``
  (DPO and KTO under FSDP2);
- later releases route the loss through the wrapper themselves.

:func:`patch_trl` finds the trainers by reading the installed package (the modules with a Liger path: their
source reads ``use_liger_kernel``) and decides on every call from what the call receives: a trainer that holds
a fused linear loss (a parameter-free module whose ``forward`` takes a layer's weight: Liger's chunked losses
and TRL's own copies of them alike) and got a distributed wrapper runs its whole ``compute_loss`` inside that
wrapper's forward, while each other distributed model it holds (reference, teacher) has its weights held
whole; a ``_compute_loss_liger`` given the wrapper gets the model it expects; a gather of the ZeRO-3 heads held
around the whole training step starts with the loss, after the step's generation. No version number or class
name decides anything.

The obvious fix (route through TRL's ``_forward_redirection``) crashes: the Liger losses are compiled
``torch.func`` losses, and DDP's graph optimizer splits them inside the transform ("Cannot access storage of
TensorWrapper"); the patch runs them isolated from that optimizer.

Later releases install a fused LM head in the model itself (``trl.trainer.utils.add_fused_lm_head``:
``model(..., fused_lm_head=True)`` runs the backbone, then reads the head's weight directly, never calling the
head, and gathers a ``DTensor`` head with ``full_tensor()``). Inside the wrapper's forward, so DDP is armed; but on
a head in its own FSDP2 unit, which only its own forward unshards, the gradient comes back through DTensor's
redistribution instead of FSDP2's reduce-scatter: consistent across ranks and wrong (``wrapperroute.arrivals``);
and a head split on the vocabulary over tensor-parallel ranks is gathered whole at every call. :func:`patch_trl`
wraps that installer where the installed package has it: the forward it installs runs, with
``fused_lm_head=True``, inside the forward of the FSDP2 unit holding the head, and computes a vocabulary-sharded
head from its shard (``_fused_head``).

This module imports TRL only when :func:`patch_trl` runs; :class:`ForwardRedirection` never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from .._head import output_embedding
from .._routing.swap import MISSING
from ..adapters import ReadWhole
from ..adapters.fsdp2 import own_hooks_only
from ..detect import detect
from ..route import Mode, route_loss
from . import _fused_head as fused_head
from ._redirection import ForwardRedirection
from ._router_loss import warn_if_router_loss_dropped

log = logging.getLogger("wrapperroute")

# Which path each patched call took ("DPOTrainer: routed whole inside DistributedDataParallel"), said at DEBUG:
# what ``wrapperroute check --trl`` counts. Left at its default level, it costs a level check per call.
paths = logging.getLogger("wrapperroute.trl.paths")
# Frozen models a trainer may hold whose weights its loss reads directly, outside their forward.
_COMPANIONS = ("ref_model", "teacher_model")
# The switch of every Liger path in TRL: a trainer module without it has none.
_LIGER_SWITCH = "use_liger_kernel"
# TRL's installer of a fused LM head in the model (``model(..., fused_lm_head=True)``), where a release has one.
_FUSED_HEAD = "add_fused_lm_head"
# class -> whether its instances are fused linear losses (see _reads_weights)
_fused_classes: dict[type, bool] = {}


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


def _set(label: str, owner: Any, attribute: str, value: Any) -> None:
    if label not in _applied:
        _applied[label] = (owner, attribute, owner.__dict__.get(attribute, MISSING))
    setattr(owner, attribute, value)


def _took(owner: str, path: str) -> None:
    paths.debug("%s: %s", owner, path)


def _holds_fused_loss(trainer: Any) -> bool:
    """Whether ``trainer`` holds a fused linear loss (it reads a layer's weight directly), read off the
    instance."""
    return any(_reads_weights(value) for value in vars(trainer).values())


def _reads_weights(value: Any) -> bool:
    """A parameter-free module whose ``forward`` takes a layer's weight (``lin_weight``, ``student_weight``...):
    the shape of Liger's chunked losses and of TRL's copies of them, whatever their names or modules."""
    cls = type(value)
    known = _fused_classes.get(cls)
    if known is None:
        try:
            names = inspect.signature(cls.forward).parameters if issubclass(cls, nn.Module) else ()
        except (TypeError, ValueError):
            names = ()
        known = _fused_classes[cls] = any(name == "weight" or name.endswith("_weight") for name in names)
    return known and next(value.parameters(), None) is None


def _routed_compute_loss(original: Callable[..., Any], mode: Mode) -> Callable[..., Any]:
    owner = original.__qualname__.split(".")[0]
    module_name = original.__module__

    @functools.wraps(original)
    def compute_loss(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fused = _holds_fused_loss(self)
        if fused:
            warn_if_router_loss_dropped(self, self.accelerator.unwrap_model(model), module_name)
        if not detect(model).distributed:
            _took(owner, "no wrapper: called as it is")
            return original(self, model, *args, **kwargs)
        if not fused:
            _took(owner, "no fused Liger loss: called as it is")
            return original(self, model, *args, **kwargs)
        redirection = getattr(self, "_forward_redirection", None)
        if redirection is not None and not isinstance(redirection, ForwardRedirection):
            # built before patch_trl: TRL's class would call the wrapper again from inside its forward
            self._forward_redirection = ForwardRedirection()
        start_gather = _pending_gathers.pop(id(self), None)
        if start_gather is not None:
            start_gather()  # before the companions: their heads, once gathered here, are left as they are
        held = [type(model).__name__]
        with contextlib.ExitStack() as stack:
            for attribute in _COMPANIONS:
                companion = getattr(self, attribute, None)
                found = detect(companion) if isinstance(companion, nn.Module) else None
                if found is not None and isinstance(found.adapter, ReadWhole) and found.wrapper is not None:
                    stack.enter_context(found.adapter.read_whole(found.wrapper))
                    held.append(attribute)
            _took(owner, f"routed whole inside {held[0]}" + "".join(f", {name} held whole" for name in held[1:]))
            inner = self.accelerator.unwrap_model(model)
            call = functools.partial(original, self, model, *args, **kwargs)
            return route_loss(model, inner, call, mode=mode)

    compute_loss.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return compute_loss


def _unwrapping_liger(original: Callable[..., Any]) -> Callable[..., Any]:
    owner = original.__qualname__.split(".")[0]

    @functools.wraps(original)
    def _compute_loss_liger(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner = self.accelerator.unwrap_model(model)
        if inner is not model:
            # This TRL passes the wrapper where its Liger code reads the model (``model.base_model``): give it the
            # model it expects (compute_loss runs it inside that wrapper's forward already).
            _took(owner, "wrapper passed: unwrapped")
        return original(self, inner, *args, **kwargs)

    _compute_loss_liger.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return _compute_loss_liger


# id(trainer) -> enters TRL's head gather into the running step, once: called by the routed loss (see
# _head_gather_deferred). By id: some releases' trainers are unhashable (KTO 1.0-1.1); the step removes it.
_pending_gathers: dict[int, Callable[[], Any]] = {}


def _head_gather_deferred(original: Callable[..., Any]) -> Callable[..., Any]:
    owner = original.__qualname__.split(".")[0]

    @functools.wraps(original)
    @contextlib.contextmanager
    def gather_context(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
        gather = original(self, model, *args, **kwargs)  # DeepSpeed gathers on entering, not before
        if isinstance(gather, contextlib.nullcontext) or not (detect(model).distributed and _holds_fused_loss(self)):
            with gather:
                yield
            return
        # TRL holds the heads gathered through the whole training step, for the loss's forward and backward.
        # The step's on-policy generation, inside it, gathers every parameter, which DeepSpeed refuses to nest
        # ("Nested GatheredParameters contexts cannot overlap"): the routed loss enters TRL's gather when it
        # runs, after the generation, and the step leaves it, as TRL's does.
        _took(owner, "head gather from the loss to the end of the step")
        with contextlib.ExitStack() as step:
            _pending_gathers[id(self)] = functools.partial(step.enter_context, gather)
            try:
                yield
            finally:
                _pending_gathers.pop(id(self), None)

    gather_context.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return gather_context


def _fused_head_routed(original: Callable[..., Any]) -> Callable[..., Any]:
    """TRL's ``add_fused_lm_head``, then its forward wrapped. With ``fused_lm_head=True``:

    - run inside the forward of the head's FSDP2 unit (``route_loss`` through that unit, FSDP2's hooks only:
      tensor parallelism's would take wrapperroute's call for the head's input), where the head is unsharded and
      its gradient goes through FSDP2's reduce-scatter;
    - where the head, as that forward sees it, is split on the vocabulary over tensor-parallel ranks (a reference
      model's in a no-grad forward too), computed from its shard
      (:func:`~wrapperroute.integrations._fused_head.vocab_parallel_forward`, TRL's settings as installed).

    Everything else is TRL's forward. Looked up on each call, since FSDP and tensor parallelism are applied after
    TRL installs the head."""
    output_class = getattr(sys.modules.get(original.__module__), "FusedCausalLMOutput", None)

    @functools.wraps(original)
    def add_fused_lm_head(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = original(model, *args, **kwargs)
        fused = model.__dict__.get("forward")
        if fused is None:  # not installed as an instance forward: left as TRL made it
            _took("add_fused_lm_head", "no instance forward installed: left alone")
            return result
        settings = fused_head.installed_settings(fused)

        def head_as_read(*call_args: Any, **call_kwargs: Any) -> Any:
            head = output_embedding(model)
            if head is not None and fused_head.vocab_sharded(head.weight):
                if settings is not None and output_class is not None:
                    _took("add_fused_lm_head", "fused head computed on its vocabulary shard")
                    return fused_head.vocab_parallel_forward(model, output_class, settings, *call_args, **call_kwargs)
                _said_once(
                    "wrapperroute: TRL's fused LM head installed here does not keep the settings this version reads "
                    f"({', '.join(fused_head.SETTINGS)}): a head split on the vocabulary is gathered whole on every "
                    "rank, as TRL does (exact, at the memory and traffic of the whole head)"
                )
            return fused(*call_args, fused_lm_head=True, **call_kwargs)

        @functools.wraps(fused)
        def forward(*call_args: Any, fused_lm_head: bool = False, **call_kwargs: Any) -> Any:
            if not fused_lm_head:
                return fused(*call_args, fused_lm_head=False, **call_kwargs)
            unit = fused_head.head_unit(model)
            if unit is not None:
                _took("add_fused_lm_head", "fused head read inside its FSDP2 unit's forward")
                with own_hooks_only(unit):
                    return route_loss(unit, unit, head_as_read, *call_args, **call_kwargs)
            return head_as_read(*call_args, **call_kwargs)

        forward.__wrapperroute_original__ = fused  # type: ignore[attr-defined]
        model.forward = forward
        return result

    add_fused_lm_head.__wrapperroute_original__ = original  # type: ignore[attr-defined]
    return add_fused_lm_head


_said: set[str] = set()


def _said_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _trl_modules_holding(name: str, value: Any) -> list[Any]:
    """Every loaded ``trl`` module holding ``value`` as ``name`` (trainers import TRL's helpers by name)."""
    return [
        module
        for module_name, module in list(sys.modules.items())
        if (module_name == "trl" or module_name.startswith("trl.")) and module is not None
        and module.__dict__.get(name) is value
    ]  # fmt: skip


def _trl_redirection_modules(cls: Any) -> list[Any]:
    """Every loaded ``trl`` module holding ``cls`` as ``_ForwardRedirection`` (trainers import it by name)."""
    return _trl_modules_holding("_ForwardRedirection", cls)


def fused_loss_trainers(notes: list[str] | None = None) -> list[type]:
    """The installed TRL's trainer classes defined in a module with a Liger path (its source reads
    ``use_liger_kernel``): found by reading the package's files (no list of names or versions), then importing
    only those modules. A module that fails to import is named in ``notes``, or, without ``notes``, in a
    ``RuntimeWarning``."""
    import pathlib

    from transformers import Trainer

    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return []
    root = pathlib.Path(spec.origin).parent
    found: list[type] = []
    for path in sorted(root.rglob("*.py")):
        if _LIGER_SWITCH not in path.read_text(encoding="utf-8", errors="ignore"):
            continue
        name = ".".join(("trl", *path.relative_to(root).with_suffix("").parts))
        try:
            module = importlib.import_module(name)
        except Exception as error:  # an optional dependency of an experimental trainer, say
            said = f"{name} not imported ({type(error).__name__}: {error}): its trainers left alone"
            if notes is not None:
                notes.append(said)
            else:
                warnings.warn(f"wrapperroute: {said}", RuntimeWarning, stacklevel=2)
            continue
        found += [
            value for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, Trainer) and value.__module__ == name
        ]  # fmt: skip
    return found


def patch_trl(mode: Mode = "isolate", forward_redirection: bool = True) -> TrlPatch:
    """Make the installed TRL's trainers with a fused Liger loss exact under every wrapper. Idempotent.

    - Every trainer class defined in a module of the installed TRL with a Liger path (see
      :func:`fused_loss_trainers`): ``compute_loss`` is wrapped on the class that defines it and, on each call
      where the trainer holds a fused linear loss and received a distributed wrapper, runs whole inside that
      wrapper's forward, while each distributed reference or teacher model it holds has its weights held whole
      (``ReadWhole.read_whole``: FSDP2 root, ZeRO-3 head); ``_compute_loss_liger``, where a class defines it, is
      given the unwrapped model when a release passes it the wrapper; ``_get_liger_zero3_lm_head_gather_ctx``,
      where a class defines it, gathers from the routed loss to the end of the step (its on-policy generation,
      earlier in the step, gathers every parameter: DeepSpeed refuses the two nested). ``mode`` defaults to
      ``"isolate"``: the losses are compiled ``torch.func`` losses that DDP's graph optimizer can fail to
      split, so they skip it from the first call instead of failing once (a wasted compile) and falling back.
    - ``forward_redirection``: ``trl.models.utils._ForwardRedirection`` and every loaded TRL module's
      ``_ForwardRedirection`` become :class:`ForwardRedirection`, so trainers built from now on restore the
      forward on exceptions; a trainer built before, whose loss is routed whole, gets ours at its next step.

    Under mixed precision the loss then runs inside the autocast that accelerate wraps the model's forward in,
    as a normal forward of the model does (the Liger paths of TRL, which call the backbone directly, skip it).

    Returns what is patched now, with a note on what was left alone and why. Raises ``ImportError`` when TRL is
    not installed.
    """
    import trl

    version = str(getattr(trl, "__version__", "unknown"))
    notes: list[str] = []
    trainers = fused_loss_trainers(notes)
    for cls in trainers:
        # Patched on the class that defines each method: a re-exported or subclassed trainer (KTO moved out of
        # trl.experimental, MiniLLM extends GRPO) shares one patch with the class it inherits from.
        for attribute, wrap in (("compute_loss", functools.partial(_routed_compute_loss, mode=mode)),
                                ("_compute_loss_liger", _unwrapping_liger),
                                ("_get_liger_zero3_lm_head_gather_ctx", _head_gather_deferred)):  # fmt: skip
            owner = _defining(cls, attribute)
            if owner is None or owner.__module__.startswith("transformers"):
                continue  # no such method, or the Trainer's own compute_loss (no fused loss of TRL's there)
            label = f"{owner.__module__}.{owner.__qualname__}.{attribute}"
            if label not in _applied:
                _set(label, owner, attribute, wrap(owner.__dict__[attribute]))
    if not trainers:
        notes.append(f"TRL {version} has no trainer with a fused Liger loss")
    helpers = importlib.import_module("trl.trainer.utils") if _importable("trl.trainer.utils") else None
    key = f"trl.trainer.utils.{_FUSED_HEAD}"
    installer: Any = _applied[key][2] if key in _applied else getattr(helpers, _FUSED_HEAD, MISSING)
    if installer is MISSING:
        notes.append(f"TRL {version} has no {_FUSED_HEAD}: no fused head in the model to patch")
    else:
        wrapped = _fused_head_routed(installer)
        for module in _trl_modules_holding(_FUSED_HEAD, installer):
            _set(f"{module.__name__}.{_FUSED_HEAD}", module, _FUSED_HEAD, wrapped)
    if forward_redirection:
        utils = importlib.import_module("trl.models.utils") if _importable("trl.models.utils") else None
        key = "trl.models.utils._ForwardRedirection"
        original = (
            _applied[key][2] if key in _applied else utils.__dict__.get("_ForwardRedirection", MISSING)
            if utils is not None else MISSING
        )  # fmt: skip
        if original is MISSING:
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
    trl_class = _applied[key][2] if key in _applied else MISSING
    for _label, (owner, attribute, original) in reversed(list(_applied.items())):
        if original is MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)
    _applied.clear()
    if trl_class is not MISSING:  # modules imported while patched took ours from trl.models.utils
        for module in _trl_redirection_modules(ForwardRedirection):
            module._ForwardRedirection = trl_class
    trl = sys.modules.get("trl")
    return TrlPatch(getattr(trl, "__version__", None) if trl else None, (), "unpatched")


__all__ = ["ForwardRedirection", "TrlPatch", "fused_loss_trainers", "patch_trl", "unpatch_trl"]
