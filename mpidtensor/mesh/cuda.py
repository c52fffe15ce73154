"""GPU binding: one rank per GPU, chosen by the rank's index on its node."""
from __future__ import annotations

import torch
from mpi4py import MPI

from ..runtime import watchdog


def node_local_rank(comm: MPI.Comm) -> int:
    """Rank among the processes of ``comm`` that share this node's memory."""
    node = watchdog.call("the node's ranks for GPU binding (Split_type)", comm, comm.Split_type,
                         MPI.COMM_TYPE_SHARED, comm.rank)
    try:
        return node.rank
    finally:
        node.Free()


def bind_local_gpu(comm: MPI.Comm) -> torch.device:
    """Make the GPU of this rank's node-local index the current CUDA device.

    Collective over ``comm``. Called when a ``cuda`` mesh is built, before the
    library touches CUDA, so each rank's context lands on its own GPU.
    """
    local = node_local_rank(comm)
    if not torch.cuda.is_available():
        raise ValueError("device_type='cuda' was requested but torch sees no CUDA device")
    index = local % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
