"""torch.distributed on gloo over the ranks of an MPI job, for tests and benchmarks that
run torch's DTensor, FSDP2 or DCP beside mpidtensor: rank 0 picks a free TCP port, MPI
carries it to the others (``backend.rendezvous``: no launcher variables, no fixed port)."""
from __future__ import annotations

import datetime
import logging
import os

from mpi4py import MPI

from ..backend.rendezvous import LOOPBACK, rendezvous


def init_gloo_process_group(comm: MPI.Intracomm = MPI.COMM_WORLD, timeout_s: float = 120.0) -> None:
    """Initialise torch's default process group (gloo) over the ranks of ``comm``, each
    with its rank there; nothing when one exists already. Collective over ``comm``.
    On one node the rendezvous and gloo's own connections use the loopback interface
    (``GLOO_SOCKET_IFNAME=lo`` unless set); across nodes, rank 0's host name. Raises
    ``RuntimeError`` on every rank where torch has no gloo."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with gloo is not available")
    if dist.is_initialized():
        return
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # fallback notices
    host, port = rendezvous(comm)
    if host == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
