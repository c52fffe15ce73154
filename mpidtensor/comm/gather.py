"""All-gather: every rank's piece, concatenated along a dim in rank order, on every rank.

Even pieces go by one ``Allgather``; along a later dim, small ones (``GATHER_TYPED_MAX``)
land in place through a resized vector datatype, larger ones arrive back to back and are
interleaved by one copy. Uneven pieces are padded to the largest for a regular
``Allgather`` from ``ALLGATHER_PADDED_MIN`` on, else gathered by ``Allgatherv``; beyond
``MAX_COUNT`` elements they go in rounds. Every choice reads facts all ranks share, so
every rank makes the same one. A subclass with its own functional all-gather (NF4)
gathers itself (``self_gathering``).
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import NamedTuple, Sequence

import torch
from mpi4py import MPI

from ..runtime import caches
from . import base, guard, recorders, self_gathering
from .base import TRACED, Run, Types, beyond, check_dim, check_sizes, enter, leave, limits, piece_counts, resized
from .buffers import as_buffer, derived, empty, from_address, host_buffer, mpi_type, reuse, stage, unstage
from .prepared import Prepared, owned_types
from .rounds import all_gather_rounds, offsets


class _Gather(NamedTuple):
    """How one all-gather runs, from facts every rank shares (cached per signature)."""

    dim: int
    counts: tuple[int, ...]  # elements of each rank's piece
    offsets: tuple[int, ...]  # where each piece starts in the pieces back to back
    datatype: MPI.Datatype
    mode: str  # "even" (Allgather), "typed" (Allgather into a vector type), "padded" (Allgather of
    # padded pieces), "v" (Allgatherv), "rounds"
    width: int  # elements of a padded piece
    shape: tuple[int, ...]  # the result's
    runs: bool  # the pieces are contiguous runs of the result: no concatenation
    rows: int  # otherwise the result is ``rows`` runs of every rank's piece in turn:
    columns: tuple[int, ...]  # piece r adds ``columns[r]`` elements to each row


@lru_cache(maxsize=1024)
def _layout(shape: torch.Size, dtype: torch.dtype, dim: int, sizes: tuple[int, ...],
            size: int, rank: int, limits: tuple) -> _Gather:
    """Checks the arguments; ``limits`` (``base.limits()``) keys the cache by the tunables it reads."""
    dim = check_dim(dim, len(shape))
    check_sizes(sizes, size)
    if shape[dim] != sizes[rank]:
        raise ValueError(f"tensor has {shape[dim]} along dim {dim}, sizes[{rank}] is {sizes[rank]}")
    counts = tuple(piece_counts(shape, dim, sizes))
    max_count = base.MAX_COUNT
    if max_count is not None and sum(counts) > max_count:
        mode = "rounds"
    elif len(set(counts)) == 1 and prod(shape[:dim]) > 1 and 0 < counts[0] * dtype.itemsize <= base.GATHER_TYPED_MAX:
        mode = "typed"
    elif len(set(counts)) == 1:
        mode = "even"  # MPICH's Allgather is ~3x faster than its Allgatherv here
    elif (beyond(base.ALLGATHER_PADDED_MIN, size, sum(counts) * dtype.itemsize)
          and (max_count is None or max(counts) * size <= max_count)):
        mode = "padded"  # as is its Allgather on padded pieces above the threshold
    else:
        mode = "v"
    rows, starts, width = prod(shape[:dim]), tuple(offsets(counts)), max(counts)
    # Padded pieces are runs of the result too when only the tail is padding (full pieces,
    # one short, empty ones: torch.chunk's layout): piece r then starts at r * width.
    tail_padded = all(c == 0 or o == r * width for r, (c, o) in enumerate(zip(counts, starts)))
    runs = rows == 1 and (mode != "padded" or tail_padded)
    return _Gather(dim, counts, starts, mpi_type(dtype), mode, width, resized(shape, dim, sum(sizes)),
                   runs, rows, tuple(c // rows if rows else 0 for c in counts))


caches.on_clear("all-gather layouts", _layout.cache_clear, holds_meshes=False)


def all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, *, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order; rank r's has ``sizes[r]`` there.
    A subclass with its own functional all-gather (NF4) gathers itself (``self_gathering``)."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, TRACED):
        return base.TRACED_OPS["all_gather"](tensor, comm, dim, sizes)
    sizes = tuple(sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (dim,))
        facts.update(dim=guard.norm_dim(dim, tensor.ndim), sizes=sizes)
        guard.check("all_gather", comm, facts,
                    lambda: _layout(tensor.shape, tensor.dtype, dim, sizes, comm.size, comm.rank, limits()))
    if type(tensor) is not torch.Tensor and self_gathering.gathers_itself(tensor, sizes):
        return self_gathering.all_gather(tensor, comm, dim, all_gather)
    lay = _layout(tensor.shape, tensor.dtype, dim, sizes, comm.size, comm.rank, limits())
    send = stage(tensor)
    recorders.record("all_gather", send.nbytes)
    enter("all_gather", comm, tensor.dtype, list(lay.counts))
    try:
        out = _runner(lay, comm, send.dtype, derived)(send)
    finally:
        leave()
    return unstage(out, tensor)


def prepare_all_gather(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm, *, dim: int,
                       sizes: Sequence[int]) -> Prepared:
    """:func:`all_gather` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared."""
    sizes = tuple(sizes)
    lay = _layout(torch.Size(shape), dtype, dim, sizes, comm.size, comm.rank, limits())
    owned, own = owned_types()
    return Prepared("all_gather", comm, shape, dtype, _runner(lay, comm, dtype, own, host=True),
                    lambda t: all_gather(t, comm, dim=dim, sizes=sizes), owned)


def _runner(lay: _Gather, comm: MPI.Intracomm, dtype: torch.dtype, types: Types, host: bool = False) -> Run:
    """The all-gather of ``lay`` as a function of the staged send tensor: MPI, then the
    interleaving copy if any. ``types`` gives its derived datatype; ``host``: every send
    will be a C-contiguous host tensor (a prepared collective's), so buffers reach MPI
    unchecked. Made per call by :func:`all_gather`, once by a prepared one."""
    mode, datatype, shape, count = lay.mode, lay.datatype, lay.shape, lay.counts[0]
    buf = host_buffer if host else as_buffer
    if mode == "typed":  # piece r lands as rows of columns[r] elements, ``r`` pieces in
        columns, width = lay.columns[0], prod(shape[lay.dim:])
        pieces = types(("columns", dtype, lay.rows, columns, width),
                       lambda: _column_blocks(datatype, lay.rows, columns, width))

        def typed(send: torch.Tensor) -> torch.Tensor:
            out = empty(shape, send)
            comm.Allgather([buf(send), count, datatype], [buf(out), 1, pieces])
            return out
        return typed
    if mode in ("even", "v"):  # received straight into the result, or back to back and interleaved
        runs, size, mine = lay.runs, comm.size, lay.counts[comm.rank]
        flat_shape = shape if runs else (sum(lay.counts),)
        gather, recv = (comm.Allgather, count) if mode == "even" else (comm.Allgatherv, (lay.counts, lay.offsets))
        if host:  # its buffers reused from call to call: a Python call each (``buffers.reuse``)
            flats, outs = reuse(flat_shape, dtype), None if runs else reuse(shape, dtype)

            def direct_host(send: torch.Tensor) -> torch.Tensor:
                flat, flat_buffer = flats.take()
                gather([from_address(send.data_ptr(), send.nbytes), mine, datatype], [flat_buffer, recv, datatype])
                return flat if runs else _interleave(flat, lay, size, outs.take()[0])
            return direct_host

        def direct(send: torch.Tensor) -> torch.Tensor:
            flat = empty(flat_shape, send)
            gather([buf(send), mine, datatype], [buf(flat), recv, datatype])
            return flat if runs else _interleave(flat, lay, size, empty(shape, send))
        return direct
    max_count = base.MAX_COUNT
    return lambda send: _padded_or_rounds(lay, send, comm, max_count)


def _padded_or_rounds(lay: _Gather, send: torch.Tensor, comm: MPI.Intracomm, max_count: int | None) -> torch.Tensor:
    """An all-gather of pieces padded to the longest for one ``Allgather`` ("padded") or in "rounds"."""
    datatype = lay.datatype
    if lay.mode == "padded":
        staged = send  # a full piece is sent as it is; a short one is padded first
        if send.numel() != lay.width:
            staged = empty((lay.width,), send)
            staged[:send.numel()] = send.view(-1)
        flat = empty((lay.width * comm.size,), send)
        comm.Allgather([as_buffer(staged), lay.width, datatype], [as_buffer(flat), lay.width, datatype])
        if lay.runs:  # the result is the padded pieces' prefix: no copy out
            return flat[:sum(lay.counts)].view(lay.shape)
    else:
        flat = empty((sum(lay.counts),), send)  # the pieces back to back, in rank order
        all_gather_rounds(send.view(-1), flat, lay.counts, comm, datatype, max_count)
        if lay.runs:
            return flat.view(lay.shape)
    return _interleave(flat, lay, comm.size, empty(lay.shape, send))


def _column_blocks(datatype: MPI.Datatype, rows: int, columns: int, width: int) -> MPI.Datatype:
    """``rows`` runs of ``columns`` elements ``width`` apart, its extent one run: piece r of an
    all-gather then starts ``r`` runs in (uncommitted; the caller commits)."""
    vector = datatype.Create_vector(rows, columns, width)
    resized_type = vector.Create_resized(0, columns * datatype.Get_extent()[1])
    vector.Free()
    return resized_type


def _interleave(flat: torch.Tensor, lay: _Gather, size: int, out: torch.Tensor) -> torch.Tensor:
    """``out``, the result of an all-gather along a non-leading dim (a C-contiguous tensor of
    ``lay.shape``), from its pieces back to back in rank order (padded to ``lay.width`` each
    in "padded" mode): one copy into it."""
    if lay.mode == "even":  # (views of any size, an empty one included: no division)
        rows, columns = lay.rows, lay.columns[0]  # the pieces [size, rows, columns] read as [rows, size, columns]
        out.view(rows, size, columns).copy_(flat.as_strided((rows, size, columns), (columns, rows * columns, 1)))
        return out
    if not out.numel():
        return out
    rows = out.view(lay.rows, out.numel() // lay.rows)
    stride = lay.width if lay.mode == "padded" else None
    start = column = 0
    for count, width in zip(lay.counts, lay.columns):
        if width:
            rows[:, column:column + width].copy_(flat[start:start + count].view(lay.rows, width))
        start += stride if stride is not None else count
        column += width
    return out
