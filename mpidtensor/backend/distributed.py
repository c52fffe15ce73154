"""What ``torch.distributed`` gives user code under the switch in place of torch's own:
``init_process_group`` with any backend name gives the MPI-backed default group;
``monitored_barrier``, which torch's function refuses on any backend but gloo; the c10d
calls given a mesh's group (``mesh_groups``); the launcher's variables (``RANK``,
``LOCAL_RANK``, ...) from MPI (``rendezvous``). Every other c10d call that takes a group reaches the
backend's methods through torch's own function (tests/test_c10d_sweep.py).
"""
from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from mpi4py import MPI

from ..runtime import agreement, watchdog
from ..runtime.settings import settings
from . import cpp_groups, mesh_groups, process_group
from .monitored_barrier import run as monitored_barrier_run

__all__ = ["OVERRIDES", "init_process_group", "monitored_barrier"]

WORLD = MPI.COMM_WORLD


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


def new_group(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.new_group``; a ``timeout`` given watches the group's waits with it
    (a stuck one ends the job with the watchdog's report) instead of ``MPIDTENSOR_TIMEOUT``."""
    timeout = inspect.signature(dist.new_group).bind(*args, **kwargs).arguments.get("timeout")
    group = dist.new_group(*args, **kwargs)
    if timeout is not None and isinstance(group, process_group.MPIProcessGroup):
        watchdog.set_timeout(group.comm, timeout.total_seconds(), group)
    return group


def get_rank(group: Any = None) -> int:
    """``torch.distributed.get_rank``; an MPI communicator (what an mpidtensor mesh's
    ``get_group()`` returns, which torchtitan's vocab-parallel embedding passes) answers
    with its own rank."""
    return group.Get_rank() if isinstance(group, MPI.Comm) else dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """``torch.distributed.get_world_size``; an MPI communicator answers with its size."""
    return group.Get_size() if isinstance(group, MPI.Comm) else dist.get_world_size(group)


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` on the MPI backend's groups and on mesh groups
    (MPI communicators): rank 0 waits at most ``timeout`` and names the ranks that did not
    arrive, in torch's ``RuntimeError`` (``monitored_barrier``). torch's own function
    refuses every backend but gloo; any other group goes to it."""
    if isinstance(group, MPI.Intracomm):
        return monitored_barrier_run(group, timeout, wait_all_ranks)
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, process_group.MPIProcessGroup):
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    return pg.monitored_barrier(timeout, wait_all_ranks)


def shrink_group(ranks_to_exclude: list[int], group: Any = None, shrink_flags: int = 0,
                 pg_options: Any = None) -> Any:
    """``torch.distributed.shrink_group``: the MPI backend cannot shrink a group (torch's
    gloo cannot either): torch's ``TypeError`` for such a backend, before any change."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, process_group.MPIProcessGroup):
        raise TypeError(f"Process group backend for '{pg.group_name}' does not support shrinking operations.")
    return dist.shrink_group(ranks_to_exclude, group=group, shrink_flags=shrink_flags, pg_options=pg_options)


OVERRIDES: dict[str, Any] = {
    "init_process_group": init_process_group,
    "monitored_barrier": monitored_barrier,
    "shrink_group": shrink_group,
    "new_group": new_group,
    "get_rank": get_rank,
    "get_world_size": get_world_size,
    **mesh_groups.OVERRIDES,  # collectives given a mesh's group (an MPI communicator)
    **cpp_groups.DISTRIBUTED_OVERRIDES,  # torch's C++-backed utilities refuse a mesh's group by name
}
