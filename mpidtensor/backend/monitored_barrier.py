"""``torch.distributed.monitored_barrier`` on an MPI communicator, as torch's gloo runs it:
every other rank reports to rank 0, which waits at most ``timeout`` and then names the
ranks that did not arrive; only when all did does it release them.

Errors are torch's ``RuntimeError``s: on rank 0 ``"[Rank 0]: Rank k failed to pass
monitoredBarrier in T ms"`` (the first missing rank), or with ``wait_all_ranks``
``"[Rank 0]: Ranks i, j failed to pass ..."`` (all of them); on a rank that arrived and
was not released in time ``"Rank r successfully reached monitoredBarrier, but received
errors while waiting for send/recv from rank 0..."``. The messages travel on two tags at
the top of the communicator's range, apart from user point-to-point. A rank that arrives
after rank 0 gave up leaves its report unmatched: a program goes on after a failed
monitored barrier at its own risk (torch's does too).
"""
from __future__ import annotations

import time
from datetime import timedelta

from mpi4py import MPI

from ..runtime import watchdog

__all__ = ["DEFAULT_TIMEOUT", "run"]

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default process-group timeout
_POLL = 0.001  # seconds between tests of the pending messages: no busy spinning


def run(comm: MPI.Intracomm, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
    """The monitored barrier over ``comm`` (module docstring); collective."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    millis = int(seconds * 1000)
    deadline = time.monotonic() + seconds
    top = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767  # (the same on every communicator; Open MPI gives
    # a derived one, a mesh's Cartcomm, none; 32767 is the least MPI allows)
    arrive, release = top, top - 1
    if comm.rank != 0:
        watchdog.wait_all([comm.isend(None, dest=0, tag=arrive)], "monitored_barrier's report to rank 0", comm)
        request = comm.irecv(source=0, tag=release)
        if not _wait([request], deadline):
            request.Cancel()
            watchdog.wait(request, "monitored_barrier's cancelled receive", comm)
            raise RuntimeError(f"Rank {comm.rank} successfully reached monitoredBarrier, but received errors while "
                               "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
        return
    requests = {k: comm.irecv(source=k, tag=arrive) for k in range(1, comm.size)}
    _wait(list(requests.values()), deadline)
    missing = [k for k, request in requests.items() if not request.Test()]
    if missing:
        for k in missing:
            requests[k].Cancel()
            watchdog.wait(requests[k], "monitored_barrier's cancelled receive", comm)
        if wait_all_ranks:
            raise RuntimeError(f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                               f"{millis} ms")
        raise RuntimeError(f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {millis} ms")
    watchdog.wait_all([comm.isend(None, dest=k, tag=release) for k in range(1, comm.size)],
                      "monitored_barrier's release", comm)


def _wait(requests: list[MPI.Request], deadline: float) -> bool:
    """Whether ``requests`` all completed before ``deadline`` (polled, sleeping between;
    a completed request is the null request, which tests complete)."""
    while not all(r.Test() for r in requests):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True
