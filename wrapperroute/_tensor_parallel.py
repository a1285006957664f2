"""The tensor-parallel layout of a model's parameters, as :func:`wrapperroute.detect` reports it.

Read from the parameters themselves: a ``DTensor`` parameter sharded over a mesh dimension that the
data-parallel wrapper does not own (FSDP2's own dimensions are left out), and not named for expert or context
parallelism, is tensor-parallel there. Ranks along such a dimension hold different slices of one model: they
are not replicas of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._groups import group_ranks
from ._head import output_embedding


@dataclass(frozen=True)
class TensorParallel:
    """What :func:`wrapperroute.detect` found of tensor parallelism.

    dims
        The mesh dimensions that shard parameters, the data-parallel wrapper's own left out (``("tp",)``).
    sharded
        Each such parameter and how: ``{"lm_head.weight": "Shard(0) over tp"}``.
    head_vocab_sharded
        Whether the output embedding's weight is sharded on the vocabulary (its dimension 0).
    head_ranks
        The global ranks holding the head's other vocabulary slices, this rank's included (its tensor-parallel
        group), or None.
    mesh_ranks
        Every rank of the parameters' meshes.
    """

    dims: tuple[str, ...]
    sharded: dict[str, str] = field(default_factory=dict)
    head_vocab_sharded: bool = False
    head_ranks: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] = ()


def _dim_name(mesh: Any, dim: int) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return str(names[dim]) if names else f"dim{dim}"


def _other_parallelism(name: str) -> bool:
    """Whether a mesh dimension of this name shards for expert or context parallelism (torchtitan's and
    transformers' names: ``ep``, ``cp``, ``dp_shard_mod_ep``...): its ranks hold other experts, or other parts of
    a sequence, not slices of one tensor-parallel layer."""
    parts = name.lower().replace("-", "_").split("_")
    return any(part in ("ep", "cp", "expert", "experts", "context") for part in parts)


def _owned(mesh: Any, dim: int, wrapper_meshes: tuple[Any, ...]) -> bool:
    """Whether ``dim`` of ``mesh`` is one the data-parallel wrapper uses: its own mesh, or a dimension of the
    same name (FSDP2 over ``mesh["dp"]`` of a (dp, tp) mesh)."""
    name = _dim_name(mesh, dim)
    return any(own == mesh or name in (getattr(own, "mesh_dim_names", None) or ()) for own in wrapper_meshes)


def tensor_parallel_layout(inner: nn.Module, wrapper_meshes: tuple[Any, ...]) -> TensorParallel | None:
    """The layout of ``inner``'s parameters over mesh dimensions the wrapper (``wrapper_meshes``) does not use,
    or None."""
    dims: set[str] = set()
    sharded: dict[str, str] = {}
    ranks: set[int] = set()
    for name, param in inner.named_parameters():
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        ranks.update(mesh.mesh.flatten().tolist())
        here = [(_dim_name(mesh, d), p) for d, p in enumerate(placements) if p.is_shard()
                and not _owned(mesh, d, wrapper_meshes) and not _other_parallelism(_dim_name(mesh, d))]  # fmt: skip
        if here:
            dims.update(dim for dim, _ in here)
            sharded[name] = ", ".join(f"Shard({p.dim}) over {dim}" for dim, p in here)
    if not sharded:
        return None
    head = output_embedding(inner)
    weight = getattr(head, "weight", None)
    vocab, group = False, None
    mesh, placements = getattr(weight, "device_mesh", None), getattr(weight, "placements", None)
    if mesh is not None and placements is not None:
        for d, p in enumerate(placements):
            if p.is_shard() and getattr(p, "dim", None) == 0 and _dim_name(mesh, d) in dims:
                vocab = True
                if mesh.get_coordinate() is not None:
                    group = group_ranks(mesh.get_group(d))
    return TensorParallel(tuple(sorted(dims)), sharded, vocab, group, tuple(sorted(ranks)))
