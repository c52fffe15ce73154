"""The one agreement helper: errors that some ranks meet, raised on all of them.

A rank that raises alone leaves the others waiting in the next collective (the job hangs,
or aborts with "Message truncated"). Every check that can fail on some ranks only (a
tensor subclass's own code, a file, per-rank data) goes through this module: decide on
each rank, share the verdict with one small collective before any data moves, and raise
the same error (type and message) on every rank.

- :func:`agree`: a ``with`` block whose error on any rank is raised on every rank;
- :func:`attempt` + :func:`raise_agreed`: the same for a value-returning step;
- :func:`exchange`: every rank's value and error in one collective, the first error
  raised on every rank, else every rank's value (:func:`outcomes` is the exchange
  without the raise, for a caller that builds its own verdict from them);
- :func:`raise_found`: each rank's list of problems, raised as one error naming all
  (:func:`raise_listed` is its local half, for a list every rank already holds alike);
- :func:`on_rank0`: rank 0 decides (reads a file, commits), every rank gets the result
  or the error; :func:`gather_to_rank0` first brings every rank's value (or error) to it;
- :func:`require_same`: a value every rank must hold alike (shapes, signatures).

Checks decided from what every rank shares (global shapes, specs, meshes) need none of
this: they raise alike everywhere by construction.
"""
from __future__ import annotations

import pickle
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from mpi4py import MPI

from . import watchdog

__all__ = ["agree", "attempt", "exchange", "gather_to_rank0", "on_rank0", "outcomes", "portable",
           "raise_agreed", "raise_first", "raise_found", "raise_listed", "require_same"]


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
    exchange(comm, None, error)


def outcomes(comm: MPI.Intracomm, value: Any, error: BaseException | None = None) -> list[tuple[Any, Any]]:
    """Every rank's ``(value, error)`` (``error`` made :func:`portable`), in rank order (one
    ``allgather``); nothing raised: the caller judges the list, alike on every rank."""
    return watchdog.call("an agreement: every rank's outcome (allgather)", comm, comm.allgather, (value, portable(error)))


def exchange(comm: MPI.Intracomm, value: Any, error: BaseException | None = None) -> list[Any]:
    """Every rank's ``value``, once no rank met an error: else the first rank's ``error``
    raised on every rank (one ``allgather`` carries both)."""
    table = outcomes(comm, value, error)
    raise_first([e for _, e in table])
    return [v for v, _ in table]


@contextmanager
def agree(comm: MPI.Intracomm, errors: tuple[type[BaseException], ...] = (Exception,)) -> Iterator[None]:
    """Run the block on every rank; an error of a type in ``errors`` raised in it on any
    rank is raised on every rank when the block ends (one ``allgather``). A collective:
    every rank of ``comm`` enters the block. The block must not itself run collectives
    after the point where it may fail, since a failing rank leaves it there."""
    error = None
    try:
        yield
    except errors as err:
        error = err
    raise_agreed(comm, error)


def raise_listed(problems: list[str | None], cls: type[Exception] = ValueError) -> None:
    """Raise one ``cls`` naming every distinct problem in ``problems`` (Nones skipped), if
    any. Local: call it with a list every rank holds alike (or let :func:`raise_found`
    gather it)."""
    found = [p for p in problems if p]
    if found:
        raise cls("; ".join(dict.fromkeys(found)))


def raise_found(comm: MPI.Intracomm, problems: list[str], cls: type[Exception] = ValueError,
                name_ranks: bool = False) -> None:
    """Raise on every rank one ``cls`` naming every distinct problem any rank found (one
    ``allgather`` of each rank's list of messages); ``name_ranks`` adds to each message the
    ranks that found it (``"... (on ranks 0, 2)"``)."""
    found: dict[str, list[int]] = {}
    for rank, rank_problems in enumerate(watchdog.call("an agreement: every rank's problems (allgather)", comm, comm.allgather,
                                                      problems)):
        for msg in rank_problems:
            found.setdefault(msg, []).append(rank)
    if name_ranks:
        raise_listed([f"{msg} (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                      for msg, ranks in found.items()], cls)
    raise_listed(list(found), cls)


def on_rank0(comm: MPI.Intracomm, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run by rank 0 alone; its result on every rank, or its error raised
    on every rank (one ``bcast``)."""
    value, error = watchdog.call("an agreement: rank 0's verdict (bcast)", comm, comm.bcast,
                                 attempt(fn, *args) if comm.rank == 0 else None, 0)
    raise_first([error])
    return value


def gather_to_rank0(comm: MPI.Intracomm, value: Any, error: BaseException | None,
                    decide: Callable[[list[Any]], Any]) -> Any:
    """Every rank's ``value`` (or ``error``) gathered to rank 0, which runs
    ``decide(values)`` unless some rank met an error; its result on every rank, or the
    first error raised on every rank (a ``gather`` and a ``bcast``)."""
    gathered = watchdog.call("an agreement: every rank's value to rank 0 (gather)", comm, comm.gather,
                             (value, portable(error)), 0)

    def judged() -> Any:
        raise_first([e for _, e in gathered])
        return decide([v for v, _ in gathered])

    return on_rank0(comm, judged)


def require_same(comm: MPI.Intracomm, value: Any, what: str | Callable[[list[Any]], str],
                 cls: type[Exception] = ValueError) -> list[Any]:
    """Every rank's ``value`` (one ``allgather``); ``cls`` on every rank unless all are
    equal. ``what`` names the values (the message lists each rank's), or is a function of
    every rank's values that gives the whole message."""
    seen = watchdog.call("an agreement: a value every rank must hold alike (allgather)", comm, comm.allgather, value)
    if any(other != seen[0] for other in seen):
        if callable(what):
            raise cls(what(seen))
        raise cls(f"{what} differ across ranks: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen)))
    return seen
