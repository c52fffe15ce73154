"""The functional context-parallel entry points of torch 2.13 that frameworks such as
torchtitan call instead of the ``context_parallel`` block: ``_context_parallel_shard``
(shard input buffers and flex-attention ``BlockMask``s along the sequence, after an
optional load balancer's reordering; returns new tensors, nothing in place) and
``flex_cp_allgather`` (the key/value all-gather of context-parallel flex attention,
differentiable: its backward reduce-scatters the gradients).

Both move no data to shard: every rank holds the full buffers, as in torch.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from mpi4py import MPI
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...comm import collectives
from ...mesh import DeviceMesh
from ...tensor.dtensor import DTensor
from ...tensor.layout import chunk_span
from .api import _cp_options
from .balancers import _LoadBalancer

__all__ = ["_context_parallel_shard", "flex_cp_allgather"]


def _context_parallel_shard(
    mesh: DeviceMesh,
    buffers: Sequence[Any] | Mapping[str, Any],
    seq_dims: Sequence[int] | Mapping[str, int],
    load_balancer: _LoadBalancer | None = None,
) -> list[Any]:
    """This rank's shard of each buffer along its seq dim (torch's signature and result).

    ``buffers`` (a list or dict of tensors and ``BlockMask``s, ``seq_dims`` alike): each
    tensor is reordered along its seq dim by ``load_balancer`` (if given) and cut into
    ``mesh.size()`` contiguous ``torch.chunk`` pieces; a ``BlockMask`` becomes the mask of
    this rank's query rows against all keys (in the balanced order), its seq dim ignored.
    As in torch, this also decides the layout that ring attention assumes afterwards
    (``_cp_options.enable_load_balance``: whether a balancer was given). ValueError on
    malformed arguments; the arguments are local, so the checks are the same on every rank.
    """
    comm = _mesh_comm(mesh)
    _cp_options.enable_load_balance = load_balancer is not None
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    flat, spec = tree_flatten(buffers)
    flat_dims, _ = tree_flatten(seq_dims)
    if len(flat) != len(flat_dims):
        raise ValueError("`seq_dims` must have the pytree structure as `buffers`.")
    indices = None if load_balancer is None else load_balancer._generate_indices()
    if indices is not None and indices.ndim != 2:
        raise ValueError(f"load balance indices must have shape (1, seq_len) or (B, seq_len), got {tuple(indices.shape)}")
    sharded = []
    for i, (buffer, dim) in enumerate(zip(flat, flat_dims)):
        if isinstance(buffer, DTensor) or not isinstance(buffer, torch.Tensor):
            sharded.append(_shard_block_mask(buffer, comm, indices, i))
            continue
        if not -buffer.ndim <= dim < buffer.ndim:
            raise ValueError(f"seq_dims[{i}] = {dim} is not a dim of a buffer of shape {tuple(buffer.shape)}")
        dim %= buffer.ndim
        if indices is not None:
            buffer = _reorder(buffer, dim, indices, i)
        start, size = chunk_span(buffer.shape[dim], comm.size, comm.rank)
        sharded.append(buffer.narrow(dim, start, size).contiguous())
    return tree_unflatten(sharded, spec)


def _reorder(buffer: torch.Tensor, dim: int, indices: torch.Tensor, i: int) -> torch.Tensor:
    """``buffer`` in the balanced order along ``dim`` (per batch row if ``indices`` has
    one row per batch element; dim 0 of the buffer is the batch unless ``dim`` is 0)."""
    if buffer.shape[dim] != indices.shape[1]:
        raise ValueError(f"buffers[{i}] has sequence length {buffer.shape[dim]} along dim {dim}, "
                         f"the load balancer orders {indices.shape[1]}")
    indices = indices.to(buffer.device)
    if dim == 0 or indices.shape[0] == 1:
        return buffer.index_select(dim, indices[0])
    if indices.shape[0] != buffer.shape[0]:
        raise ValueError(f"cannot reorder buffers[{i}] of shape {tuple(buffer.shape)} by load balance "
                         f"indices of shape {tuple(indices.shape)}")
    view = [buffer.shape[0]] + [1] * (buffer.ndim - 1)
    view[dim] = indices.shape[1]
    return torch.gather(buffer, dim, indices.view(view).expand(buffer.shape))


def _shard_block_mask(mask: Any, comm: MPI.Intracomm, indices: torch.Tensor | None, i: int) -> Any:
    """The ``BlockMask`` of this rank's query rows (local query ``q`` is balanced position
    ``rank * Q_LEN / cp + q``) against every key (key ``k`` is balanced position ``k``),
    made by flex attention's ``create_block_mask`` from the rewritten ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    if not isinstance(mask, BlockMask):
        raise ValueError(f"buffers[{i}] must be a torch.Tensor or a BlockMask, got {type(mask).__name__}")
    q_len, kv_len = mask.seq_lengths
    block = mask.BLOCK_SIZE[0]
    if q_len % (comm.size * block):
        raise NotImplementedError(f"context parallelism shards a BlockMask whose query length {q_len} is a "
                                  f"multiple of cp size {comm.size} * BLOCK_SIZE {block} only")
    local_len, offset = q_len // comm.size, comm.rank * (q_len // comm.size)
    mask_mod = mask.mask_mod
    order = None if indices is None else indices.to(mask.kv_num_blocks.device)

    def natural(b, position):
        if order is None:
            return position
        return order[0][position] if order.shape[0] == 1 else order[b][position]

    def local_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, natural(b, q_idx + offset), natural(b, kv_idx))

    batch, heads = mask.kv_num_blocks.shape[:2]
    return create_block_mask(local_mask_mod, batch, heads, local_len, kv_len, device=mask.kv_num_blocks.device,
                             BLOCK_SIZE=mask.BLOCK_SIZE)


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, seq_dim: int, pg_name: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` gathered along ``seq_dim`` over the context-parallel group, in rank
    order (torch's ``cplib::flex_cp_allgather``); the backward reduce-scatters (sums) the
    gradients back to their shards. ``pg_name``: the group's name as torch names it
    (``dist._get_process_group_name(mesh.get_group())``), a 1-D ``DeviceMesh`` or an MPI
    communicator. Every rank must pass blocks of the same shape."""
    comm = _group_comm(pg_name)
    return _FlexAllGather.apply(k.contiguous(), v.contiguous(), seq_dim % k.ndim, comm)


class _FlexAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, seq_dim, comm):
        ctx.seq_dim, ctx.comm = seq_dim, comm
        return tuple(collectives.all_gather(t, comm, dim=seq_dim, sizes=[t.shape[seq_dim]] * comm.size)
                     for t in (k, v))

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        comm, dim = ctx.comm, ctx.seq_dim
        grads = [None if g is None else collectives.reduce_scatter(
            g.contiguous(), comm, "sum", dim=dim, sizes=[g.shape[dim] // comm.size] * comm.size)
            for g in (grad_k, grad_v)]
        return grads[0], grads[1], None, None


def _mesh_comm(mesh: DeviceMesh) -> MPI.Intracomm:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"context parallelism needs a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"context parallelism needs a 1-D mesh (e.g. mesh['cp']), got one of shape {tuple(mesh.shape)}")
    return mesh.get_group()


def _group_comm(group: Any) -> MPI.Intracomm:
    """The MPI communicator of a group given as torch names it, a mesh or a communicator."""
    if isinstance(group, MPI.Intracomm):
        return group
    if isinstance(group, DeviceMesh):
        return _mesh_comm(group)
    if isinstance(group, str):
        from torch.distributed import distributed_c10d
        group = distributed_c10d._resolve_process_group(group)
    comm = getattr(group, "comm", None)
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"flex_cp_allgather needs an MPI-backed group (a DeviceMesh, an MPI communicator or the "
                        f"name of a group of mpidtensor's torch.distributed backend), got {type(group).__name__}")
    return comm
