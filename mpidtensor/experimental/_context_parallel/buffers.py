"""Sharding the buffers of a ``context_parallel`` block in place, and restoring them.

Each rank keeps its slice of every buffer along the buffer's sequence dim: the
head-tail slice (chunks ``r`` and ``2 * cp - 1 - r``) when the attention is load
balanced, else the ``r``-th contiguous ``torch.chunk`` piece (as ``Shard``). The buffer
object the user holds is pointed at the local slice (``Tensor.set_``), so a module that
indexes its buffer, or code holding the input ids, sees local data; the original
storage is kept aside and put back on exit, without copying the full buffer. Sharding
moves no data between ranks: every rank holds the full buffers.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...tensor.layout import chunk_span
from ...tensor.dtensor import DTensor
from .load_balance import head_tail_order


def check_buffer_arguments(
    buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], no_restore: Sequence[torch.Tensor]
) -> list[int]:
    """Validate the arguments of ``context_parallel``; return the seq dims made non-negative.

    Raises TypeError for a buffer that is not a plain tensor (an ``nn.Parameter``, a
    DTensor, anything else) or a seq dim that is not an int, ValueError for a buffer
    listed twice, one that requires grad, a seq dims list of another length, a dim out
    of range, unequal sequence lengths or ``no_restore_buffers`` outside ``buffers``."""
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"buffer_seq_dims must give one sequence dim per buffer: {len(buffers)} buffers, "
            f"{len(seq_dims)} dims"
        )
    dims = []
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if isinstance(buffer, torch.nn.Parameter):
            raise TypeError(f"buffers[{i}] is an nn.Parameter: parameters are not sharded by context_parallel")
        if isinstance(buffer, DTensor) or type(buffer) is not torch.Tensor:
            raise TypeError(f"buffers[{i}] must be a plain torch.Tensor, got {type(buffer).__name__}")
        if any(other is buffer for other in buffers[:i]):
            raise ValueError(f"buffers[{i}] is listed twice in buffers")
        if buffer.requires_grad:
            raise ValueError(f"buffers[{i}] requires grad: buffers are sharded in place, which autograd forbids")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"buffer_seq_dims[{i}] must be an int, got {type(dim).__name__}")
        if not -buffer.ndim <= dim < buffer.ndim:
            raise ValueError(
                f"buffer_seq_dims[{i}] = {dim} is out of range for a buffer of shape {tuple(buffer.shape)}"
            )
        dims.append(dim % buffer.ndim)
    lengths = {buffer.shape[dim] for buffer, dim in zip(buffers, dims)}
    if len(lengths) > 1:
        raise ValueError(f"all buffers must have the same sequence length along their seq dims, got {sorted(lengths)}")
    for buffer in no_restore:
        if not any(buffer is b for b in buffers):
            raise ValueError("no_restore_buffers must be a subset of buffers")
    return dims


def local_positions(seq_len: int, cp: int, rank: int, load_balanced: bool, device: torch.device) -> torch.Tensor:
    """The natural positions that rank ``rank`` holds, in its local order: its head-tail
    slice, or its ``torch.chunk`` piece (uneven at the end) when not load balanced."""
    if load_balanced:
        width = seq_len // cp
        return head_tail_order(seq_len, cp, device)[rank * width:(rank + 1) * width]
    start, size = chunk_span(seq_len, cp, rank)
    return torch.arange(start, start + size, device=device)


def shard_buffers(
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    cp: int,
    rank: int,
    load_balanced: bool,
    no_restore: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Point every buffer at this rank's slice along its seq dim (arguments checked
    before). Returns ``(buffer, original)`` for the buffers to restore."""
    saved = []
    with torch.no_grad():
        for buffer, dim in zip(buffers, seq_dims):
            index = local_positions(buffer.shape[dim], cp, rank, load_balanced, buffer.device)
            original = buffer.detach()  # a second handle on the storage, sizes and strides
            buffer.set_(buffer.index_select(dim, index))
            if not any(buffer is b for b in no_restore):
                saved.append((buffer, original))
    return saved


def restore_buffers(saved: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point every buffer back at its original storage, sizes and strides."""
    with torch.no_grad():
        for buffer, original in saved:
            buffer.set_(original)
