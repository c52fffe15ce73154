"""Errors that some ranks meet, raised on all of them: a rank that raises alone leaves the
others waiting in the next collective. A step that can fail on some ranks only (a tensor
subclass's own code, a file) is run with :func:`attempt`, and the ranks exchange the outcome
(:func:`raise_agreed`, one ``allgather``) before any data moves.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

from mpi4py import MPI

__all__ = ["attempt", "portable", "raise_first", "raise_agreed"]


def attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, error)`` when it raises: the error kept for the
    ranks to agree on before they raise it."""
    try:
        return fn(*args), None
    except Exception as err:  # noqa: BLE001  (raised on every rank by the caller's agreement)
        return None, err


def portable(error: BaseException | None) -> BaseException | None:
    """``error`` as the other ranks can receive it: itself if it pickles, else a
    ``RuntimeError`` naming its type and message (a rank that failed to pickle its error
    would raise alone and leave the others in the exchange)."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001  (any pickling failure: send the text instead)
        return RuntimeError(f"{type(error).__name__}: {error}")


def raise_first(errors: list[BaseException | None]) -> None:
    """Raise the first error of ``errors`` (a list every rank holds alike), if any."""
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


def raise_agreed(comm: MPI.Intracomm, error: BaseException | None) -> None:
    """Raise on every rank the first error any rank met (one ``allgather``)."""
    raise_first(comm.allgather(portable(error)))
