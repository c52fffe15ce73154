"""``torch.distributed._functional_collectives`` as user code gets it under the switch.

Frameworks call torch's functional collectives with whatever group their mesh gives
them: torchtitan's ``dist_sum`` passes the mesh itself (``group=mesh``), its
loss-parallel cross entropy ``mesh.get_group("tp")``. Under the switch these are
mpidtensor's meshes and MPI communicators, which torch's ``_resolve_group`` refuses;
here every group form resolves to an MPI communicator and the collective runs at once
on it (mpidtensor's collectives) and its result comes back as torch's does, an
``AsyncCollectiveTensor`` (``.wait()``, ``wait_tensor``; the first op on it unwraps it), with
nothing left to wait for. As torch 2.13's, each is differentiable: the backward of a sum
all-reduce is a sum all-reduce, of an all-gather a sum reduce-scatter, of a sum
reduce-scatter an all-gather, of an all-to-all the reverse all-to-all (torch's formulas;
other reductions raise torch's ``RuntimeError`` in backward), and the wrapper stays on
the graph (torch's ``_maybe_wrap_tensor``): a plain wrapper would be a leaf that stops the
gradient, silently (transformers' expert parallelism sends its tokens this way). Group forms: an mpidtensor ``DeviceMesh`` (1-D, or ``(mesh, dim)``),
an MPI communicator (what ``mesh.get_group()`` returns), a torch ``ProcessGroup`` of the
MPI backend, or a group name. Names not here are torch's module's (the alias view makes
each a ``NotImplementedError`` stand-in)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI
import torch.distributed._functional_collectives as torch_funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..comm import collectives
from ..mesh import DeviceMesh
from .process_group import agreed_exchange

__all__ = ["AsyncCollectiveTensor", "all_gather_tensor", "all_reduce", "all_to_all_single",
           "all_to_all_single_autograd", "reduce_scatter_tensor", "wait_tensor"]

_OPS = {"sum": "sum", "avg": "avg", "min": "min", "max": "max", "product": "product", "prod": "product"}


def all_reduce(self: torch.Tensor, reduceOp: Any, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803
    """``self`` reduced over ``group`` (a new tensor); ``reduceOp``: a name or a ``ReduceOp``."""
    return _run(_all_reduce, _all_reduce_backward, self, _op(reduceOp), _comm(group))


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> torch.Tensor:
    """Every rank's ``self`` concatenated along ``gather_dim``, in rank order."""
    return _run(_gather, _gather_backward, self, gather_dim % self.ndim, _comm(group))


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: Any, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> torch.Tensor:
    """``self`` reduced over ``group``; this rank's equal piece along ``scatter_dim``."""
    comm = _comm(group)
    dim = scatter_dim % self.ndim
    if self.shape[dim] % comm.size:
        raise ValueError(f"reduce_scatter_tensor: dim {dim} of size {self.shape[dim]} does not split into "
                         f"{comm.size} equal pieces")
    return _run(_scatter, _scatter_backward, self, _op(reduceOp), dim, comm)


def all_to_all_single(self: torch.Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                      group: Any, tag: str = "") -> torch.Tensor:
    """Rows of ``self`` to each rank (``input_split_sizes``, even when None), the rows from
    each in rank order (``output_split_sizes``); every rank's splits agreed first."""
    sizes = (None if output_split_sizes is None else list(output_split_sizes),
             None if input_split_sizes is None else list(input_split_sizes))
    return _run(_exchange, _exchange_backward, self, *sizes, _comm(group))


all_to_all_single_autograd = all_to_all_single  # torch 2.13's: the plain one is differentiable too


# Each collective as (forward, backward) on plain tensors, the backward given the gradient and
# the forward's arguments after the tensor: torch 2.13's formulas.
def _all_reduce(t: torch.Tensor, op: str, comm: MPI.Intracomm) -> torch.Tensor:
    return collectives.all_reduce(t.contiguous(), comm, op)


def _all_reduce_backward(grad: torch.Tensor, op: str, comm: MPI.Intracomm) -> torch.Tensor:
    _summed(op, "all_reduce")
    return _all_reduce(grad, "sum", comm)


def _gather(t: torch.Tensor, dim: int, comm: MPI.Intracomm) -> torch.Tensor:
    return collectives.all_gather(t.contiguous(), comm, dim=dim, sizes=[t.shape[dim]] * comm.size)


def _gather_backward(grad: torch.Tensor, dim: int, comm: MPI.Intracomm) -> torch.Tensor:
    return _scatter(grad, "sum", dim, comm)


def _scatter(t: torch.Tensor, op: str, dim: int, comm: MPI.Intracomm) -> torch.Tensor:
    return collectives.reduce_scatter(t.contiguous(), comm, op, dim=dim,
                                      sizes=[t.shape[dim] // comm.size] * comm.size)


def _scatter_backward(grad: torch.Tensor, op: str, dim: int, comm: MPI.Intracomm) -> torch.Tensor:
    _summed(op, "reduce_scatter_tensor")
    return _gather(grad, dim, comm)


def _exchange(t: torch.Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
              comm: MPI.Intracomm) -> torch.Tensor:
    return agreed_exchange(t, comm, input_split_sizes, output_split_sizes)


def _exchange_backward(grad: torch.Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                       comm: MPI.Intracomm) -> torch.Tensor:
    return _exchange(grad, input_split_sizes, output_split_sizes, comm)  # the rows go back the way they came


def _summed(op: str, name: str) -> None:
    if op != "sum":
        raise RuntimeError(f"{name} backward only supports 'sum' reduction, got '{op}'")


class _Collective(torch.autograd.Function):
    """One collective ``forward(t, *args)`` whose gradient is ``backward(grad, *args)``."""

    @staticmethod
    def forward(ctx, t, forward, backward, *args):
        ctx.backward, ctx.args = backward, args
        return forward(t.detach(), *args)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.backward(grad, *ctx.args), None, None) + (None,) * len(ctx.args)


def _run(forward: Callable, backward: Callable, t: torch.Tensor, *args: Any) -> torch.Tensor:
    """The collective ``forward`` on ``t``, its result as torch's functional collectives return
    theirs: the wrapper through torch's own op, so that autograd reaches the result through
    it. Under ``torch.compile``, the collective alone and a plain tensor (torch's own return no
    wrapper when traced; the collectives trace as mpidtensor's ops)."""
    if torch.compiler.is_compiling():
        return forward(t.detach(), *args)
    return torch_funcol._maybe_wrap_tensor(_Collective.apply(t, forward, backward, *args))


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
