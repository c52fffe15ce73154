"""A hook for counting collectives: each one calls ``record(kind, nbytes)``.

``kind`` is the collective's name, ``nbytes`` the bytes this rank sends.
Recorders are pushed and popped by debugging tools; with none active,
``record`` is a single list check.
"""
from __future__ import annotations

from typing import Callable

Recorder = Callable[[str, int], None]

_recorders: list[Recorder] = []


def push(recorder: Recorder) -> None:
    """Start calling ``recorder`` for every collective."""
    _recorders.append(recorder)


def pop(recorder: Recorder) -> None:
    """Stop calling ``recorder`` (its most recent push)."""
    for i in range(len(_recorders) - 1, -1, -1):
        if _recorders[i] is recorder:
            del _recorders[i]
            return
    raise ValueError("recorder was not pushed")


def record(kind: str, nbytes: int) -> None:
    """Report one collective to every active recorder."""
    if _recorders:
        for recorder in tuple(_recorders):
            recorder(kind, nbytes)
