"""Collectives on torch tensors over an mpi4py communicator.

Results are new C-contiguous tensors with the input's dtype and device.
All-to-all either describes its pieces with subarray datatypes (``Alltoallw``, one per
peer, count 1, displacement 0: no packing) or packs them in rank order for a regular
``Alltoall``/``Alltoallv``; uneven all-gathers either pad the pieces for a regular
``Allgather`` or use ``Allgatherv``. Each choice is by the global bytes per rank against a
measured threshold (``ALLTOALL_PACKED_MIN`` and, where only the send side is strided,
``ALLTOALL_PACK_SEND_MIN``; ``ALLGATHER_PADDED_MIN``), so every rank
makes the same one. Gather and scatter along a non-leading
dimension pack into, or unpack from, rank-ordered pieces with one local copy: a
datatype for one index along such a dimension has to be traversed column-wise,
which is far slower for small trailing dimensions.

``mesh.prepared`` binds these collectives to a communicator and an input signature:
redistribution plans keep them, so that a repeated redistribution pays for its checks,
choices, counts and datatypes once.

Every collective reports itself to ``tracing.record``. Argument errors are raised
before any communication; under ``MPIDTENSOR_DEBUG=1`` the ranks first agree on the
collective and its arguments (``guard``), and with ``MPIDTENSOR_TIMEOUT`` set each
blocking MPI call is watched (``watchdog``).

Large counts: mpi4py 4 calls MPI-4's large-count (``_c``) routines, so an MPI-4
library takes element counts beyond 2**31 as they are. With an older MPI the counts
and displacements of one call must fit in a C int: ``MAX_COUNT`` is then 2**31 - 1 and
the collectives that would exceed it run in rounds of at most ``MAX_COUNT`` elements
(``rounds``; all-to-all never needs to: its counts are 1 and its displacements 0).
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import Callable, Hashable, Literal, NamedTuple, Sequence

import torch
from mpi4py import MPI
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from . import guard, self_gathering, tracing, watchdog
from .buffers import as_buffer, derived, empty, has_mpi_type, host_buffer, mpi_type, stage, unstage
from .mpi_library import collective_thresholds
from .rounds import all_gather_rounds, offsets, reduce_scatter_rounds, scatter_rounds, span, spans

ReduceOp = Literal["sum", "avg", "min", "max", "product"]

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}

# Thresholds are ``((ranks, global bytes / ranks), ...)``: a choice applies from any pair on;
# per MPI library (``mpi_library.collective_thresholds``, measured: docs/mpi-settings.md).
# ALLTOALL_PACKED_MIN: packing + Alltoall(v) + unpacking instead of one Alltoallw with
# subarray types. ALLGATHER_PADDED_MIN: an uneven all-gather padding the pieces to the
# largest for a regular Allgather (a copy on each side) instead of Allgatherv.
ALLTOALL_PACKED_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["alltoall_packed"]
# ALLTOALL_PACK_SEND_MIN: the same where only the send side needs the copy (pieces strided in
# the input, landing on the result's leading dim: S(0) -> S(1)), which pays from smaller sizes.
ALLTOALL_PACK_SEND_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["alltoall_pack_send"]
ALLGATHER_PADDED_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["allgather_padded"]

# GATHER_TYPED_MAX: an even all-gather along a later dim of at most this many bytes per rank
# receives each piece in place through a resized vector datatype, not back to back and then
# interleaved by a copy (measured with MPICH: docs/performance.md, "Collective choices").
GATHER_TYPED_MAX: int = 8 << 10

# The most elements one count or displacement of one MPI call may hold (None: no limit).
MAX_COUNT: int | None = None if MPI.Get_version() >= (4, 0) else 2**31 - 1

# Tensors that exist only while torch.compile traces: they go through ``traced``'s custom ops.
_TRACED = (FakeTensor, FunctionalTensor)


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
def _gather_layout(shape: torch.Size, dtype: torch.dtype, dim: int, sizes: tuple[int, ...],
                   size: int, rank: int, limits: tuple) -> _Gather:
    """Checks the arguments; ``limits`` (``_limits()``) keys the cache by the settings it reads."""
    dim = _dim(dim, len(shape))
    _check_sizes(sizes, size)
    if shape[dim] != sizes[rank]:
        raise ValueError(f"tensor has {shape[dim]} along dim {dim}, sizes[{rank}] is {sizes[rank]}")
    counts = tuple(_counts(shape, dim, sizes))
    if MAX_COUNT is not None and sum(counts) > MAX_COUNT:
        mode = "rounds"
    elif len(set(counts)) == 1 and prod(shape[:dim]) > 1 and 0 < counts[0] * dtype.itemsize <= GATHER_TYPED_MAX:
        mode = "typed"
    elif len(set(counts)) == 1:
        mode = "even"  # MPICH's Allgather is ~3x faster than its Allgatherv here
    elif (_beyond(ALLGATHER_PADDED_MIN, size, sum(counts) * dtype.itemsize)
          and (MAX_COUNT is None or max(counts) * size <= MAX_COUNT)):
        mode = "padded"  # as is its Allgather on padded pieces above the threshold
    else:
        mode = "v"
    rows, starts, width = prod(shape[:dim]), tuple(offsets(counts)), max(counts)
    # Padded pieces are runs of the result too when only the tail is padding (full pieces,
    # one short, empty ones: torch.chunk's layout): piece r then starts at r * width.
    tail_padded = all(c == 0 or o == r * width for r, (c, o) in enumerate(zip(counts, starts)))
    runs = rows == 1 and (mode != "padded" or tail_padded)
    return _Gather(dim, counts, starts, mpi_type(dtype), mode, width, _resized(shape, dim, sum(sizes)),
                   runs, rows, tuple(c // rows if rows else 0 for c in counts))


def all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, *, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order; rank r's has ``sizes[r]`` there.
    A subclass with its own functional all-gather (NF4) gathers itself (``self_gathering``)."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, _TRACED):
        return traced.all_gather(tensor, comm, dim, sizes)
    sizes = tuple(sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (dim,))
        facts.update(dim=guard.norm_dim(dim, tensor.ndim), sizes=sizes)
        guard.check("all_gather", comm, facts,
                    lambda: _gather_layout(tensor.shape, tensor.dtype, dim, sizes, comm.size, comm.rank, _limits()))
    if type(tensor) is not torch.Tensor and self_gathering.gathers_itself(tensor, sizes):
        return self_gathering.all_gather(tensor, comm, dim, all_gather)
    lay = _gather_layout(tensor.shape, tensor.dtype, dim, sizes, comm.size, comm.rank, _limits())
    send = stage(tensor)
    tracing.record("all_gather", send.nbytes)
    _enter("all_gather", comm, tensor.dtype, list(lay.counts))
    try:
        out = _gather_fn(lay, comm, send.dtype, derived)(send)
    finally:
        _leave()
    return unstage(out, tensor)


Run = Callable[[torch.Tensor], torch.Tensor]  # a collective as a function of its staged input


def _gather_fn(lay: _Gather, comm: MPI.Intracomm, dtype: torch.dtype,
               types: Callable[[Hashable, Callable[[], MPI.Datatype]], MPI.Datatype], host: bool = False) -> Run:
    """The all-gather of ``lay`` as a function of the staged send tensor: MPI, then the
    interleaving copy if any. ``types`` gives its derived datatype (as for ``_blocks``);
    ``host``: every send will be a C-contiguous host tensor (a prepared collective's), so
    buffers reach MPI unchecked. Made per call by :func:`all_gather`, once by a prepared one."""
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

        def direct(send: torch.Tensor) -> torch.Tensor:
            flat = empty(flat_shape, send)
            gather([buf(send), mine, datatype], [buf(flat), recv, datatype])
            return flat if runs else _interleave(flat, lay, size, send)
        return direct
    return lambda send: _gather_padded_or_rounds(lay, send, comm)


def _gather_padded_or_rounds(lay: _Gather, send: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
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
        all_gather_rounds(send.view(-1), flat, lay.counts, comm, datatype, MAX_COUNT)
        if lay.runs:
            return flat.view(lay.shape)
    return _interleave(flat, lay, comm.size, send)


def _column_blocks(datatype: MPI.Datatype, rows: int, columns: int, width: int) -> MPI.Datatype:
    """``rows`` runs of ``columns`` elements ``width`` apart, its extent one run: piece r of an
    all-gather then starts ``r`` runs in (uncommitted; the caller commits)."""
    vector = datatype.Create_vector(rows, columns, width)
    resized = vector.Create_resized(0, columns * datatype.Get_extent()[1])
    vector.Free()
    return resized


def _interleave(flat: torch.Tensor, lay: _Gather, size: int, like: torch.Tensor) -> torch.Tensor:
    """The result of an all-gather along a non-leading dim from its pieces back to back in
    rank order (padded to ``lay.width`` each in "padded" mode): one copy into the result."""
    out = empty(lay.shape, like)
    if not out.numel():
        return out
    rows = out.view(lay.rows, out.numel() // lay.rows)
    if lay.mode == "even":
        rows.view(lay.rows, size, lay.columns[0]).copy_(flat.view(size, lay.rows, lay.columns[0]).transpose(0, 1))
        return out
    stride = lay.width if lay.mode == "padded" else None
    start = column = 0
    for count, width in zip(lay.counts, lay.columns):
        if width:
            rows[:, column:column + width].copy_(flat[start:start + count].view(lay.rows, width))
        start += stride if stride is not None else count
        column += width
    return out


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
    if type(tensor) is not torch.Tensor and isinstance(tensor, _TRACED):
        return traced.all_to_all(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes)
    split_sizes, concat_sizes = tuple(split_sizes), tuple(concat_sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (concat_dim,))
        facts.update(split_dim=guard.norm_dim(split_dim, tensor.ndim), concat_dim=guard.norm_dim(concat_dim, tensor.ndim),
                     split_sizes=split_sizes, concat_sizes=concat_sizes)
        guard.check("all_to_all", comm, facts, lambda: _all_to_all_layout(
            tensor.shape, tensor.element_size(), split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
            _limits()))
    split_dim, concat_dim, shape, packed = _all_to_all_layout(
        tensor.shape, tensor.element_size(), split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
        _limits())
    send = stage(tensor)
    tracing.record("all_to_all", send.nbytes)
    _enter("all_to_all", comm, tensor.dtype, list(split_sizes))
    try:
        if packed:
            out = _all_to_all_packed_fn(comm, send.shape, send.dtype, split_dim, concat_dim, split_sizes,
                                        concat_sizes, shape)(send)
        else:
            out = _all_to_all_typed_fn(comm, shape, _blocks(send.shape, send.dtype, split_dim, split_sizes, derived),
                                       _blocks(shape, send.dtype, concat_dim, concat_sizes, derived))(send)
    finally:
        _leave()
    return unstage(out, tensor)


@lru_cache(maxsize=1024)
def _all_to_all_layout(shape: torch.Size, itemsize: int, split_dim: int, concat_dim: int,
                       split_sizes: tuple[int, ...], concat_sizes: tuple[int, ...], size: int, rank: int,
                       limits: tuple):
    """``(split_dim, concat_dim, result shape, packed)`` after checking the arguments."""
    split_dim, concat_dim = _dim(split_dim, len(shape)), _dim(concat_dim, len(shape))
    if split_dim == concat_dim:
        raise ValueError("split_dim and concat_dim must differ")
    _check_sizes(split_sizes, size, total=shape[split_dim])
    _check_sizes(concat_sizes, size)
    if shape[concat_dim] != concat_sizes[rank]:
        raise ValueError(f"tensor has {shape[concat_dim]} along dim {concat_dim}, "
                         f"concat_sizes[{rank}] is {concat_sizes[rank]}")
    result = _resized(_resized(shape, split_dim, split_sizes[rank]), concat_dim, sum(concat_sizes))
    # Every choice below reads lengths all ranks of ``comm`` share (the concat dim's whole,
    # not this rank's piece), so all choose alike.
    whole = _resized(shape, concat_dim, sum(concat_sizes))
    total = prod(whole) * itemsize
    # Packing puts every piece in one count: it must fit on every rank, so take the largest.
    other = prod(n for d, n in enumerate(shape) if d not in (split_dim, concat_dim))
    fits = MAX_COUNT is None or max(
        other * (sum(split_sizes) * c + n * sum(concat_sizes)) for n, c in zip(split_sizes, concat_sizes)
    ) <= MAX_COUNT
    # Measured (docs/mpi-settings.md, "Collective algorithm thresholds"): uneven pieces
    # landing along a later dim go faster by Alltoallw's receive datatypes than by Alltoallv
    # and an unpacking copy at every size; pieces strided in the input only, landing on the
    # leading dim (S(0) -> S(1)), gain from packing at smaller sizes than the rest.
    landing_later = prod(whole[:concat_dim]) != 1
    if landing_later and (len(set(split_sizes)) > 1 or len(set(concat_sizes)) > 1):
        return split_dim, concat_dim, result, False
    send_only = not landing_later and prod(whole[:split_dim]) != 1
    thresholds = ALLTOALL_PACK_SEND_MIN if send_only else ALLTOALL_PACKED_MIN
    return split_dim, concat_dim, result, fits and _beyond(thresholds, size, total)


def _all_to_all_typed_fn(comm: MPI.Intracomm, shape: tuple[int, ...], send_blocks: tuple, recv_blocks: tuple,
                         host: bool = False) -> Run:
    """One ``Alltoallw`` with a subarray datatype per piece (``_blocks``), as a function of the
    staged send tensor: no local copies (``host`` as for ``_gather_fn``)."""
    buf = host_buffer if host else as_buffer
    (send_counts, send_types), (recv_counts, recv_types) = send_blocks, recv_blocks

    def typed(send: torch.Tensor) -> torch.Tensor:
        out = empty(shape, send)
        comm.Alltoallw([buf(send), send_counts, send_types], [buf(out), recv_counts, recv_types])
        return out
    return typed


def _all_to_all_packed_fn(comm: MPI.Intracomm, shape: Sequence[int], dtype: torch.dtype, split_dim: int,
                          concat_dim: int, split_sizes: tuple[int, ...], concat_sizes: tuple[int, ...],
                          out_shape: tuple[int, ...], host: bool = False) -> Run:
    """Pack the pieces in rank order, one ``Alltoall`` (even pieces) or ``Alltoallv``, unpack,
    as a function of the staged send tensor, its counts and copies worked out once (``host``
    as for ``_gather_fn``): a copy on each side unless the split/concat dim leads, but
    MPICH's regular all-to-all."""
    buf, datatype = host_buffer if host else as_buffer, mpi_type(dtype)
    send_counts = _counts(shape, split_dim, split_sizes)
    recv_counts = _counts(_resized(shape, split_dim, split_sizes[comm.rank]), concat_dim, concat_sizes)
    total = (sum(recv_counts),)
    if len(set(split_sizes)) == 1 and len(set(concat_sizes)) == 1:
        exchange, sends, receives = comm.Alltoall, send_counts[0], recv_counts[0]
    else:
        exchange = comm.Alltoallv
        sends, receives = (send_counts, offsets(send_counts)), (recv_counts, offsets(recv_counts))
    pack = _to_rank_order(tuple(shape), split_dim, split_sizes)
    unpack = _from_rank_order(out_shape, concat_dim, concat_sizes)

    def packed(send: torch.Tensor) -> torch.Tensor:
        flat_send = pack(send)
        flat = empty(total, send)
        exchange([buf(flat_send), sends, datatype], [buf(flat), receives, datatype])
        return unpack(flat)
    return packed


def all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = "sum", *,
               inplace: bool = False) -> torch.Tensor:
    """Reduce ``tensor`` elementwise over all ranks; every rank gets the result.

    ``inplace``: the caller made ``tensor`` and no longer needs its value, so MPI may
    reduce into its memory (``MPI_IN_PLACE``: no output buffer, no copy of the input)
    when that memory is what MPI would read anyway."""
    if type(tensor) is not torch.Tensor and isinstance(tensor, _TRACED):
        return traced.all_reduce(tensor, comm, op)
    if guard.ENABLED:
        guard.check("all_reduce", comm, {**guard.tensor_facts(tensor), "op": op},
                    lambda: _reduction(tensor.dtype, op))
    dtype, mpi_op = _reduction(tensor.dtype, op)
    send = stage(tensor, dtype)
    tracing.record("all_reduce", send.nbytes)
    _enter("all_reduce", comm, dtype, [send.numel()])
    try:
        inplace = inplace and send.data_ptr() == tensor.data_ptr()
        out = _all_reduce_fn(comm, mpi_type(dtype), mpi_op, op, inplace)(send)
    finally:
        _leave()
    return unstage(out, tensor)


def _all_reduce_fn(comm: MPI.Intracomm, datatype: MPI.Datatype, mpi_op: MPI.Op, op: str, inplace: bool,
                   host: bool = False) -> Run:
    """The all-reduce as a function of the staged send tensor: into it (``MPI_IN_PLACE``) or
    into a new buffer (``host`` as for ``_gather_fn``)."""
    buf, avg, size = host_buffer if host else as_buffer, op == "avg", comm.size

    def reduce(send: torch.Tensor) -> torch.Tensor:
        out = send if inplace else empty(send.shape, send)
        numel = send.numel()
        if MAX_COUNT is None or numel <= MAX_COUNT:  # the common case: one call
            if inplace:
                comm.Allreduce(MPI.IN_PLACE, [buf(out), numel, datatype], mpi_op)
            else:
                comm.Allreduce([buf(send), numel, datatype], [buf(out), numel, datatype], mpi_op)
        else:
            for start, n in spans(numel, MAX_COUNT):
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
    if type(tensor) is not torch.Tensor and isinstance(tensor, _TRACED):
        return traced.reduce_scatter(tensor, comm, op, dim, sizes)
    sizes = tuple(sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor)
        facts.update(op=op, dim=guard.norm_dim(dim, tensor.ndim), sizes=sizes)
        guard.check("reduce_scatter", comm, facts, lambda: _reduce_scatter_layout(
            tensor.shape, tensor.dtype, op, dim, sizes, comm.size, comm.rank))
    dim, dtype, mpi_op, datatype, counts, out_shape = _reduce_scatter_layout(
        tensor.shape, tensor.dtype, op, dim, sizes, comm.size, comm.rank)
    send = stage(tensor.movedim(dim, 0) if dim else tensor, dtype)  # MPI splits memory in order: ``dim`` must lead
    tracing.record("reduce_scatter", send.nbytes)
    _enter("reduce_scatter", comm, dtype, counts)
    try:
        out = _reduce_scatter_fn(comm, datatype, mpi_op, op, counts, out_shape)(send)
    finally:
        _leave()
    if dim:
        out = out.movedim(0, dim).contiguous()  # a copy
    return unstage(out, tensor)


def _reduce_scatter_fn(comm: MPI.Intracomm, datatype: MPI.Datatype, mpi_op: MPI.Op, op: str, counts: list[int],
                       out_shape: tuple[int, ...], host: bool = False) -> Run:
    """The reduce-scatter into a new buffer as a function of the staged send tensor (its
    scattered dim leading; ``host`` as for ``_gather_fn``)."""
    buf, avg, size = host_buffer if host else as_buffer, op == "avg", comm.size
    total, mine = sum(counts), counts[comm.rank]

    def reduce_scatter(send: torch.Tensor) -> torch.Tensor:
        out = empty(out_shape, send)
        if MAX_COUNT is not None and total > MAX_COUNT:
            reduce_scatter_rounds(send.view(-1), out.view(-1), counts, comm, datatype, mpi_op, MAX_COUNT)
        else:
            comm.Reduce_scatter([buf(send), total, datatype], [buf(out), mine, datatype], counts, mpi_op)
        if avg:
            out /= size
        return out
    return reduce_scatter


@lru_cache(maxsize=1024)
def _reduce_scatter_layout(shape: torch.Size, dtype: torch.dtype, op: str, dim: int, sizes: tuple[int, ...],
                           size: int, rank: int):
    """``(dim, reduction dtype, MPI op, MPI datatype, counts, output shape with dim leading)``."""
    dim = _dim(dim, len(shape))
    reduce_dtype, mpi_op = _reduction(dtype, op)
    _check_sizes(sizes, size, total=shape[dim])
    leading = (shape[dim], *shape[:dim], *shape[dim + 1:])
    return (dim, reduce_dtype, mpi_op, mpi_type(reduce_dtype), _counts(leading, 0, sizes),
            _resized(leading, 0, sizes[rank]))


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
        for start, n in spans(out.numel(), MAX_COUNT):
            comm.Bcast([span(out, start, n), n, datatype], root)
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
            scatter_rounds(pieces, out.view(-1), counts, comm, root, datatype, MAX_COUNT)
        else:
            send = None if pieces is None else [as_buffer(pieces), (counts, offsets(counts)), datatype]
            comm.Scatterv(send, [as_buffer(out), out.numel(), datatype], root)
    finally:
        _leave()
    return unstage(out, tensor)


def _limits() -> tuple:
    """The module settings the cached layouts depend on (tests and tuning may change them;
    ``Prepared.__call__`` compares them inline)."""
    return MAX_COUNT, ALLGATHER_PADDED_MIN, ALLTOALL_PACKED_MIN, ALLTOALL_PACK_SEND_MIN, GATHER_TYPED_MAX


def _beyond(thresholds: tuple[tuple[int, int], ...], size: int, total_bytes: int) -> bool:
    """Whether a communicator of ``size`` ranks moving ``total_bytes`` in all reaches any
    ``(ranks, bytes per rank)`` pair of ``thresholds``: the same answer on every rank."""
    return any(size >= ranks and total_bytes // size >= nbytes for ranks, nbytes in thresholds)


# --- argument checks: identical on every rank when the ranks agree (see guard) ---------------

def _scatter_args(tensor, comm, root, dim, sizes) -> int:
    _root(root, comm)
    dim = _dim(dim, tensor.ndim)
    _check_sizes(sizes, comm.size, total=tensor.size(dim))
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


# --- layout helpers ---------------------------------------------------------------------------

def _pieces_in_rank_order(tensor: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``tensor``'s pieces along ``dim``, each C-contiguous, back to back (one copy at most), flat."""
    if prod(tensor.shape[:dim]) == 1:  # already so when C-contiguous
        return stage(tensor).view(-1)
    shape, sizes = tuple(tensor.shape), tuple(sizes)
    pack = _to_rank_order(shape, dim, sizes) if tensor.is_contiguous() else _per_piece(shape, dim, sizes)
    return pack(tensor.detach())


@lru_cache(maxsize=1024)
def _to_rank_order(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Run:
    """The pieces along ``dim`` of a C-contiguous, detached tensor of ``shape`` back to back,
    flat: a view when ``dim`` leads, else one strided copy for even pieces (1.6-3.5x faster
    than a copy per piece) or a copy per piece."""
    outer, inner, n = prod(shape[:dim]), prod(shape[dim + 1:]), len(sizes)
    if outer == 1:
        return lambda t: t.view(-1)
    if len(set(sizes)) == 1:
        blocks, packed = (outer, n, sizes[0], inner), (n, outer, sizes[0], inner)

        def strided(t: torch.Tensor) -> torch.Tensor:
            flat = empty((t.numel(),), t)
            flat.view(packed).copy_(t.view(blocks).transpose(0, 1))
            return flat
        return strided
    return _per_piece(shape, dim, sizes)


@lru_cache(maxsize=1024)
def _per_piece(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Run:
    """The pieces along ``dim`` of a detached tensor of ``shape`` (any strides) back to back,
    flat: a copy per piece."""
    pieces = [_resized(shape, dim, size) for size in sizes]
    counts = [prod(piece) for piece in pieces]

    def per_piece(t: torch.Tensor) -> torch.Tensor:
        flat = empty((t.numel(),), t)
        for chunk, piece, view in zip(flat.split(counts), t.split(sizes, dim), pieces):
            chunk.view(view).copy_(piece)
        return flat
    return per_piece


@lru_cache(maxsize=1024)
def _from_rank_order(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> Run:
    """The inverse of ``_to_rank_order``: pieces received back to back (flat) as the
    C-contiguous tensor of ``shape`` they make along ``dim``. Along a later dim the pieces
    are even: uneven ones go by ``Alltoallw`` there (``_all_to_all_layout``)."""
    outer, inner, n = prod(shape[:dim]), prod(shape[dim + 1:]), len(sizes)
    if outer == 1:  # received pieces are contiguous runs of the result
        return lambda flat: flat.view(shape)
    if len(set(sizes)) > 1:  # the strided copy below would misplace them
        raise ValueError(f"packed all-to-all: uneven pieces {sizes} along dim {dim} of {shape} take Alltoallw")
    packed, blocks = (n, outer, sizes[0], inner), (outer, n, sizes[0], inner)

    def strided(flat: torch.Tensor) -> torch.Tensor:
        out = empty(shape, flat)
        out.view(blocks).copy_(flat.view(packed).transpose(0, 1))
        return out
    return strided


@lru_cache(maxsize=None)
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


def _blocks(shape: Sequence[int], dtype: torch.dtype, dim: int, sizes: Sequence[int],
            types: Callable[[Hashable, Callable[[], MPI.Datatype]], MPI.Datatype]) -> tuple:
    """Alltoallw ``((counts, displacements), datatypes)`` of a C-contiguous tensor's pieces
    along ``dim``, one per rank; ``types(key, make)`` gives each committed datatype (the
    ``derived`` cache, or a prepared collective's own).

    Each piece is a subarray located by its start, so displacements stay 0 and no count
    or offset can overflow a C int; an empty piece goes as count 0 (subarrays cannot be empty).
    """
    shape = tuple(shape)
    counts, datatypes = [], []
    for start, size in zip(offsets(sizes), sizes):
        piece = _resized(shape, dim, size)
        if not prod(piece):
            counts.append(0)
            datatypes.append(mpi_type(dtype))
            continue
        starts = _resized((0,) * len(shape), dim, start)
        counts.append(1)
        datatypes.append(types(("block", dtype, shape, piece, starts),
                               lambda: mpi_type(dtype).Create_subarray(shape, piece, starts)))
    return (counts, [0] * len(counts)), datatypes


def _counts(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> list[int]:
    """Elements in each piece of ``sizes[r]`` indices along ``dim``."""
    per_index = prod(_resized(shape, dim, 1))
    return [size * per_index for size in sizes]


def _resized(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1:])


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _check_sizes(sizes: Sequence[int], size: int, total: int | None = None) -> None:
    if len(sizes) != size or min(sizes) < 0:
        raise ValueError(f"need {size} non-negative sizes, got {list(sizes)}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"sizes {list(sizes)} do not add up to {total}")


from . import traced  # noqa: E402  (its custom ops call back into this module)
