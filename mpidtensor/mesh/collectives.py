"""Collectives on torch tensors over an mpi4py communicator.

Results are new C-contiguous tensors with the input's dtype and device.
All-to-all either describes its pieces with subarray datatypes (``Alltoallw``, one per
peer, count 1, displacement 0: no packing) or packs them in rank order for a regular
``Alltoall``/``Alltoallv``; uneven all-gathers either pad the pieces for a regular
``Allgather`` or use ``Allgatherv``. Each choice is by the global bytes per rank against a
measured threshold (``ALLTOALL_PACKED_MIN``, ``ALLGATHER_PADDED_MIN``), so every rank
makes the same one. Gather and scatter along a non-leading
dimension pack into, or unpack from, rank-ordered pieces with one local copy: a
datatype for one index along such a dimension has to be traversed column-wise,
which is far slower for small trailing dimensions.

Every collective reports itself to ``tracing.record``. Argument errors are raised
before any communication; under ``MPIDTENSOR_DEBUG=1`` the ranks first agree on the
collective and its arguments (``guard``), and with ``MPIDTENSOR_TIMEOUT`` set each
blocking MPI call is watched (``watchdog``).

Large counts: mpi4py 4 calls MPI-4's large-count (``_c``) routines, so an MPI-4
library takes element counts beyond 2**31 as they are. With an older MPI the counts
and displacements of one call must fit in a C int: ``MAX_COUNT`` is then 2**31 - 1 and
the collectives that would exceed it run in rounds of at most ``MAX_COUNT`` elements
(all-to-all never needs to: its counts are 1 and its displacements 0).
"""
from __future__ import annotations

from itertools import accumulate
from math import prod
from typing import Literal, Sequence

import torch
from mpi4py import MPI

from . import abort, guard, tracing, watchdog
from .buffers import as_buffer, derived, empty, has_mpi_type, mpi_type, stage, unstage

ReduceOp = Literal["sum", "avg", "min", "max", "product"]

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}

# (ranks, global bytes / ranks) from which packing + Alltoall(v) + unpacking beats one
# Alltoallw with subarray types. Measured here (MPICH 5.0.2, float32 S(0)->S(1), time
# Alltoallw / packed; docs/performance.md): 2 ranks 4K 0.53, 64K 1.22, 256K 1.88, 1M 0.37,
# 4M 0.40, 32M 0.45; 4 ranks 4K 0.85, 256K 0.47, 1M 0.54, 4M 1.16 (uneven 2.56), 32M 2.59.
ALLTOALL_PACKED_MIN: tuple[int, int] = (4, 4 << 20)

# (ranks, global bytes / ranks) from which an uneven all-gather pads the pieces to the
# largest for a regular Allgather (a copy on each side) instead of calling Allgatherv.
# Measured (time Allgatherv / padded, leading dim): 2 ranks 4K 0.52, 256K 0.86, 1M 0.05,
# 32M 0.72; 4 ranks 4K 0.75, 64K 0.98, 256K 1.67, 1M 19.5, 4M 24.3.
ALLGATHER_PADDED_MIN: tuple[int, int] = (4, 256 << 10)

# The most elements one count or displacement of one MPI call may hold (None: no limit).
MAX_COUNT: int | None = None if MPI.Get_version() >= (4, 0) else 2**31 - 1

abort.install()  # an uncaught exception on one rank ends the job instead of hanging it


def all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, *, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order; rank r's has ``sizes[r]`` there."""
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (dim,))
        facts.update(dim=guard.norm_dim(dim, tensor.ndim), sizes=tuple(sizes))
        guard.check("all_gather", comm, facts, lambda: _gather_args(tensor, comm, dim, sizes))
    dim = _gather_args(tensor, comm, dim, sizes)
    send = stage(tensor)
    counts = _counts(send.shape, dim, sizes)
    datatype = mpi_type(tensor.dtype)
    tracing.record("all_gather", send.nbytes)
    even = len(set(counts)) == 1
    # Same on every rank: counts are global. Uneven pieces below the threshold go padded.
    padded = (not even and _beyond(ALLGATHER_PADDED_MIN, comm.size, sum(counts) * send.element_size())
              and (MAX_COUNT is None or max(counts) * comm.size <= MAX_COUNT))
    if padded:
        width = max(counts)
        staged = empty((width,), tensor)
        staged[:send.numel()] = send.view(-1)
        flat = empty((width * comm.size,), tensor)
        chunks = [flat[r * width:r * width + c] for r, c in enumerate(counts)]
    else:
        flat = empty((sum(counts),), tensor)  # the pieces back to back, in rank order
        chunks = None
    _enter("all_gather", comm, tensor.dtype, counts)
    try:
        if MAX_COUNT is not None and sum(counts) > MAX_COUNT:
            _all_gather_rounds(send.view(-1), flat, counts, comm, datatype)
        elif padded:  # MPICH's Allgather on padded pieces beats its Allgatherv here
            comm.Allgather([as_buffer(staged), width, datatype], [as_buffer(flat), width, datatype])
        elif even:  # even pieces: MPICH's Allgather is ~3x faster than Allgatherv here
            comm.Allgather([as_buffer(send), send.numel(), datatype], [as_buffer(flat), counts[0], datatype])
        else:
            comm.Allgatherv([as_buffer(send), send.numel(), datatype],
                            [as_buffer(flat), (counts, _offsets(counts)), datatype])
    finally:
        _leave()
    if chunks is None:
        if prod(send.shape[:dim]) == 1:  # pieces are contiguous runs of the result
            return unstage(flat.view(_resized(send.shape, dim, sum(sizes))), tensor)
        chunks = flat.split(counts)
    pieces = [chunk.view(_resized(send.shape, dim, size)) for chunk, size in zip(chunks, sizes)]
    return unstage(torch.cat(pieces, dim), tensor)


def all_to_all(
    tensor: torch.Tensor,
    comm: MPI.Intracomm,
    *,
    split_dim: int,
    concat_dim: int,
    split_sizes: Sequence[int],
    concat_sizes: Sequence[int],
) -> torch.Tensor:
    """Send piece k of ``tensor`` (``split_sizes[k]`` along ``split_dim``) to rank k and
    concatenate the pieces received (``concat_sizes[k]`` from rank k) along ``concat_dim``."""
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (concat_dim,))
        facts.update(split_dim=guard.norm_dim(split_dim, tensor.ndim),
                     concat_dim=guard.norm_dim(concat_dim, tensor.ndim), split_sizes=tuple(split_sizes), concat_sizes=tuple(concat_sizes))
        guard.check("all_to_all", comm, facts,
                    lambda: _all_to_all_args(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes))
    split_dim, concat_dim = _all_to_all_args(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes)
    send = stage(tensor)
    shape = _resized(_resized(send.shape, split_dim, split_sizes[comm.rank]), concat_dim, sum(concat_sizes))
    tracing.record("all_to_all", send.nbytes)
    # Same on every rank: the global tensor's size, not this rank's shard.
    total = prod(_resized(send.shape, concat_dim, sum(concat_sizes))) * send.element_size()
    # Packing puts every piece in one count: it must fit on every rank, so take the largest.
    other = prod(s for d, s in enumerate(send.shape) if d not in (split_dim, concat_dim))
    fits = MAX_COUNT is None or max(
        other * (sum(split_sizes) * c + s * sum(concat_sizes)) for s, c in zip(split_sizes, concat_sizes)
    ) <= MAX_COUNT
    packed = fits and _beyond(ALLTOALL_PACKED_MIN, comm.size, total)
    _enter("all_to_all", comm, tensor.dtype, list(split_sizes))
    try:
        if packed:
            out = _all_to_all_packed(send, comm, split_dim, concat_dim, split_sizes, concat_sizes, shape)
        else:
            out = _all_to_all_typed(send, comm, split_dim, concat_dim, split_sizes, concat_sizes, shape)
    finally:
        _leave()
    return unstage(out, tensor)


def _all_to_all_typed(send, comm, split_dim, concat_dim, split_sizes, concat_sizes, shape) -> torch.Tensor:
    """One ``Alltoallw`` with a subarray datatype per piece: no local copies."""
    out = empty(shape, send)
    zeros = [0] * comm.size
    send_counts, send_types = _blocks(send, split_dim, split_sizes)
    recv_counts, recv_types = _blocks(out, concat_dim, concat_sizes)
    comm.Alltoallw([as_buffer(send), (send_counts, zeros), send_types],
                   [as_buffer(out), (recv_counts, zeros), recv_types])
    return out


def _all_to_all_packed(send, comm, split_dim, concat_dim, split_sizes, concat_sizes, shape) -> torch.Tensor:
    """Pack the pieces in rank order, one ``Alltoall`` (even pieces) or ``Alltoallv``, unpack:
    a copy on each side unless the split/concat dim leads, but MPICH's regular all-to-all."""
    flat_send = _pieces_in_rank_order(send, split_dim, split_sizes)
    send_counts = _counts(send.shape, split_dim, split_sizes)
    mine = _resized(send.shape, split_dim, split_sizes[comm.rank])
    recv_counts = _counts(mine, concat_dim, concat_sizes)
    flat = empty((sum(recv_counts),), send)
    datatype = mpi_type(send.dtype)
    if len(set(split_sizes)) == 1 and len(set(concat_sizes)) == 1:
        comm.Alltoall([as_buffer(flat_send), send_counts[0], datatype], [as_buffer(flat), recv_counts[0], datatype])
    else:
        comm.Alltoallv([as_buffer(flat_send), (send_counts, _offsets(send_counts)), datatype],
                       [as_buffer(flat), (recv_counts, _offsets(recv_counts)), datatype])
    if prod(shape[:concat_dim]) == 1:  # received pieces are contiguous runs of the result
        return flat.view(shape)
    pieces = [chunk.view(_resized(mine, concat_dim, size)) for chunk, size in zip(flat.split(recv_counts), concat_sizes)]
    return torch.cat(pieces, concat_dim)


def all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = "sum") -> torch.Tensor:
    """Reduce ``tensor`` elementwise over all ranks; every rank gets the result."""
    if guard.ENABLED:
        guard.check("all_reduce", comm, {**guard.tensor_facts(tensor), "op": op},
                    lambda: _reduction(tensor.dtype, op))
    dtype, mpi_op = _reduction(tensor.dtype, op)
    send = stage(tensor, dtype)
    out = empty(send.shape, tensor, dtype)
    tracing.record("all_reduce", send.nbytes)
    datatype = mpi_type(dtype)
    _enter("all_reduce", comm, dtype, [send.numel()])
    try:
        for start, n in _spans(send.numel()):
            comm.Allreduce([_span(send, start, n), n, datatype], [_span(out, start, n), n, datatype], mpi_op)
    finally:
        _leave()
    if op == "avg":
        out /= comm.size
    return unstage(out, tensor)


def reduce_scatter(
    tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp, *, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks; rank r gets the ``sizes[r]`` slice along ``dim``."""
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor)
        facts.update(op=op, dim=guard.norm_dim(dim, tensor.ndim), sizes=tuple(sizes))
        guard.check("reduce_scatter", comm, facts, lambda: _reduce_scatter_args(tensor, comm, op, dim, sizes))
    dim, dtype, mpi_op = _reduce_scatter_args(tensor, comm, op, dim, sizes)
    send = stage(tensor.movedim(dim, 0), dtype)  # MPI splits memory in order: ``dim`` must lead
    out = empty(_resized(send.shape, 0, sizes[comm.rank]), tensor, dtype)
    tracing.record("reduce_scatter", send.nbytes)
    datatype = mpi_type(dtype)
    counts = _counts(send.shape, 0, sizes)
    _enter("reduce_scatter", comm, dtype, counts)
    try:
        if MAX_COUNT is not None and send.numel() > MAX_COUNT:
            _reduce_scatter_rounds(send.view(-1), out.view(-1), counts, comm, datatype, mpi_op)
        else:
            comm.Reduce_scatter([as_buffer(send), send.numel(), datatype],
                                [as_buffer(out), out.numel(), datatype], counts, mpi_op)
    finally:
        _leave()
    if op == "avg":
        out /= comm.size
    return unstage(out.movedim(0, dim).contiguous(), tensor)  # a copy unless ``dim`` leads


def broadcast(tensor: torch.Tensor, comm: MPI.Intracomm, root: int = 0) -> torch.Tensor:
    """``root``'s ``tensor`` on every rank (all ranks pass the same shape and dtype)."""
    if guard.ENABLED:
        guard.check("broadcast", comm, {**guard.tensor_facts(tensor), "root": root}, lambda: _root(root, comm))
    _root(root, comm)
    is_root = comm.rank == root
    out = stage(tensor, copy=True) if is_root else empty(tensor.shape, tensor)
    tracing.record("broadcast", out.nbytes if is_root else 0)
    datatype = mpi_type(out.dtype)
    _enter("broadcast", comm, out.dtype, [out.numel()])
    try:
        for start, n in _spans(out.numel()):
            comm.Bcast([_span(out, start, n), n, datatype], root)
    finally:
        _leave()
    return unstage(out, tensor)


def scatter(tensor: torch.Tensor, comm: MPI.Intracomm, root: int, *, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Rank r gets the ``sizes[r]`` slice along ``dim`` of ``root``'s ``tensor``.

    Every rank passes a tensor of the full shape; only root's contents are read.
    """
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor)
        facts.update(root=root, dim=guard.norm_dim(dim, tensor.ndim), sizes=tuple(sizes))
        guard.check("scatter", comm, facts, lambda: _scatter_args(tensor, comm, root, dim, sizes))
    dim = _scatter_args(tensor, comm, root, dim, sizes)
    rank = comm.rank
    counts = _counts(tensor.shape, dim, sizes)
    out = empty(_resized(tensor.shape, dim, sizes[rank]), tensor)
    datatype = mpi_type(tensor.dtype)
    pieces = _pieces_in_rank_order(tensor, dim, sizes) if rank == root else None
    tracing.record("scatter", tensor.nbytes if rank == root else 0)
    _enter("scatter", comm, tensor.dtype, counts)
    try:
        if MAX_COUNT is not None and sum(counts) > MAX_COUNT:
            _scatter_rounds(pieces, out.view(-1), counts, comm, root, datatype)
        else:
            send = None if pieces is None else [as_buffer(pieces), (counts, _offsets(counts)), datatype]
            comm.Scatterv(send, [as_buffer(out), out.numel(), datatype], root)
    finally:
        _leave()
    return unstage(out, tensor)


def _beyond(threshold: tuple[int, int], size: int, total_bytes: int) -> bool:
    """Whether a communicator of ``size`` ranks moving ``total_bytes`` in all reaches a
    ``(ranks, bytes per rank)`` threshold: the same answer on every rank."""
    return size >= threshold[0] and total_bytes // size >= threshold[1]


# --- argument checks: identical on every rank when the ranks agree (see guard) ---------------

def _gather_args(tensor: torch.Tensor, comm: MPI.Intracomm, dim: int, sizes: Sequence[int]) -> int:
    dim = _dim(dim, tensor.ndim)
    _check_sizes(sizes, comm)
    if tensor.size(dim) != sizes[comm.rank]:
        raise ValueError(f"tensor has {tensor.size(dim)} along dim {dim}, sizes[{comm.rank}] is {sizes[comm.rank]}")
    return dim


def _all_to_all_args(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes) -> tuple[int, int]:
    split_dim, concat_dim = _dim(split_dim, tensor.ndim), _dim(concat_dim, tensor.ndim)
    if split_dim == concat_dim:
        raise ValueError("split_dim and concat_dim must differ")
    _check_sizes(split_sizes, comm, total=tensor.size(split_dim))
    _check_sizes(concat_sizes, comm)
    if tensor.size(concat_dim) != concat_sizes[comm.rank]:
        raise ValueError(f"tensor has {tensor.size(concat_dim)} along dim {concat_dim}, "
                         f"concat_sizes[{comm.rank}] is {concat_sizes[comm.rank]}")
    return split_dim, concat_dim


def _reduce_scatter_args(tensor, comm, op, dim, sizes) -> tuple[int, torch.dtype, MPI.Op]:
    dim = _dim(dim, tensor.ndim)
    dtype, mpi_op = _reduction(tensor.dtype, op)
    _check_sizes(sizes, comm, total=tensor.size(dim))
    return dim, dtype, mpi_op


def _scatter_args(tensor, comm, root, dim, sizes) -> int:
    _root(root, comm)
    dim = _dim(dim, tensor.ndim)
    _check_sizes(sizes, comm, total=tensor.size(dim))
    return dim


def _root(root: int, comm: MPI.Intracomm) -> None:
    if not 0 <= root < comm.size:
        raise ValueError(f"root {root} is not a rank of a communicator of {comm.size}")


# --- watchdog slot --------------------------------------------------------------------------

def _enter(kind: str, comm: MPI.Intracomm, dtype: torch.dtype, counts: list[int]) -> None:
    if watchdog.ENABLED:
        watchdog.enter(kind, comm, {"dtype": dtype, "counts": counts})


def _leave() -> None:
    if watchdog.ENABLED:
        watchdog.leave()


# --- rounds of at most MAX_COUNT elements (MPI libraries without large counts) -------------

def _spans(total: int) -> list[tuple[int, int]]:
    """``(start, length)`` of consecutive rounds covering ``total`` elements (one if it fits)."""
    if MAX_COUNT is None or total <= MAX_COUNT:
        return [(0, total)]
    return [(start, min(MAX_COUNT, total - start)) for start in range(0, total, MAX_COUNT)]


def _span(tensor: torch.Tensor, start: int, n: int):
    """A buffer over elements ``[start, start + n)`` of a C-contiguous tensor."""
    if start == 0 and n == tensor.numel():
        return as_buffer(tensor)
    return as_buffer(tensor.view(-1)[start:start + n])


def _round_parts(counts: Sequence[int], size: int) -> list[tuple[int, list[int]]]:
    """Rounds over rank-ordered pieces of ``counts`` elements: ``(offset in each piece,
    elements of each piece)``, with at most ``MAX_COUNT`` elements per round in all."""
    width = max(1, MAX_COUNT // size)
    return [(start, [min(max(c - start, 0), width) for c in counts]) for start in range(0, max(counts), width)]


def _all_gather_rounds(send: torch.Tensor, flat: torch.Tensor, counts, comm, datatype) -> None:
    offsets = _offsets(counts)
    for start, part in _round_parts(counts, comm.size):
        got = flat.new_empty(sum(part))
        mine = part[comm.rank]
        comm.Allgatherv([_span(send, start, mine), mine, datatype],
                        [as_buffer(got), (part, _offsets(part)), datatype])
        for offset, piece in zip(offsets, got.split(part)):
            flat[offset + start:offset + start + len(piece)] = piece


def _reduce_scatter_rounds(send: torch.Tensor, out: torch.Tensor, counts, comm, datatype, mpi_op) -> None:
    offsets = _offsets(counts)
    for start, part in _round_parts(counts, comm.size):
        packed = torch.cat([send[o + start:o + start + n] for o, n in zip(offsets, part)])
        mine = part[comm.rank]
        comm.Reduce_scatter([as_buffer(packed), len(packed), datatype],
                            [_span(out, start, mine), mine, datatype], part, mpi_op)


def _scatter_rounds(pieces: torch.Tensor | None, out: torch.Tensor, counts, comm, root, datatype) -> None:
    offsets = _offsets(counts)
    for start, part in _round_parts(counts, comm.size):
        send = None
        if pieces is not None:
            packed = torch.cat([pieces[o + start:o + start + n] for o, n in zip(offsets, part)])
            send = [as_buffer(packed), (part, _offsets(part)), datatype]
        mine = part[comm.rank]
        comm.Scatterv(send, [_span(out, start, mine), mine, datatype], root)


# --- layout helpers ---------------------------------------------------------------------------

def _pieces_in_rank_order(tensor: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``tensor``'s pieces along ``dim``, each C-contiguous, back to back (one copy at most), flat."""
    if prod(tensor.shape[:dim]) == 1:  # already so when C-contiguous
        return stage(tensor).view(-1)
    flat = empty((tensor.numel(),), tensor)
    pieces = tensor.detach().split(list(sizes), dim)
    for chunk, piece in zip(flat.split([p.numel() for p in pieces]), pieces):
        chunk.view(piece.shape).copy_(piece)
    return flat


def _reduction(dtype: torch.dtype, op: str) -> tuple[torch.dtype, MPI.Op]:
    """The dtype MPI reduces in and the MPI op for ``op`` on ``dtype``."""
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_OPS)}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"'avg' needs a floating or complex dtype, got {dtype}")
    if op in ("min", "max") and dtype.is_complex:
        raise TypeError(f"{op!r} is undefined on complex dtype {dtype}")
    if dtype == torch.bool:
        return dtype, _BOOL_OPS[op]
    if has_mpi_type(dtype):
        return dtype, _OPS[op]
    return (torch.complex64 if dtype.is_complex else torch.float32), _OPS[op]  # as torch accumulates


def _blocks(tensor: torch.Tensor, dim: int, sizes: Sequence[int]) -> tuple[list[int], list[MPI.Datatype]]:
    """Alltoallw counts and datatypes of ``tensor``'s pieces along ``dim``, one per rank.

    Each piece is a subarray located by its start, so displacements stay 0 and no count
    or offset can overflow a C int; an empty piece goes as count 0 (subarrays cannot be empty).
    """
    shape = tuple(tensor.shape)
    counts, types = [], []
    for start, size in zip(_offsets(sizes), sizes):
        piece = _resized(shape, dim, size)
        if not prod(piece):
            counts.append(0)
            types.append(mpi_type(tensor.dtype))
            continue
        starts = _resized((0,) * len(shape), dim, start)
        counts.append(1)
        types.append(derived(("block", tensor.dtype, shape, piece, starts),
                             lambda: mpi_type(tensor.dtype).Create_subarray(shape, piece, starts)))
    return counts, types


def _counts(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> list[int]:
    """Elements in each piece of ``sizes[r]`` indices along ``dim``."""
    per_index = prod(_resized(shape, dim, 1))
    return [size * per_index for size in sizes]


def _offsets(sizes: Sequence[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))[:-1]


def _resized(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1:])


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _check_sizes(sizes: Sequence[int], comm: MPI.Intracomm, total: int | None = None) -> None:
    if len(sizes) != comm.size or min(sizes) < 0:
        raise ValueError(f"need {comm.size} non-negative sizes, got {list(sizes)}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"sizes {list(sizes)} do not add up to {total}")
