"""MPI progress for started non-blocking collectives.

MPI moves a non-blocking collective's data only inside MPI calls (MPICH and Open MPI
without an async-progress thread), so a prefetched all-gather advances only when
something calls MPI. Modes (``settings.progress``, from ``MPIDTENSOR_PROGRESS``; ``set_mode``
is ``settings.update(progress=...)``):

* ``"off"`` (default): data moves only inside the waits; FSDP then issues its
  reduce-scatters blocking (``fsdp.collectives.start_reduce_scatter``), which costs less CPU.
* ``"hooks"``: ``poke()`` makes one ``MPI_Test`` on the oldest in-flight
  collective, which runs the progress engine for all of them. FSDP calls it from its
  module hooks, so a collective started for the next module moves between modules.
* ``"thread"``: a daemon thread calls ``MPI_Iprobe`` (which runs the progress engine
  without touching the callers' requests: MPI forbids two threads on one request)
  every ``interval`` seconds while a collective is in flight, and sleeps otherwise.
  Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

docs/mpi-settings.md ("FSDP overlap") has the measurements behind the default.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Protocol

from mpi4py import MPI

from .settings import settings

MODES = ("off", "hooks", "thread")


class _Testable(Protocol):
    def test(self) -> bool: ...


# started, not yet waited for, keyed by themselves (hashed by identity: no id() call; a dict
# keeps the start order)
_in_flight: dict[_Testable, _Testable] = {}
_mode = "off"
poking = False  # mode "hooks": callers test this before calling poke() (no call per hook otherwise)
_wake = threading.Event()
_stopping = threading.Event()
_thread: threading.Thread | None = None
interval = 100e-6  # seconds between the thread's probes


def set_mode(mode: str) -> None:
    """Choose ``"off"``, ``"hooks"`` or ``"thread"``, the same on every rank: it changes no
    result, but FSDP's reduce-scatter is blocking in ``"off"`` and non-blocking otherwise,
    and MPI matches a blocking collective with no non-blocking one."""
    settings.update(progress=mode)


def _apply(mode: str) -> None:
    """The listener of ``settings.progress``: check the mode, start the thread it needs."""
    global _mode, _thread, poking
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {MODES}, got {mode!r}")
    if mode == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ValueError("progress mode 'thread' needs MPI_THREAD_MULTIPLE")
    _mode, poking = mode, mode == "hooks"
    if mode == "thread" and _thread is None:
        _thread = threading.Thread(target=_run, name="mpidtensor-progress", daemon=True)
        _thread.start()
    _wake.set()  # a sleeping thread rechecks the mode


def mode() -> str:
    return _mode


def started(handle: _Testable) -> None:
    """Register a started collective (``nonblocking.Handle`` does)."""
    _in_flight[handle] = handle
    if _mode == "thread":
        _wake.set()


def finished(handle: _Testable) -> None:
    """Forget a collective that was waited for."""
    _in_flight.pop(handle, None)


def poke() -> None:
    """In ``"hooks"`` mode: one ``MPI_Test`` on the oldest in-flight collective, if any
    (about 1 µs); a completed one is dropped, so the next poke tests the next."""
    if _mode == "hooks" and _in_flight:
        key, handle = next(iter(_in_flight.items()))
        if handle.test():
            del _in_flight[key]


def in_flight() -> int:
    """How many started collectives have not been waited for (or seen complete)."""
    return len(_in_flight)


def _run() -> None:
    """The progress thread: probe while collectives are in flight, sleep otherwise;
    ends at exit (``_stop``)."""
    while not _stopping.is_set():
        if _mode != "thread" or not _in_flight:
            _wake.wait(0.5)
            _wake.clear()
            continue
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        time.sleep(interval)


def _stop() -> None:
    """At exit, before mpi4py finalizes MPI (atexit runs the last registered first)."""
    _stopping.set()
    _wake.set()
    if _thread is not None:
        _thread.join()


atexit.register(_stop)
settings.on_change("progress", _apply)
_apply(settings.progress)
