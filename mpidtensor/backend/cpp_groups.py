"""torch utilities whose C++ takes a c10d ``ProcessGroup``, given an mpidtensor mesh's group.

Under the switch ``mesh.get_group()`` is an MPI communicator (``mesh.device_mesh.
ProcessGroup``), which torch's pybind functions refuse with an "incompatible function
arguments" ``TypeError`` listing C++ signatures, and torch's ``replicate`` reaches through
DDP. Reached from user code through the switch's views of ``torch.distributed`` and
``torch.distributed._composable``, these raise instead a ``TypeError`` that names the
utility and what to use: the same call on the default group (the MPI backend's, a torch
``ProcessGroup``) or mpidtensor's own equivalent. Any other argument goes to torch's
function unchanged. docs/unchanged-programs.md lists them, with those the switch cannot
reach (``DistributedDataParallel`` given a mesh group, torch's own code).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed._composable as composable
from mpi4py import MPI

from ..mesh import DeviceMesh

__all__ = ["COMPOSABLE_OVERRIDES", "DISTRIBUTED_OVERRIDES", "NEEDS_CPP_GROUP"]

_DDP = ("use DistributedDataParallel / replicate on the default group (init_process_group's, which the MPI "
        "backend carries), or mpidtensor's fully_shard on a 2-D ('replicate', 'shard') mesh of shape (N, 1)")

# torch.distributed's functions that hand their group to C++, and what to use instead
NEEDS_CPP_GROUP = {
    "_verify_params_across_processes": f"DDP's check of parameter shapes: {_DDP}",
    "_broadcast_coalesced": "DDP's broadcast of module states: use torch.distributed.broadcast(tensor, src, "
                            "group=mesh.get_group()) for each tensor",
    "Reducer": f"DDP's gradient reducer: {_DDP}",
}


def _mesh_group(value: Any) -> bool:
    """Whether ``value`` is an MPI communicator torch's C++ cannot take, or a mesh of them."""
    return isinstance(value, (MPI.Comm, DeviceMesh))


def _refusing(name: str, fn: Callable[..., Any], why: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if any(_mesh_group(a) for a in (*args, *kwargs.values())):
            raise TypeError(f"{name} needs a torch (C++) ProcessGroup; an mpidtensor mesh's group is an MPI "
                            f"communicator, which torch's C++ cannot take. {why}")
        return fn(*args, **kwargs)
    return guarded


DISTRIBUTED_OVERRIDES: dict[str, Any] = {
    name: _refusing(f"torch.distributed.{name}", getattr(dist, name), why) for name, why in NEEDS_CPP_GROUP.items()
}
COMPOSABLE_OVERRIDES: dict[str, Any] = {
    "replicate": _refusing("torch.distributed._composable.replicate (DDP underneath)", composable.replicate,
                           f"Given an mpidtensor mesh or its group: {_DDP}"),
}
