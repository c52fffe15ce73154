"""``torch.distributed`` collectives given a mesh's group, under the switch.

Programs pass ``mesh.get_group(...)`` to torch's c10d calls: torchtitan's
``clip_grad_norm_`` all-reduces the norm with ``group=pp_mesh.get_group()``. Under the
switch that group is an MPI communicator (mpidtensor's ``ProcessGroup``), which torch's
functions refuse, and a torch group for it cannot be made on the spot (``new_group`` is
collective over every rank). So these calls run on the communicator with mpidtensor's
collectives, in place (outside autograd, as c10d writes) and complete on return
(``async_op=True`` gets a finished work); the point-to-point calls (``isend``/``irecv``,
``send``/``recv``, ``P2POp`` and ``batch_isend_irecv``: transformers' pipeline stages pass
their mesh's group) post MPI transfers that the work completes at ``wait()``; the rank
queries (``get_process_group_ranks``, ``get_global_rank``, ``get_group_rank``,
``get_backend``) answer for the communicator. Any other group goes to torch's function.
``src``/``dst`` are global ranks, as in torch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..comm import collectives
from ..runtime import watchdog
from .process_group import (BACKEND, Completed, agreed_exchange, outside_autograd, post_recv, post_send, premultiplied,
                            reduce_op_of, write_back)

__all__ = ["OVERRIDES"]


def _done(tensors: list[torch.Tensor], async_op: bool) -> Completed | None:
    return Completed(tensors) if async_op else None


def _group_rank(comm: MPI.Intracomm, global_rank: int | None, group_rank: int | None) -> int:
    """``group_rank`` if given, else ``comm``'s rank of the global rank ``global_rank``
    (torch's ``ValueError`` when it is not there)."""
    if group_rank is not None:
        return group_rank
    in_world = isinstance(global_rank, int) and 0 <= global_rank < MPI.COMM_WORLD.size
    found = _translate([global_rank], MPI.COMM_WORLD, comm)[0] if in_world else MPI.UNDEFINED
    if found == MPI.UNDEFINED:
        raise ValueError(f"Global rank {global_rank} is not part of group {comm}")
    return found


def _translate(ranks: list[int], source: MPI.Comm, target: MPI.Comm) -> list[int]:
    """``source``'s ranks ``ranks`` as ``target``'s (``MPI.UNDEFINED`` where one is not there);
    ``COMM_WORLD``'s are torch's global ranks."""
    source_group, target_group = source.Get_group(), target.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(source_group, ranks, target_group))
    finally:
        source_group.Free()
        target_group.Free()


@outside_autograd
def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    name, factor = reduce_op_of(op, tensor.dtype)
    write_back(tensor, collectives.all_reduce(premultiplied(tensor, factor).contiguous(), group, name))
    return _done([tensor], async_op)


@outside_autograd
def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    write_back(tensor, collectives.broadcast(tensor.contiguous(), group, _group_rank(group, src, group_src)))
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
    write_back(tensor, collectives.scatter(whole, group, root, dim=0, sizes=[1] * n).view(tensor.shape))
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
    write_back(output, agreed_exchange(input, group, input_split_sizes, output_split_sizes, output))
    return _done([output], async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if not isinstance(group, MPI.Intracomm):
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    watchdog.call("torch.distributed barrier on a mesh's group (Barrier)", group, group.Barrier)
    return _done([], async_op)


@outside_autograd
def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Any:
    """``tensor`` to ``dst`` (a global rank) or ``group_dst``; the work completes the send."""
    if not isinstance(group, MPI.Intracomm):
        return dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    return post_send(group, [_real(tensor)], _group_rank(group, dst, group_dst), tag)


@outside_autograd
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Any:
    """Into ``tensor`` from ``src`` (a global rank) or ``group_src``, once the work is waited."""
    if not isinstance(group, MPI.Intracomm):
        return dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    return post_recv(group, [_real(tensor)], _source(group, src, group_src), tag)


def send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    if not isinstance(group, MPI.Intracomm):
        return dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    isend(tensor, dst, group, tag, group_dst).wait()
    return None


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Blocking :func:`irecv`; the sender's global rank, as torch's."""
    if not isinstance(group, MPI.Intracomm):
        return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    irecv(tensor, src, group, tag, group_src).wait()
    return src if src is not None else _translate([group_src], group, MPI.COMM_WORLD)[0]


class P2POp(dist.P2POp):
    """torch's ``P2POp``, whose ``group`` may also be a mesh's group (an MPI communicator:
    ``peer`` a global rank, ``group_peer`` the communicator's) and whose ``op`` the switch's
    ``isend``/``irecv`` (kept as torch's, which torch's ``batch_isend_irecv`` compares with)."""

    def __new__(cls, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0,
                group_peer: int | None = None) -> "P2POp":
        op = _TORCH_OPS.get(op, op)
        if isinstance(group, MPI.Intracomm):
            if op not in (dist.isend, dist.irecv) or not isinstance(tensor, torch.Tensor):
                raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or "
                                 "``torch.distributed.irecv``.")
            return object.__new__(cls)
        return dist.P2POp.__new__(cls, op, tensor, peer, group, tag, group_peer)

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0,
                 group_peer: int | None = None) -> None:
        op = _TORCH_OPS.get(op, op)
        if not isinstance(group, MPI.Intracomm):
            super().__init__(op, tensor, peer, group, tag, group_peer)
            return
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.group_peer = _group_rank(group, peer, group_peer)
        self.peer = _translate([self.group_peer], group, MPI.COMM_WORLD)[0]

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__} peer={self.peer} tag={self.tag} {tuple(self.tensor.shape)})"


def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """torch's ``batch_isend_irecv``; ops on a mesh's group post each transfer at once and
    return their works (MPI matches them by source and tag, no coalescing needed)."""
    group = p2p_op_list[0].group if p2p_op_list and isinstance(p2p_op_list, list) else None
    if not isinstance(group, MPI.Intracomm):
        return dist.batch_isend_irecv(p2p_op_list)
    if not all(isinstance(op, P2POp) and op.group is group for op in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    return [(isend(op.tensor, group=group, tag=op.tag, group_dst=op.group_peer) if op.op is dist.isend else
             irecv(op.tensor, group=group, tag=op.tag, group_src=op.group_peer)) for op in p2p_op_list]


def get_backend(group: Any = None) -> str:
    """``torch.distributed.get_backend``; a mesh's group is the MPI backend's."""
    return BACKEND if isinstance(group, MPI.Intracomm) else dist.get_backend(group)


_TORCH_OPS = {isend: dist.isend, irecv: dist.irecv}


def _real(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _source(comm: MPI.Intracomm, src: int | None, group_src: int | None) -> int:
    if src is None and group_src is None:
        return -1  # any source: refused by post_recv, as the MPI backend refuses it
    return _group_rank(comm, src, group_src)


def get_process_group_ranks(group: Any) -> list[int]:
    """``torch.distributed.get_process_group_ranks``; an MPI communicator (a mesh's
    ``get_group()``, which transformers' expert parallelism passes) answers with its
    members' global ranks in its rank order."""
    if isinstance(group, MPI.Comm):
        return _translate(list(range(group.Get_size())), group, MPI.COMM_WORLD)
    return dist.get_process_group_ranks(group)


def get_global_rank(group: Any, group_rank: int) -> int:
    """``torch.distributed.get_global_rank``; for an MPI communicator, torch's ``ValueError``
    for a rank outside it."""
    if not isinstance(group, MPI.Comm):
        return dist.get_global_rank(group, group_rank)
    if not 0 <= group_rank < group.Get_size():
        raise ValueError(f"Group rank {group_rank} is not part of group {group}")
    return _translate([group_rank], group, MPI.COMM_WORLD)[0]


def get_group_rank(group: Any, global_rank: int) -> int:
    """``torch.distributed.get_group_rank``; for an MPI communicator, torch's ``ValueError``
    for a global rank outside it."""
    if not isinstance(group, MPI.Comm):
        return dist.get_group_rank(group, global_rank)
    return _group_rank(group, global_rank, None)


OVERRIDES: dict[str, Any] = {f.__name__: f for f in (all_reduce, broadcast, all_gather_into_tensor, all_gather,
                                                     reduce_scatter_tensor, reduce, gather, scatter,
                                                     all_to_all_single, barrier, isend, irecv, send, recv,
                                                     P2POp, batch_isend_irecv, get_backend, get_process_group_ranks,
                                                     get_global_rank, get_group_rank)}
