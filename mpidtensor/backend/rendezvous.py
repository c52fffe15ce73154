"""The rendezvous of torch.distributed over the ranks of an MPI job: what torchrun's
variables would say, taken from MPI. One function finds rank 0's address and a free port
(:func:`rendezvous`); the switch exports it with the ranks as ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ... (:func:`export_launcher_environment`), and ``testing.gloo`` gives it to
torch's gloo ``init_process_group`` in tests that compare with torch."""
from __future__ import annotations

import os
import socket

from mpi4py import MPI

from ..runtime import watchdog

__all__ = ["export_launcher_environment", "launcher_environment", "rendezvous"]

LOOPBACK = "127.0.0.1"


def rendezvous(comm: MPI.Intracomm = MPI.COMM_WORLD) -> tuple[str, int]:
    """``(host, port)``: rank 0's host name and a TCP port free there when asked, the same on
    every rank (``LOOPBACK`` when every rank runs on one node). Collective over ``comm``."""
    host, port = None, None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            host, port = socket.gethostname(), probe.getsockname()[1]
    host, port = watchdog.call("the rendezvous: rank 0's address (bcast)", comm, comm.bcast, (host, port), 0)
    hosts = watchdog.call("the rendezvous: every rank's host (allgather)", comm, comm.allgather, socket.gethostname())
    return (LOOPBACK if len(set(hosts)) == 1 else host), port


def launcher_environment(comm: MPI.Intracomm = MPI.COMM_WORLD) -> dict[str, str]:
    """The variables torchrun would set, from MPI: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (the node's ranks: ``MPI.COMM_TYPE_SHARED``), ``MASTER_ADDR`` and
    ``MASTER_PORT`` (:func:`rendezvous`). Collective over ``comm``."""
    node = watchdog.call("the launcher's variables: the node's ranks (Split_type)", comm, comm.Split_type,
                         MPI.COMM_TYPE_SHARED, comm.rank)
    local_rank, local_size = node.rank, node.size
    node.Free()
    host, port = rendezvous(comm)
    return {"RANK": str(comm.rank), "WORLD_SIZE": str(comm.size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def export_launcher_environment(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Set :func:`launcher_environment` in ``os.environ``: the ranks from MPI always (MPI
    decides them), ``MASTER_ADDR``/``MASTER_PORT`` unless set. Collective over ``comm``."""
    found = launcher_environment(comm)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        found[name] = os.environ.get(name, found[name])
    os.environ.update(found)
