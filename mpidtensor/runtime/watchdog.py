"""The watchdog: every wait of a rank on other ranks is watched, and one that outlives
``settings.timeout`` (``MPIDTENSOR_TIMEOUT``, default 600 s; 0 turns it off) ends the job.

This module is the one place that waits: blocking collectives bracket their MPI call with
:func:`enter` / :func:`leave`; requests (non-blocking collectives, point-to-point messages,
the async checkpoint's barrier) are completed by :func:`wait`, :func:`wait_all`,
:func:`wait_any` and :func:`poll`, never by MPI's ``Wait`` / ``Waitall`` / ``Waitany``
elsewhere (``tools/check_structure.py`` reports any such call outside this module); a
blocking MPI call outside ``comm`` (a small agreement) runs through :func:`call`.

Each thread that waits has a slot of its own (the async checkpoint's writer waits while
the training does): the wait in progress as ``(kind, where, details)``, formatted only
for a report, and the previous one. A wait costs a tuple and two attribute writes; the
clock is read only by the daemon thread that the first watched wait starts. It samples
the slots a few times per timeout; a slot holding the same wait (the same tuple) for
longer than the timeout makes it print this rank, the wait, how long it has lasted, the
previous completed wait, the setting to raise and the waiting thread's Python stack to
stderr, then call ``MPI.COMM_WORLD.Abort``. Every stuck rank reports for itself. Callers
test the module flag ``ENABLED`` (kept equal to "a timeout is set" by a settings
listener) and skip the bookkeeping while it is false.

Where torch takes a timeout, it is honoured here: a communicator given one of its own
(:func:`set_timeout`: ``dist.new_group(timeout=...)`` under the switch) is watched with it
instead of the setting; a wait given a deadline (``Work.wait(timeout=...)``:
:func:`wait_all` with ``timeout``) polls its requests and raises :class:`WaitTimeout`, a
``RuntimeError`` as torch's ``Work.wait`` raises, leaving them pending for a later wait.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Sequence

from mpi4py import MPI

from . import effects
from .settings import settings

__all__ = ["ENABLED", "WaitTimeout", "enter", "leave", "wait", "wait_all", "wait_any", "call", "poll", "report",
           "set_timeout"]

_own_timeouts: dict[int, float] = {}  # a communicator's handle (py2f) -> its own timeout, seconds


def _timeout_changed(value: float | None) -> None:
    global ENABLED
    ENABLED = (value is not None and value > 0) or bool(_own_timeouts)


ENABLED: bool = False  # read by every wait: a module flag, kept by the listener
_timeout_changed(settings.timeout)
settings.on_change("timeout", _timeout_changed)


class WaitTimeout(RuntimeError):
    """A wait given a deadline (``Work.wait(timeout=...)``) that passed: torch's
    ``Work.wait`` raises a ``RuntimeError`` then, the operation left pending."""


def set_timeout(comm: MPI.Comm, seconds: float, owner: Any) -> None:
    """Watch the waits on ``comm`` with ``seconds`` rather than ``settings.timeout`` while
    ``owner`` (the torch group made on it) lives: ``dist.new_group(timeout=...)``."""
    key = comm.py2f()
    _own_timeouts[key] = seconds
    weakref.finalize(owner, _drop_timeout, key)
    _timeout_changed(settings.timeout)


def _drop_timeout(key: int) -> None:
    _own_timeouts.pop(key, None)
    _timeout_changed(settings.timeout)


def _limit(where: Any) -> tuple[float | None, str]:
    """The timeout a wait on ``where`` is watched with, and the setting that gave it."""
    if _own_timeouts and isinstance(where, MPI.Comm) and where != MPI.COMM_NULL:
        own = _own_timeouts.get(where.py2f())
        if own is not None:
            return own, f"the group's own timeout, new_group(timeout={own:g} s)"
    timeout = settings.timeout
    return (timeout if timeout else None), f"MPIDTENSOR_TIMEOUT={timeout or 0:g}"

What = tuple  # (kind, where: a communicator or a description, details: anything printable)


class _Slot:
    """One thread's wait in progress (``what``) and its previous completed one (``last``)."""

    __slots__ = ("what", "last", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.what: What | None = None
        self.last: What | None = None
        self.thread = thread


_local = threading.local()
_slots: list[_Slot] = []  # every thread's that has waited (the watcher drops finished threads')
_lock = threading.Lock()
_watcher: threading.Thread | None = None


def _new_slot() -> _Slot:
    """A slot for this thread, which has not waited before (the first one starts the
    watcher). :func:`enter` reads ``_local.slot`` inline: a call less on the hot path."""
    slot = _local.slot = _Slot(threading.current_thread())
    with _lock:
        _slots.append(slot)
    _start()
    return slot


def enter(kind: str, where: Any, details: Any = None) -> None:
    """This thread now blocks in ``kind`` on ``where`` (a communicator, or words naming the
    peer); ``details`` (sizes, a dict or any printable object) is formatted only in a report."""
    try:
        slot = _local.slot
    except AttributeError:
        slot = _new_slot()
    slot.what = (kind, where, details)


def leave() -> None:
    """The wait :func:`enter` announced has returned (or raised)."""
    try:
        slot = _local.slot
    except AttributeError:  # the watchdog was turned on during the wait
        return
    slot.last, slot.what = slot.what, None


def call(kind: str, where: Any, fn: Callable[..., Any], *args: Any, details: Any = None) -> Any:
    """``fn(*args)``, a call that blocks until other ranks take part (an MPI wait, or a
    blocking MPI call outside ``comm`` such as an agreement's), watched as ``kind`` on ``where``."""
    if not ENABLED:
        return fn(*args)
    try:  # ``enter`` and ``leave`` inline: two Python calls less per watched wait (the
        slot = _local.slot  # prepared collectives come here once per collective)
    except AttributeError:
        slot = _new_slot()
    slot.what = (kind, where, details)
    try:
        return fn(*args)
    finally:
        slot.last, slot.what = slot.what, None


def wait(request: MPI.Request, kind: str, where: Any, details: Any = None) -> None:
    """``request.Wait()``, watched as ``kind`` on ``where``."""
    call(kind, where, request.Wait, details=details)


def wait_all(requests: Sequence[MPI.Request], kind: str, where: Any, details: Any = None,
             timeout: float | None = None) -> None:
    """``MPI.Request.Waitall(requests)``, watched as ``kind`` on ``where``; with a
    ``timeout`` (seconds), polled: :class:`WaitTimeout` once it has passed, the requests
    left pending."""
    if not timeout:
        call(kind, where, MPI.Request.Waitall, requests, details=details)
        return
    deadline = time.monotonic() + timeout
    if poll_all(requests, kind, where, details, deadline=deadline):
        return
    raise WaitTimeout(f"[Rank {MPI.COMM_WORLD.rank}]: Timed out waiting {timeout * 1000:.0f}ms for "
                      f"{describe((kind, where, details))} to complete (Work.wait(timeout=...)); "
                      f"the operation is still pending")


def wait_any(requests: Sequence[MPI.Request], kind: str, where: Any, details: Any = None) -> int:
    """``MPI.Request.Waitany(requests)`` (the index of the one that completed), watched."""
    return call(kind, where, MPI.Request.Waitany, requests, details=details)


def poll(request: MPI.Request, kind: str, where: Any, details: Any = None,
         pause: float = 0.0005, longest: float = 0.02) -> None:
    """Wait for ``request`` by testing it with sleeps in between (``pause`` doubling up to
    ``longest``): a thread beside the training that must not spin inside MPI; watched."""
    poll_all([request], kind, where, details, pause, longest)


def poll_all(requests: Sequence[MPI.Request], kind: str, where: Any, details: Any = None,
             pause: float = 0.0005, longest: float = 0.02, deadline: float | None = None) -> bool:
    """:func:`poll` of every request in ``requests``; with a ``deadline`` (``time.monotonic()``)
    it gives up then: whether they all completed."""
    watched = ENABLED
    if watched:
        enter(kind, where, details)
    try:
        while not MPI.Request.Testall(requests):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, longest)
        return True
    finally:
        if watched:
            leave()


@effects.effect("watchdog thread", "first mesh",
                "a daemon thread, mpidtensor-watchdog, that samples the waits of this rank's threads and ends the job "
                "when one outlives MPIDTENSOR_TIMEOUT (it starts earlier if a wait comes first; not while the "
                "watchdog is off)")
def _start_with_the_first_mesh() -> bool | None:
    if not ENABLED:
        return False
    _start()
    return None


def _start() -> None:
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = threading.Thread(target=_watch, name="mpidtensor-watchdog", daemon=True)
            _watcher.start()


def _watch() -> None:
    """Sample the slots; abort the job once one wait has outlived the timeout."""
    seen: dict[int, tuple[What, float]] = {}  # id(slot) -> (its wait, when first seen)
    while True:
        shortest = min([settings.timeout or 4.0, *_own_timeouts.values()])
        time.sleep(1.0 if not ENABLED else min(max(shortest / 4, 0.05), 1.0))
        now = time.monotonic()
        with _lock:
            _slots[:] = [s for s in _slots if s.thread.is_alive() or s.what is not None]
            slots = list(_slots)
        for slot in slots:
            what = slot.what
            if what is None:
                seen.pop(id(slot), None)
                continue
            first = seen.get(id(slot))
            if first is None or first[0] is not what:
                seen[id(slot)] = (what, now)
            elif ENABLED:
                limit = _limit(what[1])[0]
                if limit is not None and now - first[1] > limit:
                    _abort(slot, now - first[1])


def _abort(slot: _Slot, waited: float) -> None:
    """Print the report of ``slot``'s wait (a line, should the report itself fail) and end the job."""
    try:
        text = report(slot, waited)
    except Exception as err:  # noqa: BLE001  (the job must end all the same)
        text = (f"\n[mpidtensor watchdog] rank {MPI.COMM_WORLD.rank}: stuck for {waited:.1f} s in a wait "
                f"(its report failed: {type(err).__name__}: {err}); aborting the job.\n")
    sys.stderr.write(text)
    sys.stderr.flush()
    time.sleep(0.5)  # let the launcher forward the report before Abort tears the job down
    MPI.COMM_WORLD.Abort(1)


_RAISE_OWN = "the timeout given to new_group (MPIDTENSOR_TIMEOUT does not apply to this group)"
_RAISE_SETTING = ("MPIDTENSOR_TIMEOUT (or pass init_process_group(timeout=...)); MPIDTENSOR_TIMEOUT=0 turns the "
                  "watchdog off")


def report(slot: _Slot, waited: float) -> str:
    """The text printed when ``slot``'s wait has lasted ``waited`` seconds, past the timeout."""
    what = slot.what or ("(finished)", "", None)
    frame = sys._current_frames().get(slot.thread.ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (stack unavailable)\n"
    timeout, setting = _limit(what[1])
    own = setting.startswith("the group")
    return (
        f"\n[mpidtensor watchdog] rank {MPI.COMM_WORLD.rank} (thread {slot.thread.name}): stuck for {waited:.1f} s "
        f"({setting}) in {describe(what)}; previous completed wait: "
        f"{describe(slot.last) if slot.last else 'none'}; aborting the job.\n"
        f"If this wait is expected to last more than {timeout or 0:g} s in a healthy job (a rank working alone "
        f"while the others wait), raise "
        f"{_RAISE_OWN if own else _RAISE_SETTING}.\n"
        f"Stack of the waiting thread (most recent call last):\n{stack}"
    )


def describe(what: What) -> str:
    """``kind on where: details`` of a wait, in words."""
    kind, where, details = what
    place = _communicator(where) if isinstance(where, MPI.Comm) else str(where)
    if isinstance(details, dict):
        details = ", ".join(f"{k}={v}" for k, v in details.items())
    return f"{kind}{' on ' + place if place else ''}{': ' + str(details) if details not in (None, '') else ''}"


def _communicator(comm: MPI.Comm) -> str:
    """``comm``'s size and its members' COMM_WORLD ranks (a freed one: said so)."""
    if comm == MPI.COMM_NULL:
        return "a communicator since freed"
    try:
        world = comm.group.Translate_ranks(list(range(comm.size)), MPI.COMM_WORLD.group)
        return f"a communicator of {comm.size} ranks (world ranks {list(world)})"
    except MPI.Exception:
        return f"a communicator of {comm.size} ranks"


def world_rank(comm: MPI.Comm, rank: int) -> int | None:
    """The COMM_WORLD rank of ``comm``'s ``rank`` (for reports naming a peer)."""
    try:
        return comm.group.Translate_ranks([rank], MPI.COMM_WORLD.group)[0]
    except MPI.Exception:  # a freed communicator
        return None
