"""Head-tail load balancing of a causal sequence over ``cp`` ranks.

A causal mask gives late queries more keys than early ones. Cutting the sequence into
``2 * cp`` equal chunks and giving rank ``r`` chunks ``r`` and ``2 * cp - 1 - r`` (one
from the front, its mirror from the back) gives every rank the same number of
query-key pairs. The layout is an index tensor: position ``i`` of the balanced
sequence holds natural position ``order[i]``, and rank ``r`` holds positions
``[r * L, (r + 1) * L)`` of it, ``L = seq_len / cp``. The inverse maps the gathered
balanced sequence back to natural order. Both are cached per ``(seq_len, cp, device)``.
"""
from __future__ import annotations

import functools

import torch

from ...runtime import caches


def check_balanced_length(seq_len: int, cp: int) -> None:
    """Raise ValueError unless ``seq_len`` splits into ``2 * cp`` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism with load balancing cuts the sequence into 2 * cp = {2 * cp} equal "
            f"chunks; sequence length {seq_len} is not divisible by {2 * cp}"
        )


@functools.lru_cache(maxsize=64)
def head_tail_order(seq_len: int, cp: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The natural positions in balanced order: rank ``r``'s slice is chunk ``r`` then
    chunk ``2 * cp - 1 - r``. Raises ValueError if ``seq_len`` is not divisible by ``2 * cp``."""
    check_balanced_length(seq_len, cp)
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    ranks = torch.arange(cp, device=device)
    return torch.stack([chunks[ranks], chunks[2 * cp - 1 - ranks]], dim=1).flatten()


@functools.lru_cache(maxsize=64)
def head_tail_inverse(seq_len: int, cp: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The inverse permutation of :func:`head_tail_order`: ``balanced[inverse]`` is in natural order."""
    order = head_tail_order(seq_len, cp, device)
    return torch.empty_like(order).scatter_(0, order, torch.arange(seq_len, device=device))


caches.on_clear("context_parallel.head_tail_order", head_tail_order.cache_clear, holds_meshes=False)
caches.on_clear("context_parallel.head_tail_inverse", head_tail_inverse.cache_clear, holds_meshes=False)
