"""``clip_grad_norm_`` for gradients that are DTensors on different meshes.

Under FSDP x TP a model's gradients live on several meshes and placements at once:
``[Shard(1), Shard(0)]`` on the (dp, tp) mesh for a ColwiseParallel weight,
``[Shard(0)]`` on ``mesh["dp"]`` for a plain parameter beside it, ``[Replicate(),
Shard(d), ...]`` under HSDP. ``torch.nn.utils.clip_grad_norm_`` stacks the per-gradient
norms, which DTensor refuses across meshes. Here each gradient contributes the sum of
``|g|^p`` over its local block (the max for ``p = inf``); contributions are summed per
communicator over the mesh dims the gradient is sharded on (replicated dims hold copies
and are not summed), with one all-reduce per distinct rank group; communicators over the
same ranks (``mesh2d["dp"]`` and dim 0 of ``mesh2d``) share one all-reduce. Every rank
orders the all-reduces by their groups' world ranks, a global order, so none can wait
on another in a cycle.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from mpi4py import MPI

from ..tensor.dtensor import DTensor
from ..comm.collectives import all_reduce
from ..tensor.placements import Replicate, shard_dim


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their total ``norm_type``-norm
    is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``), for gradients that may
    be DTensors on different meshes (FSDP x TP, HSDP x TP) or plain tensors (taken as
    replicated). Returns the total norm before clipping as a plain 0-d tensor, the same on
    every rank. Collective over every mesh the gradients live on; ``norm_type``: a positive
    number or ``inf``. ``foreach``: compute the local norms and scale with ``torch._foreach_*``.
    A Partial gradient is first redistributed to Replicate on that mesh dim.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_ supports a positive norm_type or inf, got {norm_type}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [_settled(p) for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    blocks = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    inf = math.isinf(norm_type)
    fold = _max if inf else _sum
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g, part in zip(grads, _local_parts(blocks, norm_type, foreach)):
        groups.setdefault(_sharded_dims(g), []).append(part)
    totals: list[torch.Tensor] = []
    by_ranks: dict[tuple[int, ...], tuple[MPI.Comm, list[torch.Tensor]]] = {}
    for where, parts in groups.items():
        if not where:  # replicated everywhere: the local value is the value
            totals.append(fold(parts))
            continue
        comm = where[0].comm_for(where[1])
        by_ranks.setdefault(_world_ranks(comm), (comm, []))[1].extend(parts)
    for ranks in sorted(by_ranks):  # one global order: no cyclic waits between groups
        comm, parts = by_ranks[ranks]
        totals.append(all_reduce(fold(parts).reshape(1), comm, "max" if inf else "sum").reshape(()))
    total = fold(totals) if inf else fold(totals).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; "
            "set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dtype, index in _by_dtype(blocks).items():
        group = [blocks[i] for i in index]
        if foreach:
            torch._foreach_mul_(group, coef.to(dtype))
        else:
            for t in group:
                t.mul_(coef.to(dtype))
    return total


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).sum()


def _max(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).max()


def _settled(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, a Partial one first redistributed to Replicate (a norm needs the sum)."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        placements = [Replicate() if p.is_partial() else p for p in grad.placements]
        param.grad = grad = grad.redistribute(grad.device_mesh, placements)
    return grad


def _sharded_dims(grad: torch.Tensor) -> tuple:
    """``(mesh, dims)``: the mesh dims over which ranks hold disjoint pieces of ``grad``
    (their contributions are summed there); ``()`` if none."""
    if not isinstance(grad, DTensor):
        return ()
    dims = tuple(i for i, p in enumerate(grad.placements) if shard_dim(p) is not None)  # _StridedShard too
    return (grad.device_mesh, dims) if dims else ()


def _local_parts(blocks: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """Per local block, ``sum |t|^p`` (``max |t|`` for inf), in float64 if any block is
    float64, else float32; an empty block (an uneven shard) contributes 0."""
    acc = torch.float64 if any(t.dtype == torch.float64 for t in blocks) else torch.float32
    norms: list[torch.Tensor | None] = [None] * len(blocks)
    live = [i for i, t in enumerate(blocks) if t.numel()]
    if foreach:
        for index in _by_dtype([blocks[i] for i in live]).values():
            ids = [live[j] for j in index]
            for i, n in zip(ids, torch._foreach_norm([blocks[i] for i in ids], norm_type)):
                norms[i] = n
    else:
        for i in live:
            norms[i] = torch.linalg.vector_norm(blocks[i], norm_type)
    parts = [torch.zeros((), dtype=acc, device=t.device) if n is None else n.to(acc) for n, t in zip(norms, blocks)]
    return parts if math.isinf(norm_type) else [n.pow(norm_type) for n in parts]


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of ``tensors`` by dtype (``torch._foreach_*`` takes one dtype at a time)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """The world ranks of ``comm``, sorted: the same key on every member."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(sorted(group.Translate_ranks(list(range(comm.size)), world)))
    finally:
        group.Free()
        world.Free()
