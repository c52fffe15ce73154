"""Collectives that ``torch.compile`` can trace: MPI calls as opaque custom ops.

While Dynamo compiles a frame, it runs every op on fake tensors, and AOTAutograd
(``aot_eager``, ``inductor``) traces a DTensor's ``__torch_dispatch__`` down to the
ops on its local tensors. Both reach the collectives a sharding plan runs, which
can neither move fake data nor be traced through mpi4py. So the four
collectives of :mod:`mpidtensor.mesh.collectives` that dispatch and the op rules
use are replaced, at import, by entry points that send fake and functional
tensors (which exist only while torch.compile traces) through custom ops
``mpidtensor::all_gather`` ...: their fake kernels give the result's shape, their
real kernels run the MPI collective. Fake propagation gets shapes, and an AOT graph
records a call that communicates when the graph runs. Plain tensors go straight to
MPI as before.

:func:`when_dynamo_loads` runs the setup that needs ``torch._dynamo`` (marking
functions as graph breaks) when torch.compile first imports it, not at
``import mpidtensor``: importing Dynamo takes longer than importing torch.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .mesh import collectives

_TRACED = (FakeTensor, FunctionalTensor)

_COMMS: list[MPI.Comm] = []  # a custom op takes ints, not communicators: the graph keeps the index
_COMM_IDS: dict[int, int] = {}  # id(comm) -> index; the list keeps every comm alive
_EAGER = {name: getattr(collectives, name) for name in ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")}


def _comm_id(comm: MPI.Comm) -> int:
    index = _COMM_IDS.get(id(comm))
    if index is None:
        index = _COMM_IDS[id(comm)] = len(_COMMS)
        _COMMS.append(comm)
    return index


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim % t.ndim] = size
    return t.new_empty(shape)


@torch.library.custom_op("mpidtensor::all_gather", mutates_args=())
def all_gather_op(tensor: torch.Tensor, comm: int, dim: int, sizes: list[int]) -> torch.Tensor:
    return _EAGER["all_gather"](tensor, _COMMS[comm], dim=dim, sizes=sizes)


@all_gather_op.register_fake
def _(tensor, comm, dim, sizes):
    return _resized(tensor, dim, sum(sizes))


@torch.library.custom_op("mpidtensor::all_to_all", mutates_args=())
def all_to_all_op(
    tensor: torch.Tensor, comm: int, split_dim: int, concat_dim: int, split_sizes: list[int], concat_sizes: list[int]
) -> torch.Tensor:
    return _EAGER["all_to_all"](
        tensor, _COMMS[comm], split_dim=split_dim, concat_dim=concat_dim,
        split_sizes=split_sizes, concat_sizes=concat_sizes,
    )


@all_to_all_op.register_fake
def _(tensor, comm, split_dim, concat_dim, split_sizes, concat_sizes):
    shape = list(tensor.shape)
    shape[split_dim % tensor.ndim] = split_sizes[_COMMS[comm].rank]
    shape[concat_dim % tensor.ndim] = sum(concat_sizes)
    return tensor.new_empty(shape)


@torch.library.custom_op("mpidtensor::all_reduce", mutates_args=())
def all_reduce_op(tensor: torch.Tensor, comm: int, op: str) -> torch.Tensor:
    return _EAGER["all_reduce"](tensor, _COMMS[comm], op)


@all_reduce_op.register_fake
def _(tensor, comm, op):
    return tensor.new_empty(tensor.shape)


@torch.library.custom_op("mpidtensor::reduce_scatter", mutates_args=())
def reduce_scatter_op(tensor: torch.Tensor, comm: int, op: str, dim: int, sizes: list[int]) -> torch.Tensor:
    return _EAGER["reduce_scatter"](tensor, _COMMS[comm], op, dim=dim, sizes=sizes)


@reduce_scatter_op.register_fake
def _(tensor, comm, op, dim, sizes):
    return _resized(tensor, dim, sizes[_COMMS[comm].rank])


# --- the entry points installed in mesh.collectives (same signatures) ---------------------------
# A plain tensor goes straight to MPI (one type check more per collective); a fake or
# functional tensor, which only exists while torch.compile traces, goes through the op.


def _all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, *, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    if type(tensor) is torch.Tensor or not isinstance(tensor, _TRACED):
        return _EAGER["all_gather"](tensor, comm, dim=dim, sizes=sizes)
    return all_gather_op(tensor, _comm_id(comm), dim, list(sizes))


def _all_to_all(tensor, comm, *, split_dim, concat_dim, split_sizes, concat_sizes) -> torch.Tensor:
    if type(tensor) is torch.Tensor or not isinstance(tensor, _TRACED):
        return _EAGER["all_to_all"](tensor, comm, split_dim=split_dim, concat_dim=concat_dim,
                                    split_sizes=split_sizes, concat_sizes=concat_sizes)
    return all_to_all_op(tensor, _comm_id(comm), split_dim, concat_dim, list(split_sizes), list(concat_sizes))


def _all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: str = "sum") -> torch.Tensor:
    if type(tensor) is torch.Tensor or not isinstance(tensor, _TRACED):
        return _EAGER["all_reduce"](tensor, comm, op)
    return all_reduce_op(tensor, _comm_id(comm), op)


def _reduce_scatter(tensor: torch.Tensor, comm: MPI.Intracomm, op: str, *, dim: int, sizes: Sequence[int]):
    if type(tensor) is torch.Tensor or not isinstance(tensor, _TRACED):
        return _EAGER["reduce_scatter"](tensor, comm, op, dim=dim, sizes=sizes)
    return reduce_scatter_op(tensor, _comm_id(comm), op, dim, list(sizes))


for _name, _fn in (("all_gather", _all_gather), ("all_to_all", _all_to_all),
                   ("all_reduce", _all_reduce), ("reduce_scatter", _reduce_scatter)):
    _fn.__doc__ = _EAGER[_name].__doc__
    setattr(collectives, _name, _fn)


# --- setup deferred until Dynamo is imported ---------------------------------------------------

_DYNAMO = "torch._dynamo"


def when_dynamo_loads(setup: Callable[[], None]) -> None:
    """Run ``setup`` once ``torch._dynamo`` is imported: now if it is, else right after the
    import that torch.compile makes (an import hook that removes itself)."""
    if _DYNAMO in sys.modules:
        setup()
    else:
        sys.meta_path.insert(0, _AfterImport(setup))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the default path finder does, with a loader that runs a
    setup function after the module has executed."""

    def __init__(self, setup: Callable[[], None]) -> None:
        self.setup = setup

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenSetup(spec.loader, self.setup)
        return spec


class _ThenSetup(importlib.abc.Loader):
    def __init__(self, loader, setup: Callable[[], None]) -> None:
        self.loader, self.setup = loader, setup

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.setup()

    def __getattr__(self, name):  # get_source, get_resource_reader... of the real loader
        return getattr(self.loader, name)
