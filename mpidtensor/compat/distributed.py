"""What ``torch.distributed`` gives user code under the switch in place of torch's own:
``init_process_group`` with any backend name gives the MPI-backed default group;
``reduce``, ``gather`` and ``scatter``, which torch sends to no method a Python backend
can override, composed from the backend's collectives; the launcher's variables
(``RANK``, ``LOCAL_RANK``, ...) from MPI; and, for the calls the backend cannot carry,
one ``NotImplementedError`` naming the call, raised where it is called (every rank runs
the same program), before any collective.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..runtime import agreement
from ..runtime.settings import settings
from ..tools import process_group
from . import mesh_groups

__all__ = ["OVERRIDES", "UNPROVIDED", "export_launcher_environment", "init_process_group"]

WORLD = MPI.COMM_WORLD


def launcher_environment(comm: MPI.Intracomm = WORLD) -> dict[str, str]:
    """The variables torchrun would set, from MPI: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (the node's ranks: ``MPI.COMM_TYPE_SHARED``), ``MASTER_ADDR`` (rank 0's
    host; 127.0.0.1 on one node) and ``MASTER_PORT`` (a port free on rank 0 when asked).
    Collective over ``comm``."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank, local_size = node.rank, node.size
    node.Free()
    host, port = None, None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            host, port = socket.gethostname(), probe.getsockname()[1]
    host, port = comm.bcast((host, port), root=0)
    if len(set(comm.allgather(socket.gethostname()))) == 1:
        host = "127.0.0.1"
    return {"RANK": str(comm.rank), "WORLD_SIZE": str(comm.size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def export_launcher_environment(comm: MPI.Intracomm = WORLD) -> None:
    """Set :func:`launcher_environment` in ``os.environ``: the ranks from MPI always (MPI
    decides them), ``MASTER_ADDR``/``MASTER_PORT`` unless set. Collective over ``comm``."""
    found = launcher_environment(comm)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        found[name] = os.environ.get(name, found[name])
    os.environ.update(found)


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """``torch.distributed.init_process_group`` under the switch: the default group is
    mpidtensor's MPI backend over ``MPI.COMM_WORLD`` whatever ``backend`` names ("nccl",
    "gloo", "cpu:gloo,cuda:nccl", None); ``timeout`` sets the watchdog's (``MPIDTENSOR_TIMEOUT``);
    ``init_method``, ``store``, ``pg_options`` and ``device_id`` are accepted and unused (MPI
    has connected the ranks). A ``rank`` or ``world_size`` that
    differs from MPI's is a ``ValueError`` on every rank. Collective."""
    problems = []
    if world_size not in (-1, WORLD.size):
        problems.append(f"init_process_group(world_size={world_size}) in an MPI job of {WORLD.size} ranks")
    if rank not in (-1, WORLD.rank):
        problems.append(f"init_process_group(rank={rank}) on MPI rank {WORLD.rank}")
    agreement.raise_found(WORLD, problems, ValueError, name_ranks=True)
    if timeout is not None:
        settings.update(timeout=timeout.total_seconds() if timeout.total_seconds() > 0 else None)
    process_group.init_process_group(WORLD)


def _group_size(group: Any) -> int:
    return get_world_size(group)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = dist.ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Any:
    """``torch.distributed.reduce``: an all-reduce (every rank's ``tensor`` holds the result;
    torch leaves the others' unspecified)."""
    return mesh_groups.all_reduce(tensor, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: Any = None, async_op: bool = False, group_dst: int | None = None) -> Any:
    """``torch.distributed.gather``: an all-gather whose pieces the destination keeps."""
    pieces = [torch.empty_like(tensor) for _ in range(_group_size(group))]
    work = mesh_groups.all_gather(pieces, tensor.contiguous(), group=group)
    if gather_list is not None and _is_root(group, dst, group_dst):
        for into, piece in zip(gather_list, pieces):
            into.copy_(piece)
    return work if async_op else None


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False, group_src: int | None = None) -> Any:
    """``torch.distributed.scatter``: the source's list broadcast, each rank keeping its piece."""
    n = _group_size(group)
    root = _is_root(group, src, group_src)
    stacked = torch.stack([t.to(tensor.dtype) for t in scatter_list]) if root else \
        torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    work = mesh_groups.broadcast(stacked, src=0 if src is None and group_src is None else src, group=group,
                                 group_src=group_src)
    tensor.copy_(stacked[get_rank(group)])
    return work if async_op else None


def get_rank(group: Any = None) -> int:
    """``torch.distributed.get_rank``; an MPI communicator (what an mpidtensor mesh's
    ``get_group()`` returns, which torchtitan's vocab-parallel embedding passes) answers
    with its own rank."""
    return group.Get_rank() if isinstance(group, MPI.Comm) else dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """``torch.distributed.get_world_size``; an MPI communicator answers with its size."""
    return group.Get_size() if isinstance(group, MPI.Comm) else dist.get_world_size(group)


def _is_root(group: Any, root: int | None, group_root: int | None) -> bool:
    """Whether this rank is the collective's root (``root`` global, ``group_root`` in the group)."""
    if group_root is not None:
        return get_rank(group) == group_root
    return dist.get_rank() == (0 if root is None else root)


def _refuse(name: str, why: str) -> Callable[..., Any]:
    message = f"torch.distributed.{name} is not provided by mpidtensor's MPI backend: {why}"

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = message
    return refuse


# torch.distributed's functions that reach a backend method a Python backend cannot provide
UNPROVIDED = {
    "all_to_all": "use all_to_all_single",
    "all_gather_coalesced": "call all_gather per tensor",
    "all_reduce_coalesced": "call all_reduce per tensor",
    "monitored_barrier": "use barrier (MPIDTENSOR_TIMEOUT watches collectives)",
    "gather_object": "use all_gather_object",
    "scatter_object_list": "use broadcast_object_list",
}

OVERRIDES: dict[str, Any] = {
    "init_process_group": init_process_group,
    "reduce": reduce,
    "gather": gather,
    "scatter": scatter,
    "get_rank": get_rank,
    "get_world_size": get_world_size,
    **mesh_groups.OVERRIDES,  # collectives given a mesh's group (an MPI communicator)
    **{name: _refuse(name, why) for name, why in UNPROVIDED.items()},
}
