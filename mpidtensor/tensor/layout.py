"""Pure helpers for block layouts: which slice of a global tensor each rank holds.

Shards follow ``torch.chunk``: chunks of ``ceil(n / parts)`` elements, so trailing
ranks may hold fewer or none. Nested sharding of one tensor dim over several mesh
dims applies the mesh dims in order (outer mesh dim first).
"""
from __future__ import annotations

from typing import Sequence

from .placements import Placement, Shard


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Sizes of the ``parts`` pieces ``torch.chunk`` would give (empty pieces as 0)."""
    step = -(-length // parts)
    return tuple(max(0, min(step, length - i * step)) for i in range(parts))


def chunk_span(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of piece ``index`` of ``chunk_sizes(length, parts)``."""
    step = -(-length // parts)
    offset = min(index * step, length)
    return offset, min(step, length - offset)


def local_span(
    length: int,
    tensor_dim: int,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    upto: int | None = None,
) -> tuple[int, int]:
    """(global offset, size) along ``tensor_dim`` of the block a rank holds after
    applying the shards of mesh dims ``< upto`` (all of them by default)."""
    offset, size = 0, length
    for m in range(len(placements) if upto is None else upto):
        p = placements[m]
        if isinstance(p, Shard) and p.dim == tensor_dim:
            sub_offset, size = chunk_span(size, mesh_shape[m], coord[m])
            offset += sub_offset
    return offset, size


def local_shape_and_offset(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the block held at mesh coordinate ``coord``."""
    spans = [local_span(n, d, placements, mesh_shape, coord) for d, n in enumerate(shape)]
    return tuple(s for _, s in spans), tuple(o for o, _ in spans)


def nested_sizes(length: int, mesh_sizes: Sequence[int]) -> list[int]:
    """Piece sizes when ``length`` is chunked over several mesh dims in turn, listed
    in row-major order of their coordinates (the rank order of a flattened communicator)."""
    sizes = [length]
    for parts in mesh_sizes:
        sizes = [s for whole in sizes for s in chunk_sizes(whole, parts)]
    return sizes


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def strides_like(shape: Sequence[int], like_shape: Sequence[int], like_stride: Sequence[int]) -> tuple[int, ...]:
    """Strides for a tensor of ``shape`` laid out like one of ``like_shape`` / ``like_stride``
    (a local block and its global tensor, either way round): the dims in the same memory
    order, each dim as far from the dims inside it as there (dense where dense, the same
    gap ratio where a slice left gaps), expanded (stride 0) where expanded. A later
    ``view`` or ``reshape`` then decides alike on both: a global tensor said contiguous
    over a transposed local block would let a ``view`` through that the block refuses."""
    n = len(shape)
    if n == 0:
        return ()
    # memory order, innermost first; a size-1 dim (its place is free) goes just inside its
    # outer neighbour, dim 0 outermost
    order = sorted((d for d in range(n) if like_shape[d] != 1), key=lambda d: (like_stride[d], -d))
    for d in range(n):
        if like_shape[d] == 1:
            order.insert(order.index(d - 1) if d > 0 else len(order), d)
    strides = [0] * n
    inner, extent = 1, 1  # the like tensor's and the new one's extent of the dims placed so far
    for d in order:
        step = like_stride[d]
        if step == 0 and like_shape[d] != 1:
            continue  # expanded
        if like_shape[d] == 1 or step == inner:
            strides[d] = extent
        elif step > inner and step % inner == 0:
            strides[d] = extent * (step // inner)
        else:  # an overlap or an odd gap: keep the dims apart (no view may merge them)
            strides[d] = extent + 1
        if like_shape[d] != 1:
            inner = step * like_shape[d]
        extent = strides[d] * max(shape[d], 1)
    return tuple(strides)
