"""Prepared collectives: one collective bound to a communicator and an input signature.

A prepared collective checks its arguments and chooses its algorithm, counts, copies and
datatypes when it is made; a call on a host tensor of its signature then goes straight to
MPI. Redistribution plans, FSDP's reduce-scatters and the tensor-parallel gathers keep one
per signature, so a repeated collective pays for the general functions' work
(:mod:`mesh.collectives`) once.
"""
from __future__ import annotations

import weakref
from math import prod
from typing import Callable, Hashable, Sequence

import torch
from mpi4py import MPI

from . import collectives, guard, tracing, watchdog
from .buffers import mpi_type, stage


class Prepared:
    """One collective bound to a communicator and an input signature (shape and dtype),
    its arguments checked and its algorithm, counts and datatypes chosen when made.

    Calling it on a host tensor of that signature goes straight to MPI (after ``stage``: a
    contiguous copy if it is not C-contiguous), with debug mode and the watchdog off and the
    thresholds as they were; any other input, or those settings on, takes the general function (which
    checks and stages as usual). ``fast`` is the collective as a function of a staged host
    tensor, its constants bound (``_gather_fn`` and the like with ``host=True``). Redistribution
    steps keep one per plan (docs/performance.md, "Where the time goes at 4 KiB")."""

    __slots__ = ("kind", "shape", "dtype", "nbytes", "limits", "fast", "general", "__weakref__")

    def __init__(self, kind: str, shape: Sequence[int], dtype: torch.dtype,
                 fast: Callable[[torch.Tensor], torch.Tensor] | None,
                 general: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.kind, self.shape, self.dtype = kind, torch.Size(shape), dtype
        self.nbytes = prod(shape) * dtype.itemsize
        self.limits = collectives._limits()
        self.fast = fast  # None: this signature always takes the general function
        self.general = general

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if (type(tensor) is torch.Tensor and tensor.shape == self.shape and tensor.dtype is self.dtype
                and self.fast is not None and not tensor.is_cuda and not (guard.ENABLED or watchdog.ENABLED)
                and collectives._limits() == self.limits):
            tracing.record(self.kind, self.nbytes)
            if tensor.requires_grad or not tensor.is_contiguous() or tensor.is_neg() or tensor.is_conj():
                tensor = stage(tensor)  # what ``stage`` would return as it is, checked inline
            return self.fast(tensor)
        return self.general(tensor)


def prepare_all_gather(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm, *, dim: int,
                       sizes: Sequence[int]) -> Prepared:
    """:func:`all_gather` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared."""
    sizes = tuple(sizes)
    lay = collectives._gather_layout(torch.Size(shape), dtype, dim, sizes, comm.size, comm.rank,
                                     collectives._limits())
    owned, own = _own_types()
    prepared = Prepared("all_gather", shape, dtype, collectives._gather_fn(lay, comm, dtype, own, host=True),
                        lambda t: collectives.all_gather(t, comm, dim=dim, sizes=sizes))
    weakref.finalize(prepared, _free_types, owned)
    return prepared


def prepare_all_to_all(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm, *, split_dim: int,
                       concat_dim: int, split_sizes: Sequence[int], concat_sizes: Sequence[int]) -> Prepared:
    """:func:`all_to_all` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared: packed
    with its counts and copies worked out, or on the ``Alltoallw`` path with datatypes of its
    own, freed with it."""
    split_sizes, concat_sizes = tuple(split_sizes), tuple(concat_sizes)
    split_dim, concat_dim, out_shape, packed = collectives._all_to_all_layout(
        torch.Size(shape), dtype.itemsize, split_dim, concat_dim, split_sizes, concat_sizes, comm.size, comm.rank,
        collectives._limits())

    def general(t):
        return collectives.all_to_all(t, comm, split_dim=split_dim, concat_dim=concat_dim,
                                      split_sizes=split_sizes, concat_sizes=concat_sizes)
    if packed:
        return Prepared("all_to_all", shape, dtype, collectives._all_to_all_packed_fn(
            comm, shape, dtype, split_dim, concat_dim, split_sizes, concat_sizes, out_shape, host=True), general)
    owned, own = _own_types()
    send_blocks = collectives._blocks(shape, dtype, split_dim, split_sizes, own)
    recv_blocks = collectives._blocks(out_shape, dtype, concat_dim, concat_sizes, own)
    typed = collectives._all_to_all_typed_fn(comm, out_shape, send_blocks, recv_blocks, host=True)
    prepared = Prepared("all_to_all", shape, dtype, typed, general)
    weakref.finalize(prepared, _free_types, owned)
    return prepared


def prepare_all_reduce(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm,
                       op: collectives.ReduceOp = "sum", *, inplace: bool = False) -> Prepared:
    """:func:`all_reduce` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared (``inplace``
    as there: the caller owns every tensor it passes)."""
    reduce_dtype, mpi_op = collectives._reduction(dtype, op)
    fast = None
    if reduce_dtype == dtype:  # otherwise staging converts: the general function's work
        fast = collectives._all_reduce_fn(comm, mpi_type(dtype), mpi_op, op, inplace, host=True)
    return Prepared("all_reduce", shape, dtype, fast,
                    lambda t: collectives.all_reduce(t, comm, op, inplace=inplace))


def prepare_reduce_scatter(shape: Sequence[int], dtype: torch.dtype, comm: MPI.Intracomm,
                           op: collectives.ReduceOp, *, dim: int, sizes: Sequence[int]) -> Prepared:
    """:func:`reduce_scatter` of tensors of ``shape`` and ``dtype`` on ``comm``, prepared."""
    sizes = tuple(sizes)
    dim, reduce_dtype, mpi_op, datatype, counts, out_shape = collectives._reduce_scatter_layout(
        torch.Size(shape), dtype, op, dim, sizes, comm.size, comm.rank)
    fast = None
    if dim == 0 and reduce_dtype == dtype:  # otherwise staging moves or converts
        fast = collectives._reduce_scatter_fn(comm, datatype, mpi_op, op, counts, out_shape, host=True)
    return Prepared("reduce_scatter", shape, dtype, fast,
                    lambda t: collectives.reduce_scatter(t, comm, op, dim=dim, sizes=sizes))


def _own_types() -> tuple[list[MPI.Datatype], Callable[[Hashable, Callable[[], MPI.Datatype]], MPI.Datatype]]:
    """``(owned, own)``: ``own(key, make)`` commits a datatype of a prepared collective's own
    (``types`` of ``_blocks``, ``_gather_fn``), listed in ``owned`` to be freed with it: the
    shared ``derived`` cache could free one it still uses."""
    owned: list[MPI.Datatype] = []

    def own(key, make):
        owned.append(make().Commit())
        return owned[-1]
    return owned, own


def _free_types(types: list[MPI.Datatype]) -> None:
    """Free a prepared collective's datatypes (nothing to free once MPI is finalized)."""
    if not MPI.Is_finalized():
        for datatype in types:
            datatype.Free()
