"""``torch.distributed`` collectives given a mesh's group, under the switch.

Programs pass ``mesh.get_group(...)`` to torch's c10d calls: torchtitan's
``clip_grad_norm_`` all-reduces the norm with ``group=pp_mesh.get_group()``. Under the
switch that group is an MPI communicator (mpidtensor's ``ProcessGroup``), which torch's
functions refuse, and a torch group for it cannot be made on the spot (``new_group`` is
collective over every rank). So these calls run on the communicator with mpidtensor's
collectives, in place (outside autograd, as c10d writes) and complete on return
(``async_op=True`` gets a finished work);
any other group goes to torch's function. ``src``/``dst`` are global ranks, as in torch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..comm import collectives
from ..runtime import watchdog
from . import c10d_checks as checks
from .process_group import Completed, agreed_exchange, outside_autograd, premultiplied, reduce_op_of

__all__ = ["OVERRIDES"]


def _done(tensors: list[torch.Tensor], async_op: bool) -> Completed | None:
    return Completed(tensors) if async_op else None


def _group_rank(comm: MPI.Intracomm, global_rank: int | None, group_rank: int | None) -> int:
    if group_rank is not None:
        return group_rank
    world, group = MPI.COMM_WORLD.Get_group(), comm.Get_group()
    try:
        found = MPI.Group.Translate_ranks(world, [global_rank], group)[0]
    finally:
        world.Free()
        group.Free()
    if found == MPI.UNDEFINED:
        raise ValueError(f"rank {global_rank} is not in this group of {comm.size} ranks")
    return found


@outside_autograd
def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    name, factor = reduce_op_of(op, tensor.dtype)
    tensor.copy_(collectives.all_reduce(premultiplied(tensor, factor).contiguous(), group, name))
    return _done([tensor], async_op)


@outside_autograd
def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    tensor.copy_(collectives.broadcast(tensor.contiguous(), group, _group_rank(group, src, group_src)))
    return _done([tensor], async_op)


@outside_autograd
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None,  # noqa: A002
                           async_op: bool = False) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    rows = input.reshape(1, -1).contiguous()
    output.view(group.size, -1).copy_(collectives.all_gather(rows, group, dim=0, sizes=[1] * group.size))
    return _done([output], async_op)


@outside_autograd
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    gathered = collectives.all_gather(tensor.unsqueeze(0).contiguous(), group, dim=0, sizes=[1] * group.size)
    for out, piece in zip(tensor_list, gathered):
        out.copy_(piece)
    return _done(tensor_list, async_op)


@outside_autograd
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    name, factor = reduce_op_of(op, input.dtype)
    if input.shape[0] % group.size:
        raise ValueError(f"reduce_scatter_tensor: {input.shape[0]} rows do not split over {group.size} ranks")
    rows = input.shape[0] // group.size
    output.copy_(collectives.reduce_scatter(premultiplied(input, factor).contiguous(), group, name, dim=0,
                                            sizes=[rows] * group.size))
    return _done([output], async_op)


@outside_autograd
def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = dist.ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Any:
    """An all-reduce whose result the destination keeps."""
    if not isinstance(group, MPI.Intracomm):
        return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst)
    name, factor = reduce_op_of(op, tensor.dtype)
    reduced = collectives.all_reduce(premultiplied(tensor, factor), group, name)
    if group.rank == _group_rank(group, dst, group_dst):
        tensor.copy_(reduced)
    return _done([tensor], async_op)


@outside_autograd
def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: Any = None, async_op: bool = False, group_dst: int | None = None) -> Any:
    """An all-gather whose pieces the destination keeps."""
    if not isinstance(group, MPI.Intracomm):
        return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst)
    gathered = collectives.all_gather(tensor.unsqueeze(0), group, dim=0, sizes=[1] * group.size)
    if group.rank == _group_rank(group, dst, group_dst):
        for into, piece in zip(gather_list, gathered):
            into.copy_(piece)
    return _done(gather_list or [], async_op)


@outside_autograd
def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False, group_src: int | None = None) -> Any:
    """The source's ``scatter_list[k]`` to rank k (one ``Scatterv``)."""
    if not isinstance(group, MPI.Intracomm):
        return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op, group_src=group_src)
    root, n = _group_rank(group, src, group_src), group.size
    whole = torch.stack([t.reshape(-1) for t in scatter_list]) if group.rank == root else \
        torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
    tensor.copy_(collectives.scatter(whole, group, root, dim=0, sizes=[1] * n).view(tensor.shape))
    return _done([tensor], async_op)


@outside_autograd
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,  # noqa: A002
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    """Rows of ``input`` to each rank, rows from each into ``output`` (transformers' expert
    parallelism exchanges its token counts, then its tokens, this way): the splits agreed
    by every rank first, as the MPI backend's."""
    if not isinstance(group, MPI.Intracomm):
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    if input.dtype != output.dtype:
        raise RuntimeError(f"all_to_all_single: input {input.dtype} and output {output.dtype} differ")
    send, recv = checks.splits(input_split_sizes, input, group.size), checks.splits(output_split_sizes, output,
                                                                                   group.size)
    output.copy_(agreed_exchange(input, group, send, recv, output.shape[0]))
    return _done([output], async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    watchdog.call("torch.distributed barrier on a mesh's group (Barrier)", group, group.Barrier)
    return _done([], async_op)


OVERRIDES: dict[str, Any] = {f.__name__: f for f in (all_reduce, broadcast, all_gather_into_tensor, all_gather,
                                                     reduce_scatter_tensor, reduce, gather, scatter,
                                                     all_to_all_single, barrier)}
