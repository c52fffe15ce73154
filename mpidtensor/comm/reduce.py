"""Reductions over all ranks: all-reduce (every rank gets the result) and reduce-scatter
(rank r gets its slice along a dim).

Dtypes MPI cannot reduce (bfloat16, float16, complex32) are reduced in float32 or complex64
as torch accumulates (``base.reduction``); ``avg`` is a sum divided after. An all-reduce
may reduce into its input (``MPI_IN_PLACE``) when the caller gives it up. Beyond
``MAX_COUNT`` elements both run in rounds.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import caches
from . import base, guard, recorders
from .base import (
    TRACED,
    ReduceOp,
    Run,
    check_dim,
    check_sizes,
    enter,
    leave,
    piece_counts,
    reduction,
    resized,
)
from .buffers import as_buffer, empty, from_address, host_buffer, mpi_type, reuse, stage, unstage
from .prepared import Prepared
from .rounds import reduce_scatter_rounds, span, spans


def all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = "sum", *,
               inplace: bool = False) -> torch.Tensor:
    """Reduce ``tensor`` elementwise over all ranks; every rank gets the result.

    ``inplace``: the caller made ``tensor`` and no longer needs its value, so MPI may
    reduce into its memory (``MPI_IN_PLACE``: no output buffer, no copy of the input)
    when that memory is what MPI would read anyway."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, TRACED):
        return base.TRACED_OPS["all_reduce"](tensor, comm, op)
    if guard.ENABLED:
        guard.check("all_reduce", comm, {**guard.tensor_facts(tensor), "op": op},
                    lambda: reduction(tensor.dtype, op))
    dtype, mpi_op = reduction(tensor.dtype, op)
    send = stage(tensor, dtype)
    if recorders.ACTIVE:
        recorders.record("all_reduce", send.nbytes)
    enter("all_reduce", comm, dtype, [send.numel()])
    try:
        inplace = inplace and send.data_ptr() == tensor.data_ptr()
        out = _all_reduce_runner(comm, mpi_type(dtype), mpi_op, op, inplace)(send)
    finally:
        leave()
    return unstage(out, tensor)


def prepare_all_reduce(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm,
                       op: ReduceOp = "sum", *, inplace: bool = False) -> Prepared:
    """:func:`all_reduce` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared (``inplace``
    as there: the caller owns every tensor it passes)."""
    reduce_dtype, mpi_op = reduction(dtype, op)
    fast = None
    if reduce_dtype == dtype:  # otherwise staging converts: the general function's work
        fast = _all_reduce_runner(comm, mpi_type(dtype), mpi_op, op, inplace, host=True)
    return Prepared("all_reduce", comm, shape, dtype, fast, lambda t: all_reduce(t, comm, op, inplace=inplace))


def _all_reduce_runner(comm: MPI.Intracomm, datatype: MPI.Datatype, mpi_op: MPI.Op, op: str, inplace: bool,
                       host: bool = False) -> Run:
    """The all-reduce as a function of the staged send tensor: into it (``MPI_IN_PLACE``) or
    into a new buffer. ``host``: every send will be a C-contiguous host tensor (a prepared
    collective's), so buffers reach MPI unchecked."""
    buf, avg, size, max_count = host_buffer if host else as_buffer, op == "avg", comm.size, base.MAX_COUNT

    def reduce(send: torch.Tensor) -> torch.Tensor:
        out = send if inplace else empty(send.shape, send)
        numel = send.numel()
        if max_count is None or numel <= max_count:  # the common case: one call
            if inplace:
                comm.Allreduce(MPI.IN_PLACE, [buf(out), numel, datatype], mpi_op)
            else:
                comm.Allreduce([buf(send), numel, datatype], [buf(out), numel, datatype], mpi_op)
        else:
            for start, n in spans(numel, max_count):
                if inplace:
                    comm.Allreduce(MPI.IN_PLACE, [span(out, start, n), n, datatype], mpi_op)
                else:
                    comm.Allreduce([span(send, start, n), n, datatype], [span(out, start, n), n, datatype], mpi_op)
        if avg:
            out /= size
        return out
    return reduce


def reduce_scatter(
    tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp, *, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks; rank r gets the ``sizes[r]`` slice along ``dim``."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, TRACED):
        return base.TRACED_OPS["reduce_scatter"](tensor, comm, op, dim, sizes)
    sizes = tuple(sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor)
        facts.update(op=op, dim=guard.norm_dim(dim, tensor.ndim), sizes=sizes)
        guard.check("reduce_scatter", comm, facts, lambda: _reduce_scatter_layout(
            tensor.shape, tensor.dtype, op, dim, sizes, comm.size, comm.rank))
    dim, dtype, mpi_op, datatype, counts, out_shape = _reduce_scatter_layout(
        tensor.shape, tensor.dtype, op, dim, sizes, comm.size, comm.rank)
    send = stage(tensor.movedim(dim, 0) if dim else tensor, dtype)  # MPI splits memory in order: ``dim`` must lead
    recorders.record("reduce_scatter", send.nbytes)
    enter("reduce_scatter", comm, dtype, counts)
    try:
        out = _reduce_scatter_runner(comm, datatype, mpi_op, op, counts, out_shape)(send)
    finally:
        leave()
    if dim:
        out = out.movedim(0, dim).contiguous()  # a copy
    return unstage(out, tensor)


def prepare_reduce_scatter(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm,
                           op: ReduceOp, *, dim: int, sizes: Sequence[int]) -> Prepared:
    """:func:`reduce_scatter` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared."""
    sizes = tuple(sizes)
    dim, reduce_dtype, mpi_op, datatype, counts, out_shape = _reduce_scatter_layout(
        torch.Size(shape), dtype, op, dim, sizes, comm.size, comm.rank)
    fast = None
    if dim == 0 and reduce_dtype == dtype:  # otherwise staging moves or converts
        fast = _reduce_scatter_runner(comm, datatype, mpi_op, op, counts, out_shape, host=True, dtype=dtype)
    return Prepared("reduce_scatter", comm, shape, dtype, fast,
                    lambda t: reduce_scatter(t, comm, op, dim=dim, sizes=sizes))


@lru_cache(maxsize=1024)
def _reduce_scatter_layout(shape: torch.Size, dtype: torch.dtype, op: str, dim: int, sizes: tuple[int, ...],
                           size: int, rank: int):
    """``(dim, reduction dtype, MPI op, MPI datatype, counts, output shape with dim leading)``."""
    dim = check_dim(dim, len(shape))
    reduce_dtype, mpi_op = reduction(dtype, op)
    check_sizes(sizes, size, total=shape[dim])
    leading = (shape[dim], *shape[:dim], *shape[dim + 1:])
    return (dim, reduce_dtype, mpi_op, mpi_type(reduce_dtype), piece_counts(leading, 0, sizes),
            resized(leading, 0, sizes[rank]))


caches.on_clear("reduce-scatter layouts", _reduce_scatter_layout.cache_clear, holds_meshes=False)


def _reduce_scatter_runner(comm: MPI.Intracomm, datatype: MPI.Datatype, mpi_op: MPI.Op, op: str, counts: list[int],
                           out_shape: tuple[int, ...], host: bool = False, dtype: torch.dtype | None = None) -> Run:
    """The reduce-scatter into a new buffer as a function of the staged send tensor (its
    scattered dim leading; ``host`` as for :func:`_all_reduce_runner`, its sends of ``dtype``)."""
    buf, avg, size, max_count = host_buffer if host else as_buffer, op == "avg", comm.size, base.MAX_COUNT
    total, mine = sum(counts), counts[comm.rank]
    if host and not avg and (max_count is None or total <= max_count):  # the common prepared case:
        outs = reuse(out_shape, dtype)  # its output reused from call to call

        def reduce_scatter_host(send: torch.Tensor) -> torch.Tensor:
            out, out_buffer = outs.take()
            comm.Reduce_scatter([from_address(send.data_ptr(), send.nbytes), total, datatype],
                                [out_buffer, mine, datatype], counts, mpi_op)
            return out
        return reduce_scatter_host

    def reduce_scatter(send: torch.Tensor) -> torch.Tensor:
        out = empty(out_shape, send)
        if max_count is not None and total > max_count:
            reduce_scatter_rounds(send.view(-1), out.view(-1), counts, comm, datatype, mpi_op, max_count)
        else:
            comm.Reduce_scatter([buf(send), total, datatype], [buf(out), mine, datatype], counts, mpi_op)
        if avg:
            out /= size
        return out
    return reduce_scatter
