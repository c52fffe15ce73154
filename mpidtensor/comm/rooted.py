"""Collectives from one root rank: broadcast (its tensor on every rank) and scatter (rank r
gets its slice along a dim of the root's tensor). Beyond ``MAX_COUNT`` elements both run
in rounds. ``distribute_tensor`` (``src_data_rank``) and the torch.distributed process
group use them; redistribution does not.
"""
from __future__ import annotations

from typing import Sequence

import torch
from mpi4py import MPI

from . import base, guard, recorders
from .base import check_dim, check_root, check_sizes, enter, leave, piece_counts, resized
from .buffers import as_buffer, empty, mpi_type, stage, unstage
from .packing import pieces_in_rank_order
from .rounds import offsets, scatter_rounds, span, spans


def broadcast(tensor: torch.Tensor, comm: MPI.Intracomm, root: int = 0) -> torch.Tensor:
    """``root``'s ``tensor`` on every rank (all ranks pass the same shape and dtype)."""
    if guard.ENABLED:
        guard.check("broadcast", comm, {**guard.tensor_facts(tensor), "root": root}, lambda: check_root(root, comm))
    check_root(root, comm)
    is_root = comm.rank == root
    out = stage(tensor, copy=True) if is_root else empty(tensor.shape, tensor)
    recorders.record("broadcast", out.nbytes if is_root else 0)
    datatype = mpi_type(out.dtype)
    enter("broadcast", comm, out.dtype, [out.numel()])
    try:
        for start, n in spans(out.numel(), base.MAX_COUNT):
            comm.Bcast([span(out, start, n), n, datatype], root)
    finally:
        leave()
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
    rank, max_count = comm.rank, base.MAX_COUNT
    counts = piece_counts(tensor.shape, dim, sizes)
    out = empty(resized(tensor.shape, dim, sizes[rank]), tensor)
    datatype = mpi_type(tensor.dtype)
    pieces = pieces_in_rank_order(tensor, dim, sizes) if rank == root else None
    recorders.record("scatter", tensor.nbytes if rank == root else 0)
    enter("scatter", comm, tensor.dtype, counts)
    try:
        if max_count is not None and sum(counts) > max_count:
            scatter_rounds(pieces, out.view(-1), counts, comm, root, datatype, max_count)
        else:
            send = None if pieces is None else [as_buffer(pieces), (counts, offsets(counts)), datatype]
            comm.Scatterv(send, [as_buffer(out), out.numel(), datatype], root)
    finally:
        leave()
    return unstage(out, tensor)


def _scatter_args(tensor: torch.Tensor, comm: MPI.Intracomm, root: int, dim: int, sizes: Sequence[int]) -> int:
    """``dim`` made non-negative, after checking the arguments of a :func:`scatter`."""
    check_root(root, comm)
    dim = check_dim(dim, tensor.ndim)
    check_sizes(sizes, comm.size, total=tensor.size(dim))
    return dim
