"""End the whole MPI job when one rank dies of an uncaught exception.

Without this, the other ranks wait forever in their next collective. ``install``
(a process-wide effect, run when the first mesh is built or ``process_group.init_process_group``
is called: :mod:`mpidtensor.runtime.effects`)
chains a ``sys.excepthook`` that first lets the previous hook print the traceback, then
calls ``MPI.COMM_WORLD.Abort(1)``. Where ``sys.stderr`` is not the process's own (a hook
chained after this one captures it, as torch's ``init_process_group`` does, to write it
once the hooks return, which Abort prevents), the traceback is also printed to
``sys.__stderr__``. It installs nothing in a job of one rank, and nothing
while ``settings.abort_on_exception`` is off (``MPIDTENSOR_ABORT_ON_EXCEPTION=0``; read
again when an exception arrives); interactive sessions (``python -i``) only print.
"""
from __future__ import annotations

import sys
import time
import traceback
from types import TracebackType

from mpi4py import MPI

from .effects import effect
from .settings import settings

EFFECT = "abort on uncaught exception"  # its name in runtime.effects
_installed = False


@effect(EFFECT, "first mesh",
        "sys.excepthook: an uncaught exception on one rank aborts the MPI job (jobs of 2+ ranks; "
        "MPIDTENSOR_ABORT_ON_EXCEPTION=0 disables)")
def install() -> bool:
    """Install the aborting excepthook once; return whether it is installed."""
    global _installed
    if _installed:
        return True
    if not settings.abort_on_exception or MPI.COMM_WORLD.size == 1:
        return False
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            if settings.abort_on_exception and not hasattr(sys, "ps1"):  # an interactive session carries on
                out = sys.stderr
                if sys.__stderr__ is not None and out is not sys.__stderr__:
                    # a hook chained after this one may be capturing stderr to write it once this
                    # returns (torch's init_process_group adds one): Abort would lose the traceback
                    out = sys.__stderr__
                    traceback.print_exception(exc_type, exc, tb, file=out)
                out.write(f"[mpidtensor] rank {MPI.COMM_WORLD.rank}: uncaught {exc_type.__name__}; "
                          "aborting the MPI job (MPIDTENSOR_ABORT_ON_EXCEPTION=0 disables)\n")
                for stream in (sys.stdout, sys.stderr, out):
                    if stream is not None:
                        stream.flush()
                _abort()

    sys.excepthook = hook
    _installed = True
    return True


def _abort() -> None:
    time.sleep(0.5)  # let the launcher forward the traceback before Abort tears the job down
    MPI.COMM_WORLD.Abort(1)
