"""Pure helpers for block layouts: which slice of a global tensor each rank holds.

Shards follow ``torch.chunk``: chunks of ``ceil(n / parts)`` elements, so trailing
ranks may hold fewer or none. Nested sharding of one tensor dim over several mesh
dims applies the mesh dims in order (outer mesh dim first), each to the block the
outer ones left. A ``_StridedShard`` gives a rank several runs of its block (one per
piece of the split factor); where one shards a dim, a rank's indices along it are a
list of runs (:func:`dim_runs`) instead of one span.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .placements import Placement, Shard, _StridedShard, shard_dim

Runs = tuple[tuple[int, int], ...]  # (offset, size) pairs, in order, none empty


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Sizes of the ``parts`` pieces ``torch.chunk`` would give (empty pieces as 0)."""
    step = -(-length // parts)
    return tuple(max(0, min(step, length - i * step)) for i in range(parts))


def chunk_span(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of piece ``index`` of ``chunk_sizes(length, parts)``."""
    step = -(-length // parts)
    offset = min(index * step, length)
    return offset, min(step, length - offset)


def split_runs(p: Placement, length: int, parts: int, index: int) -> Runs:
    """The runs of a block of ``length`` that piece ``index`` of ``parts`` holds under the
    shard placement ``p`` (one run for ``Shard``, up to ``split_factor`` for a
    ``_StridedShard``: the ``index``-th chunk of each of its pieces)."""
    if type(p) is _StridedShard:
        runs = []
        for j in range(p.split_factor):
            piece_offset, piece = chunk_span(length, p.split_factor, j)
            offset, size = chunk_span(piece, parts, index)
            if size:
                runs.append((piece_offset + offset, size))
        return tuple(runs)
    offset, size = chunk_span(length, parts, index)
    return ((offset, size),) if size else ()


def split_order(p: Placement, length: int, parts: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """How shard placement ``p`` splits a block of ``length`` over ``parts`` ranks, as
    (sizes of the pieces, the block's positions listed piece after piece): the order in
    which a gather concatenates them, None where it is the block's own (``Shard``)."""
    if type(p) is not _StridedShard:
        return chunk_sizes(length, parts), None
    pieces = [split_runs(p, length, parts, r) for r in range(parts)]
    sizes = tuple(sum(n for _, n in runs) for runs in pieces)
    order = tuple(i for runs in pieces for o, n in runs for i in range(o, o + n))
    return sizes, None if order == tuple(range(length)) else order


def runs_of(positions: Sequence[int]) -> Runs:
    """``positions`` (a sequence of indices) as runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in positions:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return tuple(runs)


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``order`` (position ``i`` of the result: where ``i`` went)."""
    inverse = [0] * len(order)
    for at, i in enumerate(order):
        inverse[i] = at
    return inverse


def compose_runs(outer: Runs, inner: Runs) -> Runs:
    """The runs of global indices held when ``inner`` (positions in the block) selects
    from a block whose positions are the global indices ``outer``."""
    out = []
    for pos, size in inner:
        for o, n in outer:
            if pos >= n:
                pos -= n
                continue
            take = min(n - pos, size)
            if out and out[-1][0] + out[-1][1] == o + pos:
                out[-1] = (out[-1][0], out[-1][1] + take)
            else:
                out.append((o + pos, take))
            size -= take
            pos = 0
            if not size:
                break
    return tuple(out)


def dim_runs(
    length: int,
    tensor_dim: int,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    upto: int | None = None,
) -> Runs:
    """The runs of global indices along ``tensor_dim`` that a rank holds after applying the
    shards of mesh dims ``< upto`` (all of them by default)."""
    runs: Runs = ((0, length),) if length else ()
    for m in range(len(placements) if upto is None else upto):
        p = placements[m]
        if shard_dim(p) == tensor_dim:
            held = sum(n for _, n in runs)
            runs = compose_runs(runs, split_runs(p, held, mesh_shape[m], coord[m]))
    return runs


def local_span(
    length: int,
    tensor_dim: int,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    upto: int | None = None,
) -> tuple[int, int]:
    """(global offset, size) along ``tensor_dim`` of the block a rank holds after
    applying the shards of mesh dims ``< upto`` (all of them by default). Under a
    ``_StridedShard`` the block is several runs: the offset is its first index (the
    dim's length when it is empty), as torch reports it."""
    upto = len(placements) if upto is None else upto
    if any(type(placements[m]) is _StridedShard and placements[m].dim == tensor_dim for m in range(upto)):
        runs = dim_runs(length, tensor_dim, placements, mesh_shape, coord, upto)
        return (runs[0][0] if runs else length), sum(n for _, n in runs)
    offset, size = 0, length
    for m in range(upto):
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


def global_strides(shape: Sequence[int], local: torch.Tensor) -> tuple[int, ...]:
    """Strides of a global tensor of ``shape`` whose block ``local`` is: laid out alike, so
    ops deciding from the global strides (a ``view``, ``reshape``'s view-or-copy) decide
    what the local tensor allows. A gradient handed to ``to_local``'s backward is often
    transposed or expanded (the backward of a transpose, of a sum)."""
    if local.is_contiguous():
        return contiguous_strides(shape)
    return strides_like(shape, local.shape, local.stride())


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
