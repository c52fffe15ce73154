"""Collective assertions: every rank reaches the same verdict, so a failure on
one rank fails the test on all of them instead of leaving them in a collective."""
from __future__ import annotations

import torch
from mpi4py import MPI

from mpidtensor.comm import recorders

WORLD = MPI.COMM_WORLD


def assert_all_ranks(ok: bool, message: str = "", comm: MPI.Comm = WORLD) -> None:
    """Assert ``ok`` on every rank; fail everywhere if it is false anywhere."""
    failed = comm.allgather(None if ok else message)
    bad = [(rank, msg) for rank, msg in enumerate(failed) if msg is not None]
    assert not bad, "failed on ranks " + "; ".join(f"{r}: {m}" for r, m in bad)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, comm: MPI.Comm = WORLD, **tol) -> None:
    """``torch.testing.assert_close`` whose outcome is agreed by all ranks."""
    try:
        torch.testing.assert_close(actual, expected, **tol)
        message = None
    except AssertionError as err:
        message = str(err)
    assert_all_ranks(message is None, message or "", comm)


def global_tensor(shape, dtype=torch.float32, seed: int = 1234) -> torch.Tensor:
    """The same tensor on every rank, built from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)


class CollectiveLog:
    """The kinds of the collectives run inside a ``with`` block, in order (``.calls``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, kind: str, nbytes: int) -> None:
        self.calls.append(kind)

    def __enter__(self) -> "CollectiveLog":
        recorders.push(self)
        return self

    def __exit__(self, *exc) -> None:
        recorders.pop(self)


def raises_everywhere(exc: type, fn, match: str = "", comm=WORLD) -> None:
    """``fn()`` raises ``exc`` (with ``match`` in its message) on every rank."""
    try:
        fn()
        verdict = "raised nothing"
    except exc as err:
        verdict = None if match in str(err) else f"message {err!s} lacks {match!r}"
    except Exception as err:  # noqa: BLE001 (the wrong kind is a failure to report)
        verdict = f"raised {type(err).__name__}: {err}"
    assert_all_ranks(verdict is None, verdict or "", comm)


def bcast_after_rank0(value, comm: MPI.Comm = WORLD):
    """Rank 0's ``value`` on every rank, the others waiting for rank 0 in a polled
    nonblocking barrier (sleeping, not spinning in MPI: a subprocess that rank 0 runs
    meanwhile gets the cores)."""
    import time

    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.05)
    return comm.bcast(value, root=0)
