"""``torch.distributed._functional_collectives`` as user code gets it under the switch.

Frameworks call torch's functional collectives with whatever group their mesh gives
them: torchtitan's ``dist_sum`` passes the mesh itself (``group=mesh``), its
loss-parallel cross entropy ``mesh.get_group("tp")``. Under the switch these are
mpidtensor's meshes and MPI communicators, which torch's ``_resolve_group`` refuses;
here every group form resolves to an MPI communicator and the collective runs at once
on it (mpidtensor's collectives) and its result comes back as torch's does, an
``AsyncCollectiveTensor`` (``.wait()``, ``wait_tensor``; the first op on it unwraps it), with
nothing left to wait for. Group forms: an mpidtensor ``DeviceMesh`` (1-D, or ``(mesh, dim)``),
an MPI communicator (what ``mesh.get_group()`` returns), a torch ``ProcessGroup`` of the
MPI backend, or a group name. Names not here are torch's module's (the alias view makes
each a ``NotImplementedError`` stand-in)."""
from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..comm import collectives
from ..mesh import DeviceMesh

__all__ = ["AsyncCollectiveTensor", "all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "wait_tensor"]

_OPS = {"sum": "sum", "avg": "avg", "min": "min", "max": "max", "product": "product", "prod": "product"}


def all_reduce(self: torch.Tensor, reduceOp: Any, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803
    """``self`` reduced over ``group`` (a new tensor); ``reduceOp``: a name or a ``ReduceOp``."""
    return _done(collectives.all_reduce(self.contiguous(), _comm(group), _op(reduceOp)))


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> torch.Tensor:
    """Every rank's ``self`` concatenated along ``gather_dim``, in rank order."""
    comm = _comm(group)
    dim = gather_dim % self.ndim
    return _done(collectives.all_gather(self.contiguous(), comm, dim=dim, sizes=[self.shape[dim]] * comm.size))


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: Any, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> torch.Tensor:
    """``self`` reduced over ``group``; this rank's equal piece along ``scatter_dim``."""
    comm = _comm(group)
    dim = scatter_dim % self.ndim
    if self.shape[dim] % comm.size:
        raise ValueError(f"reduce_scatter_tensor: dim {dim} of size {self.shape[dim]} does not split into "
                         f"{comm.size} equal pieces")
    return _done(collectives.reduce_scatter(self.contiguous(), comm, _op(reduceOp), dim=dim,
                                            sizes=[self.shape[dim] // comm.size] * comm.size))


def _done(result: torch.Tensor) -> torch.Tensor:
    """A completed collective's result as torch's functional collectives return theirs (under
    ``torch.compile`` a plain tensor: torch's own return no wrapper when traced)."""
    if torch.compiler.is_compiling():
        return result
    return AsyncCollectiveTensor(result)


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The collectives here complete when called: the tensor itself (torch's wait for
    an ``AsyncCollectiveTensor``)."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def _op(reduce_op: Any) -> str:
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    found = _OPS.get(name.lower().rsplit(".", 1)[-1])
    if found is None:
        raise ValueError(f"functional collectives under mpidtensor reduce with {sorted(_OPS)}, got {reduce_op!r}")
    return found


def _comm(group: Any) -> MPI.Intracomm:
    """The MPI communicator of any group form torch's functional collectives take."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a functional collective over a {group.ndim}-D mesh needs (mesh, dim)")
        return group.get_group()
    if isinstance(group, MPI.Intracomm):
        return group
    if isinstance(group, str):
        from torch.distributed import distributed_c10d
        group = distributed_c10d._resolve_process_group(group)
    comm = getattr(group, "comm", None)
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise NotImplementedError(f"functional collectives under mpidtensor take a DeviceMesh, an MPI communicator or "
                              f"a group of the MPI backend, got {type(group).__name__}")
