"""mesh.nonblocking: the non-blocking collectives FSDP overlaps with compute."""
import pytest
import torch
from mpi4py import MPI

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor
from mpidtensor.comm.nonblocking import iall_gather, iall_reduce, ireduce_scatter

WORLD = MPI.COMM_WORLD
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int32]


def _per_rank(numel: int, dtype: torch.dtype):
    """Every rank's input (all ranks build all of them from fixed seeds)."""
    return [global_tensor((numel,), dtype, seed=100 + r) for r in range(WORLD.size)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_iall_gather(dtype):
    inputs = _per_rank(7, dtype)
    out = torch.full((7 * WORLD.size,), 3, dtype=dtype)
    with CollectiveLog() as log:
        handle = iall_gather(inputs[WORLD.rank], WORLD, out=out)
    assert_all_ranks(log.calls == ["all_gather"] and not handle.done(), f"{log.calls}")
    result = handle.wait()
    assert_all_ranks(result is out and handle.done() and handle.wait() is out)
    assert_close(out, torch.cat(inputs), atol=0, rtol=0)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ireduce_scatter(dtype, op):
    piece = 5
    inputs = _per_rank(piece * WORLD.size, dtype)
    expected = torch.stack([t.float() for t in inputs]).sum(0)
    if op == "avg":
        expected /= WORLD.size
    with CollectiveLog() as log:
        handle = ireduce_scatter(inputs[WORLD.rank], WORLD, op)
    result = handle.wait()
    assert_all_ranks(log.calls == ["reduce_scatter"] and result.dtype == dtype, f"{log.calls} {result.dtype}")
    mine = expected[WORLD.rank * piece:(WORLD.rank + 1) * piece].to(dtype)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    assert_close(result, mine, **tol)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_iall_reduce(dtype, inplace):
    inputs = _per_rank(6, dtype)
    expected = torch.stack([t.double() for t in inputs]).sum(0).to(dtype)
    mine = inputs[WORLD.rank].clone()
    with CollectiveLog() as log:
        result = iall_reduce(mine, WORLD, "sum", inplace=inplace).wait()
    assert_all_ranks(log.calls == ["all_reduce"] and (result is mine) == inplace)
    if not inplace:
        assert_close(mine, inputs[WORLD.rank], atol=0, rtol=0)
    tol = dict(atol=5e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    assert_close(result, expected, **tol)


def test_overlapping_collectives_complete_in_any_wait_order():
    a, b = _per_rank(4, torch.float32), _per_rank(4 * WORLD.size, torch.float32)
    gather = iall_gather(a[WORLD.rank], WORLD)
    reduce = ireduce_scatter(b[WORLD.rank], WORLD, "sum")
    reduced = reduce.wait()
    gathered = gather.wait()
    assert_close(gathered, torch.cat(a), atol=0, rtol=0)
    assert_close(reduced, torch.stack(b).sum(0)[WORLD.rank * 4:(WORLD.rank + 1) * 4], atol=1e-5, rtol=1e-5)


def test_bad_input_raises():
    for call in (lambda: iall_gather(torch.zeros(2, 3), WORLD),
                 lambda: ireduce_scatter(torch.zeros(WORLD.size * 2 + 1), WORLD) if WORLD.size > 1
                 else iall_gather(torch.zeros(4)[::2], WORLD),
                 lambda: iall_gather(torch.zeros(3), WORLD, out=torch.zeros(3 * WORLD.size + 1))):
        try:
            call()
            ok = False
        except ValueError:
            ok = True
        assert_all_ranks(ok, "no ValueError")
