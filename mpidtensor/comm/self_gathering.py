"""All-gathers of tensor subclasses that gather themselves (torchao's NF4 weights).

torch's DTensor gathers a local tensor through ``_c10d_functional.all_gather_into_tensor``,
and a subclass whose shards are not slices of its values implements that op over its
inner tensors: an NF4 shard holds flat quantized data and per-block scalers, and its
gather concatenates each of those. mpidtensor has no torch process group, so it calls
the subclass's own implementation while a dispatch mode carries the inner tensors'
all-gathers over the MPI communicator. The result is what torch's ``full_tensor()``
gives: a gathered NF4 weight is an NF4 weight (torchtune dequantizes it afterwards).

Only even shards take this path, as in torch (the functional all-gather takes equal
inputs); other subclasses' inner gathers unwrap to plain tensors, as under torch.
"""
from __future__ import annotations

from typing import Callable

import torch
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_GROUP_NAME = "mpidtensor"  # handed through the subclass to the mode, which ignores it


def gathers_itself(tensor: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether ``tensor`` (not a plain tensor) is gathered by its own implementation of
    torch's functional all-gather: a traceable wrapper subclass with equal shards."""
    return is_traceable_wrapper_subclass(tensor) and len(set(sizes)) == 1


def all_gather(tensor: torch.Tensor, comm: MPI.Intracomm, dim: int, gather: Callable) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order, by the subclass's
    own gather (along dim 0, then regrouped along ``dim`` as torch's ``all_gather_tensor``);
    its inner tensors by ``gather`` (``collectives.all_gather``)."""
    cls = type(tensor)
    with _InnerGathersOverMPI(comm, gather), torch.no_grad():
        out = cls.__torch_dispatch__(_ALL_GATHER, (cls,), (tensor, comm.size, _GROUP_NAME), {})
    if dim % tensor.ndim != 0:
        out = torch.cat(torch.chunk(out, comm.size, dim=0), dim=dim)
    return out


class _InnerGathersOverMPI(TorchDispatchMode):
    """Runs the functional all-gathers a subclass issues on its inner tensors as ``gather``
    on ``comm`` (their group arguments name no torch group); their waits
    are no-ops, since the MPI call has completed. Every other op runs as it is."""

    def __init__(self, comm: MPI.Intracomm, gather: Callable) -> None:
        super().__init__()
        self.comm, self.gather = comm, gather

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ALL_GATHER:
            inner = args[0]
            return self.gather(inner, self.comm, dim=0, sizes=(inner.shape[0],) * self.comm.size)
        if func is _WAIT:
            return args[0]
        return func(*args, **(kwargs or {}))
