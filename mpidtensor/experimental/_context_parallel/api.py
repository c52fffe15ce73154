"""``context_parallel``, ``context_parallel_unshard`` and ``set_rotate_method``, with the
semantics of ``torch.distributed.tensor.experimental``.

Inside ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` the listed buffers
hold this rank's slice of the sequence (head-tail order: see ``load_balance``) and
``torch.nn.functional.scaled_dot_product_attention``, however it is called, runs
``ring_attention`` over the mesh's communicator. The call is intercepted by a
``TorchFunctionMode``, active only inside the block and removed on exit (also after an
exception), so code outside runs untouched. As in torch, the buffers are load balanced
whatever the attention (unless ``_cp_options.enable_load_balance`` is off) and every
attention call is told that layout, causal or not.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.overrides import TorchFunctionMode

from ...tensor.dtensor import DTensor
from ...tensor.layout import global_strides
from ...mesh import DeviceMesh
from ...tensor.placements import Placement, Replicate, Shard
from ...runtime.agreement import attempt, raise_agreed, require_same
from .buffers import check_buffer_arguments, restore_buffers, shard_buffers
from .load_balance import check_balanced_length, head_tail_inverse
from .ring import ROTATE_METHODS, ring_attention


@dataclass
class _ContextParallelOptions:
    """Process-wide settings, as torch's ``_cp_options``. ``enable_load_balance=False``
    shards buffers in contiguous ``torch.chunk`` pieces (any sequence length; a causal
    attention is then unbalanced); ``rotate_method`` is read at each attention call."""

    enable_load_balance: bool = True
    rotate_method: str = "allgather"


_cp_options = _ContextParallelOptions()
_active = False  # a context_parallel block is open in this process


def set_rotate_method(rotate_method: str) -> None:
    """How key/value shards travel: ``"allgather"`` (torch's default: gathered once) or
    ``"alltoall"`` (passed around the ring, one neighbour exchange per step, overlapped
    with the block computations). Raises ValueError for any other string."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}")
    _cp_options.rotate_method = rotate_method


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Shard the sequence over the 1-D ``mesh`` for the block: each of ``buffers`` (input
    ids, labels, position buffers...) becomes, in place, this rank's slice along its
    ``buffer_seq_dims`` entry, and ``scaled_dot_product_attention`` runs ring attention.
    On exit the buffers are restored, except those in ``no_restore_buffers``.

    The sequence length must be divisible by ``2 * mesh.size()`` (load balancing). A mesh
    of size 1 changes nothing. Bad arguments (an ``nn.Parameter`` or a tensor listed
    twice in ``buffers``, wrong ``buffer_seq_dims``, a mesh of more than one dim, a
    nested block, buffers that differ across the ranks) raise TypeError/ValueError on
    every rank; the checks agree over the mesh in one small collective.
    """
    global _active
    comm = _mesh_comm(mesh)
    if _active:
        raise ValueError("context_parallel blocks cannot be nested")
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    no_restore = [] if no_restore_buffers is None else list(no_restore_buffers)
    load_balanced = _cp_options.enable_load_balance
    if comm.size == 1:
        check_buffer_arguments(buffers, seq_dims, no_restore)
        saved, mode = [], contextlib.nullcontext()
    else:
        seq_dims = _agreed_arguments(comm, buffers, seq_dims, no_restore, load_balanced)
        saved = shard_buffers(buffers, seq_dims, comm.size, comm.rank, load_balanced, no_restore)
        mode = _RingAttentionMode(comm, load_balanced)
    _active = True
    try:
        with mode:
            yield
    finally:
        _active = False
        restore_buffers(saved)


def context_parallel_unshard(
    mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]
) -> list[torch.Tensor]:
    """The full tensors, in natural sequence order, of ``buffers`` sharded as
    ``context_parallel`` shards them (outputs, logits, losses per token): one all-gather
    per buffer along its seq dim, then the load balancing undone. Differentiable."""
    comm = _mesh_comm(mesh)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"seq_dims must give one dim per buffer: {len(buffers)} buffers, {len(seq_dims)} dims")
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(buffer, torch.Tensor) or isinstance(buffer, DTensor):
            raise TypeError(f"buffers[{i}] must be a plain torch.Tensor, got {type(buffer).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -buffer.ndim <= dim < buffer.ndim:
            raise ValueError(f"seq_dims[{i}] = {dim!r} is not a dim of a buffer of shape {tuple(buffer.shape)}")
    if comm.size == 1:
        return list(buffers)
    full = []
    for buffer, dim in zip(buffers, seq_dims):
        dim %= buffer.ndim
        # from_local without a shape gathers the local shapes: a mismatch fails on every rank
        gathered = DTensor.from_local(buffer.contiguous(), mesh, [Shard(dim)]).full_tensor()
        if _cp_options.enable_load_balance:
            gathered = gathered.index_select(dim, head_tail_inverse(gathered.shape[dim], comm.size, buffer.device))
        full.append(gathered)
    return full


class _RingAttentionMode(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to ``ring_attention``; every other call runs as is."""

    def __init__(self, comm: MPI.Cartcomm, load_balanced: bool) -> None:
        super().__init__()
        self.comm = comm
        self.load_balanced = load_balanced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Ring attention over the local sequence slices; DTensor inputs (heads or batch
        sharded on another mesh, as tensor parallelism leaves them) run on their local
        tensors and the output is wrapped back with their layout."""
        layout = _dtensor_layout(query, key, value)
        if layout is not None:
            query, key, value = (t.to_local() for t in (query, key, value))
            if isinstance(attn_mask, DTensor):
                attn_mask = attn_mask.to_local()
        out = ring_attention(
            query, key, value, comm=self.comm, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa, load_balanced=self.load_balanced,
            rotate_method=_cp_options.rotate_method,
        )
        if layout is None:
            return out
        mesh, placements, shape = layout
        return DTensor.from_local(out, mesh, placements, shape=shape, stride=global_strides(shape, out))


def _mesh_comm(mesh: DeviceMesh) -> MPI.Cartcomm:
    """The communicator of a 1-D mesh; TypeError/ValueError for anything else."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"context parallelism needs a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"context parallelism needs a 1-D mesh (e.g. mesh['cp']), got one of shape {tuple(mesh.shape)}"
        )
    return mesh.get_group()


def _agreed_arguments(
    comm: MPI.Cartcomm,
    buffers: list[torch.Tensor],
    seq_dims: list,
    no_restore: list[torch.Tensor],
    load_balanced: bool,
) -> list[int]:
    """The checked seq dims, or the same error on every rank of ``comm`` (the agreement
    helper: two small all-gathers): an argument error on any rank, or buffers of
    different shapes across the ranks, is raised on all of them."""
    def checked() -> list[int]:
        dims = check_buffer_arguments(buffers, seq_dims, no_restore)
        if buffers and load_balanced:
            check_balanced_length(buffers[0].shape[dims[0]], comm.size)
        return dims

    dims, error = attempt(checked)
    raise_agreed(comm, error)
    require_same(comm, [(tuple(b.shape), d) for b, d in zip(buffers, dims)],
                 lambda seen: "the buffers differ across the context-parallel ranks (shape, seq dim) per rank: "
                 + "; ".join(f"rank {r}: {sig}" for r, sig in enumerate(seen)))
    return dims


def _dtensor_layout(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[DeviceMesh, tuple[Placement, ...], tuple[int, ...]] | None:
    """None for plain q/k/v; for DTensors their common mesh and placements and the
    output's global shape. ValueError unless all three are DTensors on one mesh with
    the same placements, each replicated or sharding a dim before the sequence dim."""
    kinds = [isinstance(t, DTensor) for t in (query, key, value)]
    if not any(kinds):
        return None
    if not all(kinds):
        raise ValueError("context-parallel attention needs query, key and value all DTensors or all plain tensors")
    mesh, placements = query.device_mesh, query.placements
    if any(t.device_mesh != mesh or t.placements != placements for t in (key, value)):
        raise ValueError(
            "context-parallel attention needs query, key and value on one mesh with the same placements, got "
            f"{query.placements}, {key.placements}, {value.placements}"
        )
    seq_dim = query.ndim - 2
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < seq_dim) for p in placements):
        raise ValueError(
            f"context-parallel attention takes DTensors sharded on batch or head dims (before dim {seq_dim}) "
            f"or replicated, got placements {placements}"
        )
    return mesh, placements, (*query.shape[:-1], value.shape[-1])
