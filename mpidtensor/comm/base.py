"""What every collective shares: the tunable thresholds of its algorithm choices, the
argument checks, the reduction ops, the watchdog slot, and the hand-off of tensors that
exist only while torch.compile traces.

The tunables (``MAX_COUNT``, ``ALLTOALL_PACKED_MIN``, ...) live here and the kinds
(``gather``, ``alltoall``, ``reduce``, ``rooted``) read them when they act, so setting
one (``base.MAX_COUNT = n``) reaches every collective. The argument
checks raise the same error on every rank when the ranks pass the same arguments
(debug mode's ``guard`` makes them agree first).
"""
from __future__ import annotations

from functools import cache
from math import prod
from typing import Callable, Hashable, Literal, Sequence

import torch
from mpi4py import MPI
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..runtime import watchdog
from .buffers import has_mpi_type
from ..runtime.mpi_library import collective_thresholds

ReduceOp = Literal["sum", "avg", "min", "max", "product"]

# Thresholds are ``((ranks, global bytes / ranks), ...)``: a choice applies from any pair on;
# per MPI library (``mpi_library.collective_thresholds``, measured: docs/mpi-settings.md).
# ALLTOALL_PACKED_MIN: packing + Alltoall(v) + unpacking instead of one Alltoallw with
# subarray types. ALLGATHER_PADDED_MIN: an uneven all-gather padding the pieces to the
# largest for a regular Allgather (a copy on each side) instead of Allgatherv.
ALLTOALL_PACKED_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["alltoall_packed"]
# ALLTOALL_PACK_SEND_MIN: the same where only the send side needs the copy (pieces strided in
# the input, landing on the result's leading dim: S(0) -> S(1)), which pays from smaller sizes.
ALLTOALL_PACK_SEND_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["alltoall_pack_send"]
ALLGATHER_PADDED_MIN: tuple[tuple[int, int], ...] = collective_thresholds()["allgather_padded"]

# GATHER_TYPED_MAX: an even all-gather along a later dim of at most this many bytes per rank
# receives each piece in place through a resized vector datatype, not back to back and then
# interleaved by a copy (measured with MPICH: docs/performance.md, "Collective choices").
GATHER_TYPED_MAX: int = 8 << 10

# The most elements one count or displacement of one MPI call may hold (None: no limit).
MAX_COUNT: int | None = None if MPI.Get_version() >= (4, 0) else 2**31 - 1

# Tensors that exist only while torch.compile traces. A kind hands them to the entry of its
# name in ``TRACED_OPS`` (a call of a custom op), which ``compiled`` fills when imported
# (``collectives`` imports it): the kinds do not import ``compiled``, whose ops call them.
TRACED = (FakeTensor, FunctionalTensor)
TRACED_OPS: dict[str, Callable[..., torch.Tensor]] = {}

Run = Callable[[torch.Tensor], torch.Tensor]  # a collective as a function of its staged input
# ``types(key, make)``: the committed derived datatype of ``key``, made by ``make()`` if new
# (``buffers.derived``, or a prepared collective's own: ``prepared.owned_types``)
Types = Callable[[Hashable, Callable[[], MPI.Datatype]], MPI.Datatype]

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}


def limits() -> tuple:
    """The tunables the cached layouts depend on, to key them by (tests and tuning may
    change them; a prepared collective compares them on each call, reading the same
    names inline: ``prepared.Prepared.__call__``, tests/test_collectives.py checks each)."""
    return MAX_COUNT, ALLGATHER_PADDED_MIN, ALLTOALL_PACKED_MIN, ALLTOALL_PACK_SEND_MIN, GATHER_TYPED_MAX


def beyond(thresholds: tuple[tuple[int, int], ...], size: int, total_bytes: int) -> bool:
    """Whether a communicator of ``size`` ranks moving ``total_bytes`` in all reaches any
    ``(ranks, bytes per rank)`` pair of ``thresholds``: the same answer on every rank."""
    return any(size >= ranks and total_bytes // size >= nbytes for ranks, nbytes in thresholds)


@cache  # not cleared: a fact of the dtype and op, bounded by dtypes x ops
def reduction(dtype: torch.dtype, op: str) -> tuple[torch.dtype, MPI.Op]:
    """The dtype MPI reduces in and the MPI op for ``op`` on ``dtype``."""
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_OPS)}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"'avg' needs a floating or complex dtype, got {dtype}")
    if op in ("min", "max") and dtype.is_complex:
        raise TypeError(f"{op!r} is undefined on complex dtype {dtype}")
    if dtype == torch.bool:
        return dtype, _BOOL_OPS[op]
    if has_mpi_type(dtype):
        return dtype, _OPS[op]
    return (torch.complex64 if dtype.is_complex else torch.float32), _OPS[op]  # as torch accumulates


# --- argument checks: identical on every rank when the ranks agree (see guard) ---------------

def check_dim(dim: int, ndim: int) -> int:
    """``dim`` made non-negative; ``IndexError`` when out of range."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def check_sizes(sizes: Sequence[int], size: int, total: int | None = None) -> None:
    """``sizes`` gives one non-negative length per rank, adding up to ``total`` if given."""
    if len(sizes) != size or min(sizes) < 0:
        raise ValueError(f"need {size} non-negative sizes, got {list(sizes)}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"sizes {list(sizes)} do not add up to {total}")


def check_root(root: int, comm: MPI.Intracomm) -> None:
    if not 0 <= root < comm.size:
        raise ValueError(f"root {root} is not a rank of a communicator of {comm.size}")


# --- shapes of pieces -------------------------------------------------------------------------

def piece_counts(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> list[int]:
    """Elements in each piece of ``sizes[r]`` indices along ``dim``."""
    per_index = prod(resized(shape, dim, 1))
    return [size * per_index for size in sizes]


def resized(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    """``shape`` with ``size`` along ``dim``."""
    return (*shape[:dim], size, *shape[dim + 1:])


# --- watchdog slot --------------------------------------------------------------------------

def enter(kind: str, comm: MPI.Intracomm, dtype: torch.dtype, counts: list[int]) -> None:
    """This rank now blocks in collective ``kind`` (watched when ``MPIDTENSOR_TIMEOUT`` is set)."""
    if watchdog.ENABLED:
        watchdog.enter(kind, comm, {"dtype": dtype, "counts": counts})


def leave() -> None:
    """The collective :func:`enter` announced has returned or raised."""
    if watchdog.ENABLED:
        watchdog.leave()
