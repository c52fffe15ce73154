"""Watchdog (``MPIDTENSOR_TIMEOUT=seconds``): end a job stuck in a collective.

Each blocking collective is bracketed by ``enter`` / ``leave``, which set and clear
one global slot. A daemon thread, started by the first ``enter``, wakes a few times
per timeout; when the slot has been held longer than the timeout it prints this
rank's collective, communicator, sizes, the previous collective and the Python stack
to stderr, then calls ``MPI.COMM_WORLD.Abort``. Every rank stuck in a collective
reports for itself, so the reports show which collective each one waits in.
The timeout is ``settings.timeout``; the collectives test the module flag ``ENABLED``
(kept by a settings listener equal to "a timeout is set") and record nothing while it is false.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from mpi4py import MPI

from .settings import settings



def _timeout_changed(value: float | None) -> None:
    global ENABLED
    ENABLED = value is not None and value > 0


ENABLED: bool = False  # read by every collective: a module flag, kept by the listener
_timeout_changed(settings.timeout)


settings.on_change("timeout", _timeout_changed)

# (kind, comm, details, start time, thread id) of the collective in progress, or None
_current: tuple[str, MPI.Comm, dict[str, Any], float, int] | None = None
_last: str | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def enter(kind: str, comm: MPI.Comm, details: dict[str, Any]) -> None:
    """Record that this rank now blocks in collective ``kind`` on ``comm`` (``details``:
    sizes, dtype... for the report)."""
    global _current
    if _thread is None:
        _start()
    _current = (kind, comm, details, time.monotonic(), threading.get_ident())


def leave() -> None:
    """Record that the collective in progress has returned (or raised)."""
    global _current, _last
    if _current is not None:
        _last = _current[0]
    _current = None


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="mpidtensor-watchdog", daemon=True)
            _thread.start()


def _watch() -> None:
    """Poll the slot; abort the job once one collective has outlived the timeout."""
    while True:
        timeout = settings.timeout
        time.sleep(1.0 if timeout is None else min(max(timeout / 4, 0.05), 1.0))
        current, timeout = _current, settings.timeout
        if current is not None and ENABLED and time.monotonic() - current[3] > timeout:
            sys.stderr.write(report(current))
            sys.stderr.flush()
            time.sleep(0.5)  # let the launcher forward the report before Abort tears the job down
            MPI.COMM_WORLD.Abort(1)


def report(current: tuple[str, MPI.Comm, dict[str, Any], float, int]) -> str:
    """The text printed when ``current`` has timed out."""
    kind, comm, details, start, thread = current
    frame = sys._current_frames().get(thread)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (stack unavailable)\n"
    facts = ", ".join(f"{k}={v}" for k, v in details.items())
    return (
        f"\n[mpidtensor watchdog] rank {MPI.COMM_WORLD.rank}: stuck for {time.monotonic() - start:.1f} s "
        f"(MPIDTENSOR_TIMEOUT={settings.timeout or 0:g}) in {kind} on {_describe(comm)}"
        f"{': ' + facts if facts else ''}; previous collective: {_last or 'none'}; aborting the job.\n"
        f"Stack of the waiting thread (most recent call last):\n{stack}"
    )


def _describe(comm: MPI.Comm) -> str:
    """``comm``'s size and its members' COMM_WORLD ranks."""
    try:
        world = comm.group.Translate_ranks(list(range(comm.size)), MPI.COMM_WORLD.group)
        return f"a communicator of {comm.size} ranks (world ranks {list(world)})"
    except MPI.Exception:
        return f"a communicator of {comm.size} ranks"
