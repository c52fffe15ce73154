"""Large counts. With an MPI-4 library mpi4py passes counts beyond 2**31 through the
large-count routines; without one the collectives run in rounds of at most
``base.MAX_COUNT`` elements. The rounds are tested here with a tiny limit against
the same collective in one call; a real beyond-2**31 run is opt-in (``MPIDTENSOR_TEST_LARGE=1``,
several GiB per rank)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor.comm import base, collectives

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
assert_equal = functools.partial(assert_close, rtol=0, atol=0)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


class Spy(MPI.Intracomm):
    """``WORLD`` that counts the MPI calls made on it, by name."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def Allgather(self, *a): self._count("Allgather"); return super().Allgather(*a)  # noqa: E704
    def Allgatherv(self, *a): self._count("Allgatherv"); return super().Allgatherv(*a)  # noqa: E704
    def Allreduce(self, *a): self._count("Allreduce"); return super().Allreduce(*a)  # noqa: E704
    def Alltoallw(self, *a): self._count("Alltoallw"); return super().Alltoallw(*a)  # noqa: E704
    def Bcast(self, *a): self._count("Bcast"); return super().Bcast(*a)  # noqa: E704
    def Reduce_scatter(self, *a): self._count("Reduce_scatter"); return super().Reduce_scatter(*a)  # noqa: E704
    def Scatterv(self, *a): self._count("Scatterv"); return super().Scatterv(*a)  # noqa: E704


def both_ways(monkeypatch, limit: int, run) -> tuple[object, object, dict[str, int]]:
    """``run(comm)`` in one call per collective and in rounds of ``limit`` elements; and the
    MPI calls the rounds made."""
    monkeypatch.setattr(base, "MAX_COUNT", None)
    whole = run(WORLD)
    monkeypatch.setattr(base, "MAX_COUNT", limit)
    spy = Spy(WORLD)
    return whole, run(spy), spy.calls


def sizes_for(n: int) -> list[int]:
    """Uneven piece lengths adding up to ``n`` (empty pieces included at 3+ ranks)."""
    base = [(3, 0, 2, 1)[r % 4] for r in range(SIZE)]
    base[-1] += n - sum(base)
    return base if base[-1] >= 0 else [n // SIZE + (r < n % SIZE) for r in range(SIZE)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("even", [True, False])
def test_all_gather(monkeypatch, dtype, even):
    for dim, shape in ((0, (None, 5)), (1, (3, None, 2))):
        sizes = [4] * SIZE if even else sizes_for(3 * SIZE + 1)
        full = global_tensor(tuple(sum(sizes) if s is None else s for s in shape), dtype)
        mine = torch.split(full, sizes, dim)[RANK]
        whole, rounds, calls = both_ways(monkeypatch, 7, lambda c: collectives.all_gather(mine, c, dim=dim, sizes=sizes))
        assert_equal(whole, full)
        assert_equal(rounds, full)
        assert_all_ranks(calls.get("Allgatherv", 0) > 1, f"rounds made {calls}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_and_broadcast(monkeypatch, dtype):
    x = global_tensor((5, 7), dtype, seed=RANK)
    op = "max" if dtype == torch.bool else "sum"
    whole, rounds, calls = both_ways(monkeypatch, 6, lambda c: collectives.all_reduce(x, c, op))
    assert_equal(rounds, whole)
    assert_all_ranks(calls.get("Allreduce") == 6, f"35 elements in rounds of 6 made {calls}")
    whole, rounds, calls = both_ways(monkeypatch, 6, lambda c: collectives.broadcast(x, c, root=SIZE - 1))
    assert_equal(rounds, whole)
    assert_equal(rounds, global_tensor((5, 7), dtype, seed=SIZE - 1))
    assert_all_ranks(calls.get("Bcast") == 6, f"35 elements in rounds of 6 made {calls}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter(monkeypatch, dtype, dim):
    sizes = sizes_for(2 * SIZE + 3)
    shape = (sum(sizes), 3) if dim == 0 else (2, sum(sizes))
    x = global_tensor(shape, dtype, seed=RANK)
    op = "min" if dtype == torch.bool else "sum"
    whole, rounds, calls = both_ways(monkeypatch, 5,
                                     lambda c: collectives.reduce_scatter(x, c, op, dim=dim, sizes=sizes))
    assert_equal(rounds, whole)
    assert_all_ranks(calls.get("Reduce_scatter", 0) > 1, f"rounds made {calls}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_scatter(monkeypatch, dtype, dim):
    sizes = sizes_for(2 * SIZE + 3)
    full = global_tensor((sum(sizes), 4) if dim == 0 else (3, sum(sizes)), dtype)
    x = full if RANK == 0 else torch.zeros_like(full)
    whole, rounds, calls = both_ways(monkeypatch, 5, lambda c: collectives.scatter(x, c, 0, dim=dim, sizes=sizes))
    assert_equal(whole, torch.split(full, sizes, dim)[RANK])
    assert_equal(rounds, whole)
    assert_all_ranks(calls.get("Scatterv", 0) > 1, f"rounds made {calls}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_all_to_all_needs_no_rounds(monkeypatch, dtype):
    """Counts 1 and displacements 0 whatever the size: one call under any limit."""
    split_sizes = sizes_for(2 * SIZE + 1)
    concat_sizes = sizes_for(SIZE + 2)
    full = global_tensor((sum(split_sizes), sum(concat_sizes), 3), dtype)
    mine = torch.split(full, concat_sizes, 1)[RANK]
    whole, rounds, calls = both_ways(monkeypatch, 2, lambda c: collectives.all_to_all(
        mine, c, split_dim=0, concat_dim=1, split_sizes=split_sizes, concat_sizes=concat_sizes))
    assert_equal(whole, torch.split(full, split_sizes, 0)[RANK])
    assert_equal(rounds, whole)
    assert_all_ranks(calls == {"Alltoallw": 1}, str(calls))


@pytest.mark.skipif(os.environ.get("MPIDTENSOR_TEST_LARGE") != "1", reason="set MPIDTENSOR_TEST_LARGE=1 (GiBs)")
def test_beyond_int32_for_real():
    """2**31 + 2 one-byte elements through broadcast, all-reduce and all-gather."""
    n = 2**31 + 2
    x = torch.zeros(n, dtype=torch.uint8)
    if RANK == 0:
        x[-1], x[0] = 9, 7
    y = collectives.broadcast(x, WORLD)
    ends = (int(y[0]), int(y[-1]))
    del x
    z = collectives.all_reduce(y, WORLD, "max")
    ends += (int(z[-1]),)
    del y, z
    sizes = [n // SIZE + (r < n % SIZE) for r in range(SIZE)]
    g = collectives.all_gather(torch.full((sizes[RANK],), RANK, dtype=torch.uint8), WORLD, dim=0, sizes=sizes)
    ends += (int(g[-1]), int(g[sizes[0] - 1]))
    assert_all_ranks(ends == (7, 9, 9, SIZE - 1, 0), str(ends))
