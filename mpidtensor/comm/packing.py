"""A tensor's pieces along a dim, packed back to back in rank order, and unpacked again.

A regular ``Alltoall(v)`` or ``Scatterv`` takes each rank's piece as one run of memory.
Along the leading dim of a C-contiguous tensor the pieces are such runs already (a view);
along a later dim they are packed with one strided copy when even (1.6-3.5x faster than
a copy per piece), else with a copy per piece. The all-to-all unpacks what it received the
same way (``from_rank_order``); the copies are worked out once per shape (cached).
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import Callable, Sequence

import torch

from ..runtime import caches
from .base import Run, resized
from .buffers import empty, stage


def pieces_in_rank_order(tensor: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``tensor``'s pieces along ``dim``, each C-contiguous, back to back (one copy at most), flat."""
    if prod(tensor.shape[:dim]) == 1:  # already so when C-contiguous
        return stage(tensor).view(-1)
    shape, sizes = tuple(tensor.shape), tuple(sizes)
    pack = to_rank_order(shape, dim, sizes) if tensor.is_contiguous() else _per_piece(shape, dim, sizes)
    return pack(tensor.detach())


@lru_cache(maxsize=1024)
def to_rank_order(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Run:
    """The pieces along ``dim`` of a C-contiguous, detached tensor of ``shape`` back to back,
    flat: a view when ``dim`` leads, else one strided copy for even pieces or a copy per piece
    (:func:`into_rank_order`) into a pooled buffer."""
    if prod(shape[:dim]) == 1:
        return lambda t: t.view(-1)
    into = into_rank_order(shape, dim, sizes)
    return lambda t: into(t, empty((t.numel(),), t))


@lru_cache(maxsize=1024)
def into_rank_order(shape: tuple[int, ...], dim: int,
                    sizes: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``into(t, flat)``: the pieces along ``dim`` of a C-contiguous, detached tensor ``t`` of
    ``shape`` copied back to back into the C-contiguous ``flat`` (as many elements), which it
    returns; one strided copy for even pieces (the source viewed by one ``as_strided``, the
    destination's view made per buffer), else a copy per piece. A prepared all-to-all packs
    into a buffer of its own with it."""
    outer, inner, n = prod(shape[:dim]), prod(shape[dim + 1:]), len(sizes)
    if len(set(sizes)) > 1:
        return _per_piece(shape, dim, sizes)
    piece = sizes[0]
    packed = (n, outer, piece, inner)
    # the source's (outer, n, piece, inner) blocks with the first two dims swapped
    source_strides = (piece * inner, n * piece * inner, inner, 1)

    def strided(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        flat.view(*packed).copy_(t.as_strided(packed, source_strides))  # ints: view parses them fastest
        return flat
    return strided


@lru_cache(maxsize=1024)
def _per_piece(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """``per_piece(t, flat=None)``: the pieces along ``dim`` of a detached tensor of ``shape``
    (any strides) back to back in ``flat`` (a pooled buffer if None), which it returns: a
    copy per piece."""
    pieces = [resized(shape, dim, size) for size in sizes]
    counts = [prod(piece) for piece in pieces]

    def per_piece(t: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
        if flat is None:
            flat = empty((t.numel(),), t)
        for chunk, piece, view in zip(flat.split(counts), t.split(sizes, dim), pieces):
            chunk.view(view).copy_(piece)
        return flat
    return per_piece


@lru_cache(maxsize=1024)
def from_rank_order(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Run:
    """The inverse of :func:`to_rank_order`: pieces received back to back (flat) as the
    C-contiguous tensor of ``shape`` they make along ``dim``. Along a later dim the pieces
    are even: uneven ones go by ``Alltoallw`` there (``alltoall``'s layout)."""
    outer, inner, n = prod(shape[:dim]), prod(shape[dim + 1:]), len(sizes)
    if outer == 1:  # received pieces are contiguous runs of the result
        return lambda flat: flat.view(shape)
    if len(set(sizes)) > 1:  # the strided copy below would misplace them
        raise ValueError(f"packed all-to-all: uneven pieces {sizes} along dim {dim} of {shape} take Alltoallw")
    packed, blocks = (n, outer, sizes[0], inner), (outer, n, sizes[0], inner)

    def strided(flat: torch.Tensor) -> torch.Tensor:
        out = empty(shape, flat)
        out.view(*blocks).copy_(flat.view(*packed).transpose(0, 1))  # ints: view parses them fastest
        return out
    return strided


for _name, _cached in (("rank-order packings", to_rank_order), ("rank-order packings into", into_rank_order),
                       ("per-piece packings", _per_piece),
                       ("rank-order unpackings", from_rank_order)):
    caches.on_clear(_name, _cached.cache_clear, holds_meshes=False)
del _name, _cached
