"""Debug mode: ranks that enter diverging collectives all raise a clear error, promptly,
and the communicator stays usable afterwards."""
from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.comm import collectives, guard

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
multi_rank = pytest.mark.skipif(SIZE == 1, reason="a mismatch needs two ranks")


@pytest.fixture(autouse=True)
def _debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "ENABLED", True)


def raised_everywhere(run, expected: type[Exception] = ValueError, *needles: str) -> None:
    """``run()`` raises ``expected`` on every rank within seconds, with all ``needles`` in the
    message; then the world communicator still works."""
    start = time.monotonic()
    try:
        run()
        message = "did not raise"
    except expected as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        message = f"message {text!r} lacks {missing}" if missing else None
    elapsed = time.monotonic() - start
    assert_all_ranks(message is None, message or "")
    assert_all_ranks(elapsed < 5, f"took {elapsed:.1f} s")
    x = global_tensor((SIZE, 3))
    assert_close(collectives.all_reduce(x, WORLD), x * SIZE)


@multi_rank
def test_different_collectives():
    x = torch.ones(SIZE, 2)

    def run():
        if RANK == 0:
            collectives.all_gather(x[:1], WORLD, dim=0, sizes=[1] * SIZE)
        else:
            collectives.all_reduce(x, WORLD)

    raised_everywhere(run, ValueError, "different collectives", "all_gather on ranks [0]", "all_reduce on ranks")


@multi_rank
def test_different_dtypes():
    dtype = torch.float64 if RANK == SIZE - 1 else torch.float32
    raised_everywhere(lambda: collectives.all_reduce(torch.ones(3, dtype=dtype), WORLD),
                      ValueError, "all_reduce", "dtype differs", f"float64 on ranks [{SIZE - 1}]")


@multi_rank
def test_different_shapes():
    raised_everywhere(lambda: collectives.all_reduce(torch.ones(2 + (RANK == 1)), WORLD),
                      ValueError, "shape differs", "(3,) on ranks [1]")


@multi_rank
def test_different_sizes_and_ops():
    sizes = [1] * SIZE if RANK else [2] + [1] * (SIZE - 1)
    x = torch.ones(sizes[RANK], 4)
    raised_everywhere(lambda: collectives.all_gather(x, WORLD, dim=0, sizes=sizes), ValueError, "sizes differs")
    op = "max" if RANK == 0 else "sum"
    raised_everywhere(lambda: collectives.all_reduce(torch.ones(2), WORLD, op), ValueError, "op differs")


@multi_rank
def test_different_roots():
    raised_everywhere(lambda: collectives.broadcast(torch.ones(2), WORLD, root=RANK % 2),
                      ValueError, "broadcast", "root differs")


@multi_rank
def test_bad_local_argument_on_one_rank():
    """Rank 1's piece has the wrong length: without debug mode only rank 1 would raise."""
    sizes = [2] * SIZE
    x = torch.ones(3 if RANK == 1 else 2, 5)
    raised_everywhere(lambda: collectives.all_gather(x, WORLD, dim=0, sizes=sizes),
                      ValueError, "bad arguments on ranks [1]", "sizes[1] is 2")


def test_bad_argument_keeps_its_type():
    """An error found on every rank keeps its exception type (at any world size)."""
    raised_everywhere(lambda: collectives.all_reduce(torch.ones(2, dtype=torch.int64), WORLD, "avg"),
                      TypeError, "'avg' needs a floating")
    raised_everywhere(lambda: collectives.all_gather(torch.ones(2), WORLD, dim=3, sizes=[2] * SIZE),
                      IndexError, "out of range")


@multi_rank
def test_not_an_mpidtensor_collective():
    def run():
        if RANK == 0:
            WORLD.allgather("a user's own allgather")
        else:
            collectives.all_reduce(torch.ones(2), WORLD)

    if RANK == 0:
        run()  # rank 0 took part in the check with a foreign object; the others raise
        raised = True
    else:
        try:
            run()
            raised = False
        except ValueError as exc:
            raised = "not an mpidtensor collective" in str(exc)
    assert_all_ranks(raised, "the others did not raise")


@pytest.mark.parametrize("shape", [(7, 5), (0, 3)])
def test_agreeing_ranks_run_normally(mesh1d, shape):
    """Debug mode changes no result: a redistribution round trip with the check on."""
    x = global_tensor(shape)
    d = distribute_tensor(x, mesh1d, [Shard(1)]).redistribute(mesh1d, [Shard(0)])
    assert_close(d.redistribute(mesh1d, [Replicate()]).to_local(), x)
    assert_close(d.full_tensor(), x)


def test_negative_and_positive_dims_agree():
    x = torch.ones(1, 2)
    dim = -2 if RANK % 2 else 0
    assert_close(collectives.all_gather(x, WORLD, dim=dim, sizes=[1] * SIZE), torch.ones(SIZE, 2))
