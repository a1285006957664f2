"""Rank bodies for tests/test_reliability.py: edge cases of gather=, layered wrappers and instance forwards, one
function a case."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import route_loss


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.lm_head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(x)))


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def agree_gather_iterator() -> None:
    """agree=True with a one-shot iterator for gather= (FSDP2: embed and lm_head in their own groups): the loss
    sees embed unsharded with and without agree (agree=True reran the call with the iterator already used up:
    embed stayed sharded, a DTensor)."""
    from wrapperroute.check.wrap_fsdp import fsdp2_api

    fully_shard, mesh = fsdp2_api().fully_shard, _mesh()
    sharded = _Three()
    for unit in (sharded.embed, sharded.lm_head, sharded):
        fully_shard(unit, mesh=mesh)
    for agree in (False, True):
        seen = route_loss(
            sharded, None, lambda: type(sharded.embed.weight).__name__, gather=iter([sharded.embed]), agree=agree
        )
        assert seen == "Parameter", f"agree={agree}: the loss saw embed.weight as a {seen}, not gathered"


def two_wrappers_restored() -> None:
    """Two DDP wrappers over one module, a no-grad route through the second inside a loss routed through the
    first: no forward left on either wrapper or the module (the second took the passthrough's slot, and the
    first kept the passthrough for good), and both usable."""
    left = _two_wrappers(torch.randn(2, 4))
    assert left == [False, False, False], f"a forward left on [first, second, module]: {left}"


def kept_autocast() -> None:
    """An autocast instance forward (accelerate's AMP shape) removed for one step and the same one put back: the
    loss runs in it, then not, then in it again."""
    seen = _kept_autocast(torch.randn(2, 4))
    expected = ["torch.bfloat16", "torch.float32", "torch.bfloat16"]
    assert seen == expected, f"the loss's dtype with the autocast forward present, absent, present: {seen}"


def plain_thread_after_loss() -> None:
    """A plain model(x) in another thread that read the wrapper's forward while a loss ran, then ran it after
    that loss ended: it runs as a plain call."""
    result = _plain_thread(torch.randn(2, 4))
    assert result == {"shape": [2, 4]}, f"the plain call in the other thread: {result}"


def sharded_after_first_call() -> None:
    """A model first routed through a torch.compile layer with no wrapper, then fully_shard-ed: the next loss
    runs inside FSDP2's forward."""
    from wrapperroute.check.wrap_fsdp import fsdp2_api

    late = nn.Linear(4, 4)
    compiled = torch.compile(late, backend="eager")
    route_loss(compiled, late, lambda: None)  # planned: no wrapper yet
    fsdp2_api().fully_shard(late, mesh=_mesh())
    state = route_loss(compiled, late, lambda: late._get_fsdp_state()._training_state.name)  # type: ignore[operator]
    assert state == "FORWARD", f"the loss ran in FSDP2's {state} state, not inside its forward"


def _two_wrappers(x: torch.Tensor) -> list[bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = nn.Linear(4, 4)
    first, second = DDP(module), DDP(module)

    def outer() -> torch.Tensor:
        with torch.no_grad():
            route_loss(second, module, lambda: module(x).sum())
        return module(x).sum()

    route_loss(first, module, outer).backward()
    left = [w.__dict__.get("forward") for w in (first, second, module)]
    first(x).sum().backward()  # a plain step: usable
    route_loss(first, module, lambda: module(x).sum()).backward()
    return [f is not None for f in left]


def _kept_autocast(x: torch.Tensor) -> list[str]:
    import types

    from torch.nn.parallel import DistributedDataParallel as DDP

    amp = nn.Linear(4, 4)
    amp_ddp = DDP(amp)
    autocast_forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(amp).forward), amp)

    def dtype() -> str:  # a fused loss reads the weight itself: its matmul runs in the kept autocast, or not
        return str((x @ amp.weight.t()).dtype)

    seen = []
    for present in (True, False, True):
        if present:
            amp.forward = autocast_forward  # type: ignore[method-assign]
        else:
            del amp.forward
        with torch.no_grad():
            seen.append(route_loss(amp_ddp, amp, dtype))
    return seen


def _plain_thread(x: torch.Tensor) -> dict[str, Any]:
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = nn.Linear(4, 4)
    plain_ddp = DDP(plain, broadcast_buffers=False)
    in_loss, resolved, loss_done = threading.Event(), threading.Event(), threading.Event()

    def hold(_module: nn.Module, _args: Any) -> None:
        if threading.current_thread().name == "plain":
            resolved.set()  # _call_impl has read self.forward (the passthrough) already
            loss_done.wait(10)

    handle = plain_ddp.register_forward_pre_hook(hold)
    result: dict[str, Any] = {}

    def routed() -> None:
        def fn() -> torch.Tensor:
            in_loss.set()
            resolved.wait(10)
            return plain(x).sum()

        with torch.no_grad():
            route_loss(plain_ddp, plain, fn)
        loss_done.set()

    def plain_call() -> None:
        in_loss.wait(10)
        try:
            with torch.no_grad():
                result["shape"] = list(plain_ddp(x).shape)
        except Exception as error:  # the thing under test
            result["error"] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=routed), threading.Thread(target=plain_call, name="plain")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    handle.remove()
    return result
