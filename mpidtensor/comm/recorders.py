"""A hook for counting collectives: each one calls ``record(kind, nbytes)``.

``kind`` is the collective's name, ``nbytes`` the bytes this rank sends.
Recorders are pushed and popped by debugging tools; with none active,
``record`` is a single list check, and a hot path tests ``ACTIVE`` itself first (a
list's truth is no call, ``record`` is one).
"""
from __future__ import annotations

from typing import Callable

Recorder = Callable[[str, int], None]

ACTIVE: list[Recorder] = []  # the recorders pushed, in order


def push(recorder: Recorder) -> None:
    """Start calling ``recorder`` for every collective."""
    ACTIVE.append(recorder)


def pop(recorder: Recorder) -> None:
    """Stop calling ``recorder`` (its most recent push)."""
    for i in range(len(ACTIVE) - 1, -1, -1):
        if ACTIVE[i] is recorder:
            del ACTIVE[i]
            return
    raise ValueError("recorder was not pushed")


def record(kind: str, nbytes: int) -> None:
    """Report one collective to every active recorder."""
    if ACTIVE:
        for recorder in tuple(ACTIVE):
            recorder(kind, nbytes)
