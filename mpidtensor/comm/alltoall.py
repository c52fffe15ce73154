"""All-to-all: piece k of each rank's tensor along one dim goes to rank k, which
concatenates what it receives along another dim (redistribution's ``S(i) -> S(j)``).

Either one ``Alltoallw`` describes each piece by a subarray datatype (one per peer, count
1, displacement 0: no packing, and no count can overflow a C int), or the pieces are
packed in rank order for a regular ``Alltoall``/``Alltoallv`` and unpacked after
(``packing``). The choice reads the global bytes per rank against ``ALLTOALL_PACKED_MIN``
(``ALLTOALL_PACK_SEND_MIN`` where only the send side is strided), facts every rank shares.
Where only the send side is strided and the ranks share a node, the packed form goes through
MPI shared-memory windows instead (``shared_memory``: no packing copy, no MPI message).
"""
from __future__ import annotations

from functools import lru_cache, partial
from math import prod
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import caches
from . import base, guard, recorders, shared_memory
from .base import TRACED, Run, Types, beyond, check_dim, check_sizes, enter, leave, limits, piece_counts, resized
from .buffers import as_buffer, derived, empty, host_buffer, mpi_type, stage, unstage
from .packing import from_rank_order, into_rank_order, to_rank_order
from .pool import tracked_empty
from .prepared import Prepared, owned_types
from .rounds import offsets


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
    if type(tensor) is not torch.Tensor and isinstance(tensor, TRACED):
        return base.TRACED_OPS["all_to_all"](tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes)
    split_sizes, concat_sizes = tuple(split_sizes), tuple(concat_sizes)
    if guard.ENABLED:
        facts = guard.tensor_facts(tensor, (concat_dim,))
        facts.update(split_dim=guard.norm_dim(split_dim, tensor.ndim), concat_dim=guard.norm_dim(concat_dim, tensor.ndim),
                     split_sizes=split_sizes, concat_sizes=concat_sizes)
        guard.check("all_to_all", comm, facts, lambda: _layout(
            tensor.shape, tensor.element_size(), split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
            limits()))
    split_dim, concat_dim, shape, packed = _layout(
        tensor.shape, tensor.element_size(), split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
        limits())
    send = stage(tensor)
    recorders.record("all_to_all", send.nbytes)
    enter("all_to_all", comm, tensor.dtype, list(split_sizes))
    try:
        if packed:
            out = _packed_runner(comm, send.shape, send.dtype, split_dim, concat_dim, split_sizes,
                                 concat_sizes, shape)(send)
        else:
            out = _typed_runner(comm, shape, _blocks(send.shape, send.dtype, split_dim, split_sizes, derived),
                                _blocks(shape, send.dtype, concat_dim, concat_sizes, derived))(send)
    finally:
        leave()
    return unstage(out, tensor)


def prepare_all_to_all(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm, *, split_dim: int,
                       concat_dim: int, split_sizes: Sequence[int], concat_sizes: Sequence[int]) -> Prepared:
    """:func:`all_to_all` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared: packed
    with its counts and copies worked out, or on the ``Alltoallw`` path with datatypes of its
    own, freed with it."""
    split_sizes, concat_sizes = tuple(split_sizes), tuple(concat_sizes)
    split_dim, concat_dim, out_shape, packed = _layout(
        torch.Size(shape), dtype.itemsize, split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
        limits())

    def general(t):
        return all_to_all(t, comm, split_dim=split_dim, concat_dim=concat_dim,
                          split_sizes=split_sizes, concat_sizes=concat_sizes)
    if packed:
        return Prepared("all_to_all", comm, shape, dtype, _packed_runner(
            comm, shape, dtype, split_dim, concat_dim, split_sizes, concat_sizes, out_shape, host=True), general)
    owned, own = owned_types()
    send_blocks = _blocks(shape, dtype, split_dim, split_sizes, own)
    recv_blocks = _blocks(out_shape, dtype, concat_dim, concat_sizes, own)
    return Prepared("all_to_all", comm, shape, dtype,
                    _typed_runner(comm, out_shape, send_blocks, recv_blocks, host=True), general, owned)


@lru_cache(maxsize=1024)
def _layout(shape: torch.Size, itemsize: int, split_dim: int, concat_dim: int, split_sizes: tuple[int, ...],
            concat_sizes: tuple[int, ...], size: int, rank: int, limits: tuple):
    """``(split_dim, concat_dim, result shape, packed)`` after checking the arguments;
    ``limits`` (``base.limits()``) keys the cache by the tunables it reads."""
    split_dim, concat_dim = check_dim(split_dim, len(shape)), check_dim(concat_dim, len(shape))
    if split_dim == concat_dim:
        raise ValueError("split_dim and concat_dim must differ")
    check_sizes(split_sizes, size, total=shape[split_dim])
    check_sizes(concat_sizes, size)
    if shape[concat_dim] != concat_sizes[rank]:
        raise ValueError(f"tensor has {shape[concat_dim]} along dim {concat_dim}, "
                         f"concat_sizes[{rank}] is {concat_sizes[rank]}")
    result = resized(resized(shape, split_dim, split_sizes[rank]), concat_dim, sum(concat_sizes))
    # Every choice below reads lengths all ranks of ``comm`` share (the concat dim's whole,
    # not this rank's piece), so all choose alike.
    whole = resized(shape, concat_dim, sum(concat_sizes))
    total = prod(whole) * itemsize
    # Packing puts every piece in one count: it must fit on every rank, so take the largest.
    other = prod(n for d, n in enumerate(shape) if d not in (split_dim, concat_dim))
    max_count = base.MAX_COUNT
    fits = max_count is None or max(
        other * (sum(split_sizes) * c + n * sum(concat_sizes)) for n, c in zip(split_sizes, concat_sizes)
    ) <= max_count
    # Measured (docs/mpi-settings.md, "Collective algorithm thresholds"): uneven pieces
    # landing along a later dim go faster by Alltoallw's receive datatypes than by Alltoallv
    # and an unpacking copy at every size; pieces strided in the input only, landing on the
    # leading dim (S(0) -> S(1)), gain from packing at smaller sizes than the rest.
    landing_later = prod(whole[:concat_dim]) != 1
    if landing_later and (len(set(split_sizes)) > 1 or len(set(concat_sizes)) > 1):
        return split_dim, concat_dim, result, False
    send_only = not landing_later and prod(whole[:split_dim]) != 1
    thresholds = base.ALLTOALL_PACK_SEND_MIN if send_only else base.ALLTOALL_PACKED_MIN
    return split_dim, concat_dim, result, fits and beyond(thresholds, size, total)


caches.on_clear("all-to-all layouts", _layout.cache_clear, holds_meshes=False)


def _typed_runner(comm: MPI.Intracomm, shape: tuple[int, ...], send_blocks: tuple, recv_blocks: tuple,
                  host: bool = False) -> Run:
    """One ``Alltoallw`` with a subarray datatype per piece (:func:`_blocks`), as a function of
    the staged send tensor: no local copies. ``host``: every send will be a C-contiguous host
    tensor (a prepared collective's), so buffers reach MPI unchecked."""
    buf = host_buffer if host else as_buffer
    (send_counts, send_types), (recv_counts, recv_types) = send_blocks, recv_blocks

    def typed(send: torch.Tensor) -> torch.Tensor:
        out = empty(shape, send)
        comm.Alltoallw([buf(send), send_counts, send_types], [buf(out), recv_counts, recv_types])
        return out
    return typed


def _packed_runner(comm: MPI.Intracomm, shape: Sequence[int], dtype: torch.dtype, split_dim: int,
                   concat_dim: int, split_sizes: tuple[int, ...], concat_sizes: tuple[int, ...],
                   out_shape: tuple[int, ...], host: bool = False) -> Run:
    """Pack the pieces in rank order, one ``Alltoall`` (even pieces) or ``Alltoallv``, unpack,
    as a function of the staged send tensor, its counts and copies worked out once (``host``
    as for :func:`_typed_runner`; a prepared one packs into a send buffer of its own): a copy
    on each side unless the split/concat dim leads, but MPICH's regular all-to-all. Where the
    concat dim leads, the result itself is received into; where, besides, the split dim does
    not, the ranks sharing a node go through ``shared_memory`` (this as its fallback)."""
    buf, datatype = host_buffer if host else as_buffer, mpi_type(dtype)
    send_counts = piece_counts(shape, split_dim, split_sizes)
    recv_counts = piece_counts(resized(shape, split_dim, split_sizes[comm.rank]), concat_dim, concat_sizes)
    total = (sum(recv_counts),)
    if len(set(split_sizes)) == 1 and len(set(concat_sizes)) == 1:
        exchange, sends, receives = comm.Alltoall, send_counts[0], recv_counts[0]
    else:
        exchange = comm.Alltoallv
        sends, receives = (send_counts, offsets(send_counts)), (recv_counts, offsets(recv_counts))
    if prod(out_shape[:concat_dim]) == 1:  # pieces land as runs of the result: received into it
        total, unpack = out_shape, None
    else:
        unpack = from_rank_order(out_shape, concat_dim, concat_sizes)
    # S(0) -> S(1) (pieces strided in the input only) goes through shared memory where the
    # ranks share a node (``shared_memory``), packing only where they do not; the choice reads
    # facts every rank shares (the whole tensor's lengths, every rank's input size)
    whole = resized(shape, concat_dim, sum(concat_sizes))
    largest = max(piece_counts(shape, concat_dim, concat_sizes)) * dtype.itemsize
    shared = (prod(whole[:concat_dim]) == 1 and prod(whole[:split_dim]) > 1
              and 0 < largest <= shared_memory.LARGEST)
    if host and prod(shape[:split_dim]) != 1 and not shared:
        # A prepared plan packs into a send buffer of its own, made once and freed with the
        # plan (which ``clear_cache`` drops): no pool look-up, and one strided copy per call.
        into, own = into_rank_order(tuple(shape), split_dim, split_sizes), tracked_empty(prod(shape), dtype)
        pack = partial(into, flat=own)
    else:
        pack = to_rank_order(tuple(shape), split_dim, split_sizes)

    def packed(send: torch.Tensor) -> torch.Tensor:
        flat_send = pack(send)
        flat = empty(total, send)
        exchange([buf(flat_send), sends, datatype], [buf(flat), receives, datatype])
        return flat if unpack is None else unpack(flat)
    if shared:
        return shared_memory.shared_runner(comm, shape, dtype, split_dim, concat_dim, split_sizes,
                                           concat_sizes, out_shape, packed)
    return packed


def _blocks(shape: Sequence[int], dtype: torch.dtype, dim: int, sizes: Sequence[int], types: Types) -> tuple:
    """Alltoallw ``((counts, displacements), datatypes)`` of a C-contiguous tensor's pieces
    along ``dim``, one per rank; ``types(key, make)`` gives each committed datatype (the
    ``derived`` cache, or a prepared collective's own).

    Each piece is a subarray located by its start, so displacements stay 0 and no count
    or offset can overflow a C int; an empty piece goes as count 0 (subarrays cannot be empty).
    """
    shape = tuple(shape)
    counts, datatypes = [], []
    for start, size in zip(offsets(sizes), sizes):
        piece = resized(shape, dim, size)
        if not prod(piece):
            counts.append(0)
            datatypes.append(mpi_type(dtype))
            continue
        starts = resized((0,) * len(shape), dim, start)
        counts.append(1)
        datatypes.append(types(("block", dtype, shape, piece, starts),
                               lambda: mpi_type(dtype).Create_subarray(shape, piece, starts)))
    return (counts, [0] * len(counts)), datatypes
