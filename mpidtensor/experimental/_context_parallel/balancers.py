"""torch's context-parallel load balancers (``torch.distributed.tensor.experimental.
_attention._HeadTailLoadBalancer`` ...), with torch 2.13's constructors and meaning.

A balancer gives the order in which a sequence is laid out before it is cut into
``world_size`` equal contiguous shards: ``_generate_indices()`` is a ``(1, seq_len)``
(or ``(batch, seq_len)``) index tensor, position ``i`` of the balanced sequence holding
natural position ``indices[..., i]``; ``restore=True`` gives the inverse permutation.

* ``_HeadTailLoadBalancer``: chunks ``r`` and ``2 * world_size - 1 - r`` of ``2 *
  world_size`` on rank ``r`` (what ring attention's causal schedule assumes; the same
  order as ``load_balance.head_tail_order``).
* ``_PTRRLoadBalancer``: processing-time round robin over the query blocks of a flex
  attention ``BlockMask``: blocks sorted by their work (unmasked key blocks), dealt to the
  ranks in snake order (0..n-1, n-1..0, ...), each rank's blocks kept in natural order.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .load_balance import head_tail_order

__all__ = ["_HeadTailLoadBalancer", "_LoadBalancer", "_PTRRLoadBalancer"]


class _LoadBalancer(ABC):
    """A sequence order that evens out attention work over the context-parallel ranks."""

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        """The balanced order, ``(1, seq_len)`` or ``(batch, seq_len)``; ``restore``: its inverse."""


class _HeadTailLoadBalancer(_LoadBalancer):
    """Head-tail order: rank ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r``.
    ``seq_length`` must be divisible by ``2 * world_size`` (ValueError otherwise)."""

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device) -> None:
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        order = head_tail_order(self.seq_length, self.world_size, torch.device(self.device))
        if restore:
            order = torch.argsort(order)
        return order.unsqueeze(0)


class _PTRRLoadBalancer(_LoadBalancer):
    """Processing-time round robin over the query blocks of ``block_mask`` (shape
    ``(B or 1, 1, seq_len, seq_len)``, equal query and key block sizes). For flex
    attention, whose masks say how much work each query block has."""

    def __init__(self, block_mask, world_size: int) -> None:
        self.block_mask = block_mask
        self.world_size = world_size

    @staticmethod
    def ptrr_scheduling(process_time: torch.Tensor, group_size: int) -> torch.Tensor:
        """``(group_size, n // group_size)`` task indices: tasks sorted by ``process_time``
        (descending, ties in order) dealt in snake order to the groups, each group sorted.
        NotImplementedError unless ``n`` is divisible by ``group_size``."""
        if process_time.ndim != 1:
            raise ValueError(f"process_time must be 1-D, got shape {tuple(process_time.shape)}")
        count = process_time.numel()
        if count % group_size:
            raise NotImplementedError(f"num_tasks {count} must be divisible by group_size {group_size}")
        ranked = torch.sort(process_time, descending=True, stable=True).indices.view(-1, group_size)
        ranked[1::2] = ranked[1::2].flip(1)  # snake: every second round deals backwards
        return torch.sort(ranked.transpose(0, 1), dim=1).values

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        mask = self.block_mask
        work = mask.kv_num_blocks if mask.full_kv_num_blocks is None else mask.kv_num_blocks + mask.full_kv_num_blocks
        batch, heads, blocks = work.shape
        if heads != 1:
            raise ValueError(f"_PTRRLoadBalancer needs a mask identical over heads (H == 1), got H = {heads}")
        q_block, kv_block = mask.BLOCK_SIZE
        if q_block != kv_block:
            raise ValueError(f"_PTRRLoadBalancer needs equal query and key block sizes, got {mask.BLOCK_SIZE}")
        positions = torch.arange(blocks * q_block, device=work.device).view(blocks, q_block)
        rows = [positions[self.ptrr_scheduling(w, self.world_size).reshape(-1)].reshape(-1)
                for w in work.view(batch, blocks)]
        indices = torch.stack(rows)
        return torch.argsort(indices, dim=1) if restore else indices
