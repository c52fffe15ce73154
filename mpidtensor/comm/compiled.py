"""The collectives as opaque custom ops, for tensors that exist while torch.compile traces.

While Dynamo compiles a frame it runs every op on fake tensors, and AOTAutograd
(``aot_eager``, ``inductor``) traces a DTensor's ``__torch_dispatch__`` down to the
ops on its local tensors. Both reach the collectives a sharding plan runs, which can
neither move fake data nor be traced through mpi4py. Each kind (``gather``,
``alltoall``, ``reduce``) therefore hands fake and functional tensors to the entry
points this module registers in ``base.TRACED_OPS``, which call custom ops
``mpidtensor::all_gather``...: their fake kernels give the result's shape, their real
kernels call the collective on real tensors. Fake propagation gets shapes, and an AOT
graph records a call that communicates when the graph runs. (Importing this module
registers the ops; ``collectives`` does.)
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import caches
from . import alltoall, base, gather, reduce

# A custom op takes ints, not communicators: a graph keeps the index of each communicator it
# calls, and the table keeps the communicator alive until its mesh is freed (then dropped).
_COMMS: dict[int, MPI.Comm] = {}  # index -> communicator
_COMM_IDS: dict[int, int] = {}  # id(comm) -> index
_NEXT_INDEX = itertools.count()


def _comm_id(comm: MPI.Comm) -> int:
    index = _COMM_IDS.get(id(comm))
    if index is None:
        index = _COMM_IDS[id(comm)] = next(_NEXT_INDEX)  # never reused: a stale graph cannot reach a new comm
        _COMMS[index] = comm
    return index


def _comm(index: int) -> MPI.Comm:
    """The communicator a graph calls by ``index``; ``RuntimeError`` once its mesh was freed."""
    comm = _COMMS.get(index)
    if comm is None:
        raise RuntimeError("a compiled graph calls a collective on a communicator whose DeviceMesh was freed")
    return comm


def _drop_freed() -> None:
    """Forget the communicators freed since (with their mesh); live ones stay, since the
    compiled graphs that hold their indices may run again."""
    for index, comm in list(_COMMS.items()):
        if comm == MPI.COMM_NULL:
            del _COMMS[index], _COMM_IDS[id(comm)]


caches.on_clear("compiled-graph communicators", _drop_freed)


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim % t.ndim] = size
    return t.new_empty(shape)


@torch.library.custom_op("mpidtensor::all_gather", mutates_args=())
def all_gather_op(tensor: torch.Tensor, comm: int, dim: int, sizes: list[int]) -> torch.Tensor:
    return gather.all_gather(tensor, _comm(comm), dim=dim, sizes=sizes)


@all_gather_op.register_fake
def _(tensor, comm, dim, sizes):
    return _resized(tensor, dim, sum(sizes))


@torch.library.custom_op("mpidtensor::all_to_all", mutates_args=())
def all_to_all_op(
    tensor: torch.Tensor, comm: int, split_dim: int, concat_dim: int, split_sizes: list[int], concat_sizes: list[int]
) -> torch.Tensor:
    return alltoall.all_to_all(tensor, _comm(comm), split_dim=split_dim, concat_dim=concat_dim,
                               split_sizes=split_sizes, concat_sizes=concat_sizes)


@all_to_all_op.register_fake
def _(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes):
    shape = list(tensor.shape)
    shape[split_dim % tensor.ndim] = split_sizes[_comm(comm).rank]
    shape[concat_dim % tensor.ndim] = sum(concat_sizes)
    return tensor.new_empty(shape)


@torch.library.custom_op("mpidtensor::all_reduce", mutates_args=())
def all_reduce_op(tensor: torch.Tensor, comm: int, op: str) -> torch.Tensor:
    return reduce.all_reduce(tensor, _comm(comm), op)


@all_reduce_op.register_fake
def _(tensor, comm, op):
    return tensor.new_empty(tensor.shape)


@torch.library.custom_op("mpidtensor::reduce_scatter", mutates_args=())
def reduce_scatter_op(tensor: torch.Tensor, comm: int, op: str, dim: int, sizes: list[int]) -> torch.Tensor:
    return reduce.reduce_scatter(tensor, _comm(comm), op, dim=dim, sizes=sizes)


@reduce_scatter_op.register_fake
def _(tensor, comm, op, dim, sizes):
    return _resized(tensor, dim, sizes[_comm(comm).rank])


# --- what a kind calls for a fake or functional tensor (``base.TRACED_OPS``) -------------------

def all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    return all_gather_op(tensor, _comm_id(comm), dim, list(sizes))


def all_to_all(tensor: torch.Tensor, comm: MPI.Intracomm, split_dim: int, concat_dim: int,
               split_sizes: Sequence[int], concat_sizes: Sequence[int]) -> torch.Tensor:
    return all_to_all_op(tensor, _comm_id(comm), split_dim, concat_dim, list(split_sizes), list(concat_sizes))


def all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: str) -> torch.Tensor:
    return all_reduce_op(tensor, _comm_id(comm), op)


def reduce_scatter(tensor: torch.Tensor, comm: MPI.Intracomm, op: str, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    return reduce_scatter_op(tensor, _comm_id(comm), op, dim, list(sizes))


base.TRACED_OPS.update(all_gather=all_gather, all_to_all=all_to_all, all_reduce=all_reduce,
                       reduce_scatter=reduce_scatter)
