"""The collective steps that every checkpoint format's writer and reader share: rank 0
decides (reads a file, prepares or commits a directory) and every rank learns the
outcome; an error met on any rank is raised on every rank with the same type and
message, so that no rank is left waiting in a later collective.

(``mesh.guard.check`` agrees on argument errors that every rank finds itself, under
debug mode only, and ``tests/helpers.bcast_after_rank0`` sleeps through a subprocess;
neither carries a result or an error from rank 0 alone.)
"""
from __future__ import annotations

from typing import Any, Callable

from mpi4py import MPI

from ..mesh.agreement import attempt, raise_agreed, raise_first
from . import format as fmt

__all__ = ["attempt", "raise_if", "raise_found", "raise_first", "raise_agreed", "on_rank0", "commit_on_rank0", "remove_stale"]


def raise_if(errors: list[str], cls: type = fmt.CheckpointError) -> None:
    """Raise one ``cls`` naming every distinct problem in ``errors``, if any."""
    if errors:
        raise cls("; ".join(dict.fromkeys(errors)))


def raise_found(comm: MPI.Intracomm, errors: list[str]) -> None:
    """Raise on every rank one ``CheckpointError`` naming every distinct problem that any
    rank found (one ``allgather`` of each rank's ``errors``)."""
    raise_if([msg for rank_errors in comm.allgather(errors) for msg in rank_errors])


def on_rank0(comm: MPI.Intracomm, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run by rank 0 alone; its result on every rank, or its error raised
    on every rank (one ``bcast``)."""
    value, error = comm.bcast(attempt(fn, *args) if comm.rank == 0 else None, root=0)
    raise_first([error])
    return value


def commit_on_rank0(comm: MPI.Intracomm, part: Any, error: BaseException | None,
                    commit: Callable[[list], Any]) -> Any:
    """Every rank's ``part`` (what it wrote, or None with its ``error``) gathered to rank
    0, which runs ``commit(parts)`` unless some rank met an error; the commit's result on
    every rank, or the first error (a ``gather`` and a ``bcast``)."""
    gathered = comm.gather((part, error), root=0)

    def decide() -> Any:
        raise_first([e for _, e in gathered])
        return commit([p for p, _ in gathered])

    return on_rank0(comm, decide)


def remove_stale(comm: MPI.Intracomm, directory: str, names: list[str]) -> None:
    """The files ``names`` (the same list on every rank) that a commit superseded, removed
    by all ranks in parallel (unlinking is slow); returns once every rank is done."""
    if names:
        fmt.remove_files(directory, names[comm.rank::comm.size])
        comm.Barrier()
