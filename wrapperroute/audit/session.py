"""The audit inside one rank: torch's global optimizer hooks, which steps to audit, what was found.

Around an audited optimizer step (torch's global optimizer step hooks, so every optimizer, wrapped ones too),
every replica's gradient and parameter is compared across ranks (``replicas.py``): read before the step, their
signatures travel while it runs, and the verdict comes after it (a suspect's gradient is read whole then,
unchanged by the step; a suspect parameter as updated). The gradients say
whether this step's synchronisation happened, the parameters whether any earlier step or anything else
(a rank skipping a step, different data in a buffer) made the replicas drift. With ``--steps all``, the
parameters are compared on every 8th audited step, and each step's gradient signatures read one eighth of
each large gradient (see ``PARAMS_EVERY``). When the script ends, or destroys the default process group,
the parameters are compared once more. Every collective runs on a side gloo group of its own, so none ever
pairs with the script's; nothing is written to any tensor, and no random number is drawn, so the script's
numerics are those of a run without the audit.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import traceback
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import crossrank
from .._groups import initialized, side_group, world_size
from ..adapters import Topology
from ..adapters.fsdp2 import managed_params, on_fully_shard
from ..arrivals import Arrivals, Watch, agree, watch
from ..crossrank import Outcome, Pending, replica_rows
from ..errors import GradSyncError
from .replicas import CREATION_ORDER, Found, replicas, wrappers
from .report import Checkpoint, final_line, format_checkpoint, report

OnDesync = Literal["exit", "raise", "warn"]
DESYNC_EXIT = 3  # the exit status of a run in which a desync was found
AUDIT_FAILED_EXIT = 4  # the audit itself failed (the script ran on, unaudited), and found no desync before
# Auditing every step (``--steps all``), the parameters are compared whole on every 8th audited step (and at
# the end), and each step's gradient signatures read one eighth of each large gradient, a different eighth
# each step: reading whole tensors is what an audited step costs (memory, not arithmetic), a drift of the
# parameters persists until it is seen, and a step whose synchronisation did not happen differs everywhere.
PARAMS_EVERY = 8


class DesyncExit(SystemExit):
    """``--on-desync exit``: ends the script at the first desynced step, on every rank."""


class AuditDesyncError(GradSyncError):
    """``--on-desync raise``: the audit found replicas differing (a ``GradSyncError`` the script raises itself,
    from ``wrapperroute.guard``, is the script's failure, not the audit's finding)."""


class Audit:
    def __init__(self, steps: int | None, on_desync: OnDesync, json_path: str | None, group: Any = None) -> None:
        self.steps = steps  # audit each optimizer's first ``steps`` steps; None: every step
        self.on_desync: OnDesync = on_desync
        self.json_path = json_path
        self.checkpoints: list[Checkpoint] = []
        self.kinds: set[str] = set()
        self.alone: dict[str, int] = {}  # trainable parameters with no copy on another rank, by why (last scan)
        self._compared_at_start = False  # the parameters compared once before the run's first optimizer step
        self.finished = False
        self.end_missed = False  # the last comparison found no wrapper alive to compare
        self.stepped = False  # some optimizer stepped while several ranks ran
        self.failure: str | None = None  # the audit's own error, once it failed (it audits nothing after)
        self._group = group  # the gloo group comparisons run on; None: a side group of our own
        self._exchange = crossrank.Exchange()
        # optimizer id -> (label, comparison, how the sharded gradients arrived) started before its step, finished
        # after it
        self._pending: dict[int, tuple[str, Pending, Arrivals]] = {}
        # each wrapper whose sharded gradients it assigns itself -> their watch (arrivals.py), from its first scan
        self._watches: weakref.WeakKeyDictionary[nn.Module, Watch] = weakref.WeakKeyDictionary()
        # optimizer -> (index in this run's first-step order, steps seen); held weakly: a new optimizer may
        # reuse a dead one's id, and a run after a re-initialised process group starts afresh
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._optimizers_seen = self._optimizers_in_run = 0
        # The wrappers found by the last scan of the process's objects (weakly: the audit keeps no model alive).
        # Scanned again for an optimizer not seen before, or when one of them is gone.
        self._wrappers: list[tuple[Topology, weakref.ref[nn.Module]]] | None = None
        # optimizer -> the wrappers' own step counts at its last step (see _same_training_step)
        self._step_counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int | None, ...]] = (
            weakref.WeakKeyDictionary()
        )
        self._undo: list[Any] = []

    # --- installing -------------------------------------------------------------------------------------

    def install(self) -> None:
        for register, hook in ((register_optimizer_step_pre_hook, self._before_step),
                               (register_optimizer_step_post_hook, self._after_step)):  # fmt: skip
            self._undo.append(register(hook).remove)
        counter = itertools.count(1)
        init = DistributedDataParallel.__init__

        def stamped(ddp: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
            init(ddp, *args, **kwargs)
            ddp.__dict__[CREATION_ORDER] = next(counter)  # creation order: the same on every rank

        DistributedDataParallel.__init__ = stamped  # type: ignore[method-assign,assignment]
        self._undo.append(lambda: setattr(DistributedDataParallel, "__init__", init))
        # FSDP2's shards watched from their making, so the first step's gradients are checked too (arrivals.py)
        self._undo.append(on_fully_shard(self._watch_from_the_start))
        destroy = dist.destroy_process_group

        def destroy_after_audit(group: Any = None) -> None:
            if group is None:
                self.finish()  # the last comparison needs the group the script is about to destroy
            destroy(group)
            if group is None:
                self._next_process_group()

        dist.destroy_process_group = destroy_after_audit
        self._undo.append(lambda: setattr(dist, "destroy_process_group", destroy))

    def _watch_from_the_start(self, units: list[nn.Module]) -> None:
        with self._guarded():  # inside the script's own fully_shard call: an error of ours must not end it
            watch(managed_params(units))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _next_process_group(self) -> None:
        """The default group is gone: a script that initialises another (a sweep of runs in one process) is
        audited afresh on it, its wrappers scanned again, its comparisons on a side group of its own."""
        if self.failure is None and not isinstance(self._group, _Destroyed):
            self.finished = False
        self._pending.clear()
        self._optimizers = weakref.WeakKeyDictionary()
        self._optimizers_in_run = 0
        self._exchange = crossrank.Exchange()
        self._wrappers = None
        self._compared_at_start = False
        if self._group is not None:
            self._group = _Destroyed()

    # --- auditing ---------------------------------------------------------------------------------------

    def _running(self) -> bool:
        return world_size() > 1

    def _side_group(self) -> Any:
        if self._group is None:  # made by every rank at the same point: their first audited step
            return side_group(backend="gloo")
        return self._group

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self._guarded():
            self._finish_pending(id(optimizer))  # a step that raised never reached _after_step
            known = self._optimizers.get(optimizer)
            # An optimizer's first step rescans the process for wrappers, here and only here: the scan is most of
            # what a fresh audit costs, and the comparison below reuses it
            if self._same_training_step(optimizer, rescan=known is None):
                return  # a wrapper stepping this optimizer again within one of its steps (DeepSpeed's groups)
            if known is None:
                known = (self._optimizers_in_run, 0)
                self._optimizers_in_run += 1
                self._optimizers_seen += 1
            index, seen = known
            self._optimizers[optimizer] = (index, seen + 1)
            if self.finished or not self._running():
                return
            self.stepped = True
            if self.steps is not None and seen >= self.steps:
                return
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            label = f"step {seen + 1}" + (f" of optimizer {index + 1}" if index else "")
            every = self.steps is None
            params = not every or seen % PARAMS_EVERY == 0
            window = (seen % PARAMS_EVERY, PARAMS_EVERY) if every else None
            found = self._replicas(rescan=False)  # rescanned above on this optimizer's first step
            if found.replicas and not self._compared_at_start:
                # Once, before anything steps: a replica that starts different is a desync even if the run later
                # makes every copy alike (a NaN spread by the all-reduce), which a comparison read after the
                # step would miss. Read whole now, not after the step as the deferred comparisons are.
                self._compared_at_start = True
                self._record(f"before {label}", self._compare(found.replicas).result())
            # Every rank holds the same kinds of wrapper, as for the comparison: the looks are exchanged among all
            arrivals = self._arrivals(found) if found.assigned else Arrivals()
            if found.replicas:  # the signatures exchanged while the optimizer steps; the verdict after it
                self._pending[id(optimizer)] = (label, self._compare(found.replicas, params, ids, window), arrivals)
            elif found.kinds:  # every parameter sharded: how their gradients arrived is what there is to audit
                self._record(label, Outcome(compared=0), arrivals)

    def _same_training_step(self, optimizer: torch.optim.Optimizer, rescan: bool) -> bool:
        """Whether this call of ``optimizer.step`` belongs to the training step its last call began: a wrapper
        that steps it in parts (``Topology.step_count``) has not counted a step since. The model is then half
        updated, and no comparison may read it."""
        if not self._running() or self.finished:
            return False
        counts = tuple(adapter.step_count(wrapper, optimizer) for adapter, wrapper in self._known(rescan))
        if all(count is None for count in counts):
            return False
        again = self._step_counts.get(optimizer) == counts
        self._step_counts[optimizer] = counts
        return again

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self._guarded():
            self._finish_pending(id(optimizer))

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """The audit must never end the run it watches: an error of its own (not a desync it reports) is
        recorded, said once, and the audit stops; the script goes on."""
        try:
            yield
        except (DesyncExit, AuditDesyncError):
            raise
        except Exception as error:
            if self.failure is None:
                self.failure = f"{type(error).__name__}: {error}"
                if rank() == 0:
                    print("wrapperroute audit: the audit itself failed (the script goes on, unaudited):\n"
                          + traceback.format_exc(), file=sys.stderr, flush=True)  # fmt: skip
            self.finished = True
            self._pending.clear()

    def _finish_pending(self, key: int | None = None) -> None:
        """Finish the comparison started before ``key``'s step (None: every one, in the order started)."""
        for pending in [key] if key is not None else list(self._pending):
            started = self._pending.pop(pending, None)
            if started is not None:
                label, comparison, arrivals = started
                self._record(label, comparison.result(), arrivals)

    def finish(self) -> None:
        """The last comparison (parameters only). Every rank calls it, once per process group."""
        if self.finished:
            return
        with self._guarded():
            if self._running():
                self._finish_pending()
            self._pending.clear()
            self.finished = True
            if self._running() and self.checkpoints:
                found = self._replicas(rescan=False)
                if found.replicas:
                    self._record("end", self._compare(found.replicas).result())
                elif not found.kinds:  # the script's models were freed before it ended: said in the final line
                    self.end_missed = True

    def _known(self, rescan: bool) -> list[tuple[Topology, nn.Module]]:
        alive = [(adapter, ref()) for adapter, ref in self._wrappers or ()]
        if rescan or self._wrappers is None or any(wrapper is None for _, wrapper in alive):
            found = wrappers()
            self._wrappers = [(adapter, weakref.ref(wrapper)) for adapter, wrapper in found]
            return found
        return alive  # type: ignore[return-value]  # checked: none is None

    def _replicas(self, rescan: bool) -> Found:
        # Every rank decides to rescan at the same points (same optimizers, same steps), so the wrapper lists,
        # and with them the keys compared, stay the same on every rank.
        found = replicas(self._known(rescan))
        self.kinds.update(found.kinds)
        self.alone = found.alone
        return found

    def _arrivals(self, found: Found) -> Arrivals:
        """How each sharded gradient arrived since the last look, agreed by every rank (collective). A wrapper
        seen for the first time is watched from now: its first look verifies nothing."""
        looks = []
        for prefix, kind, wrapper, assigned in found.assigned:
            watch = self._watches.get(wrapper)
            if watch is None:
                watch = self._watches[wrapper] = Watch(kind, assigned.reduction, assigned.params)
            looks.append((watch, prefix, watch.look()))
        return agree(looks, self._side_group())

    def _compare(self, found: list[Any], params: bool = True, grads_of: set[int] | None = None,
                 window: tuple[int, int] | None = None) -> Pending:  # fmt: skip
        """Compare ``found``'s parameters (and the gradients of ``grads_of``) with their copies: the signatures
        read now and sent on their way, the verdict from ``result()``. Two kinds of comparison alternate
        (gradients alone, gradients with parameters), each in its own slot of the run's exchange, so a comparison
        like the last one costs one collective."""
        rows = replica_rows(found, params=params, grads_of=grads_of, window=window)
        return crossrank.compare_later(rows, self._side_group(), exchange=self._exchange, slot=params)

    def _record(self, label: str, outcome: Outcome, arrivals: Arrivals | None = None) -> None:
        arrivals = arrivals or Arrivals()
        checkpoint = Checkpoint(label, outcome.compared, outcome.mismatches, outcome.nonfinite, arrivals.verified,
                                list(arrivals.bypassed))  # fmt: skip
        self.checkpoints.append(checkpoint)
        if checkpoint.found:
            self._desync(checkpoint)

    def _desync(self, checkpoint: Checkpoint) -> None:
        table = format_checkpoint(checkpoint)
        if self.on_desync == "exit":
            if dist.get_rank() == 0:
                print(table + "\n", end="", flush=True)  # one write
            self.finished = True
            raise DesyncExit(DESYNC_EXIT)
        message = f"wrapperroute audit: {checkpoint.finding} at {checkpoint.label}\n{table}"
        if self.on_desync == "raise":
            raise AuditDesyncError(message)
        if dist.get_rank() == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # --- reporting --------------------------------------------------------------------------------------

    @property
    def optimizers_seen(self) -> int:
        return self._optimizers_seen

    @property
    def desync(self) -> bool:
        """Whether some checkpoint found something: replicas differing, or a gradient around its reduction."""
        return any(c.found for c in self.checkpoints)

    def final_line(self, script_failed: str | None = None) -> str:
        return final_line(self, script_failed)

    def report(self, final: str, exit_status: int) -> dict[str, Any]:
        return report(self, final, exit_status)

    def write_json(self, final: str, exit_status: int) -> None:
        if self.json_path:
            with open(self.json_path, "w") as out:
                json.dump(self.report(final, exit_status), out, indent=1, allow_nan=False)


class _Destroyed:
    """The group an audit was given, after the script destroyed the default group: nothing more to audit on."""


def rank() -> int:
    """This process's rank: the process group's, else the launcher's (after the script destroyed the group)."""
    return dist.get_rank() if initialized() else int(os.environ.get("RANK", "0"))


__all__ = [
    "AUDIT_FAILED_EXIT", "DESYNC_EXIT", "Audit", "AuditDesyncError", "Checkpoint", "DesyncExit", "format_checkpoint",
    "rank",
]  # fmt: skip
