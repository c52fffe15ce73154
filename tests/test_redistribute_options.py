"""torch's options of ``redistribute`` and the functional collectives' results: ``forward_dtype``
/ ``backward_dtype`` (values and gradients equal to one process, dtypes as torch gives them),
``async_op=True`` (an ``AsyncCollectiveTensor`` local tensor, views keep it, an op waits), and
``AsyncCollectiveTensor`` results with ``.wait()`` from ``torch.distributed._functional_collectives``
under the switch."""
import pytest
import torch
from mpi4py import MPI
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.backend import funcol
from mpidtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("forward_dtype,backward_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, None), (None, torch.bfloat16), (torch.float64, None),
    (torch.float32, torch.float32)])
def test_forward_and_backward_dtype(mesh1d, forward_dtype, backward_dtype):
    full = global_tensor((7, 5))
    weight = global_tensor((7, 5), seed=7)
    x = distribute_tensor(full, mesh1d, [Shard(0)]).requires_grad_()
    y = x.redistribute(mesh1d, [Replicate()], forward_dtype=forward_dtype, backward_dtype=backward_dtype)
    want_dtype = forward_dtype or torch.float32
    assert_all_ranks(y.dtype == want_dtype and y.to_local().dtype == want_dtype and y.placements == (Replicate(),),
                     f"{y.dtype} {y.to_local().dtype}")
    tol = dict(atol=1e-2, rtol=1e-2) if torch.bfloat16 in (forward_dtype, backward_dtype) else {}
    assert_close(y.to_local().float(), full.to(want_dtype).float(), **tol)
    (y.float() * weight).sum().backward()  # one process: the gradient of sum(x * weight) is weight
    assert_all_ranks(x.grad.dtype == torch.float32 and x.grad.to_local().dtype == torch.float32, str(x.grad.dtype))
    assert_close(x.grad.full_tensor(), weight.to(want_dtype).float(), **tol)


def test_backward_dtype_moves_the_gradient_in_it(mesh1d):
    x = distribute_tensor(global_tensor((8, 3)), mesh1d, [Shard(0)]).requires_grad_()
    y = x.redistribute(mesh1d, [Replicate()], backward_dtype=torch.bfloat16)
    seen = []
    y.register_hook(lambda g: seen.append(g.dtype))
    y.sum().backward()
    assert_all_ranks(seen == [torch.float32] and x.grad.dtype == torch.float32, str(seen))
    assert_close(x.grad.full_tensor(), torch.ones(8, 3))


def test_async_op_gives_an_async_collective_tensor(mesh1d):
    full = torch.ones(4 * WORLD.size, 2)
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    out = d.redistribute(mesh1d, [Replicate()], async_op=True)
    local = out.view(out.shape).to_local()
    moved = WORLD.size > 1  # one rank: nothing moves, the local tensor stays plain
    assert_all_ranks(isinstance(local, AsyncCollectiveTensor) == moved, type(local).__name__)
    if moved:
        assert_all_ranks(type(local.view(-1)) is AsyncCollectiveTensor and not local.completed)
    used = local.view(-1) + 1
    assert_all_ranks(type(used) is torch.Tensor, type(used).__name__)
    assert_close(used, full.view(-1) + 1)
    sync = d.redistribute(mesh1d, [Replicate()])
    assert_all_ranks(type(sync.to_local()) is torch.Tensor)


def test_functional_collectives_give_waitable_results(mesh1d):
    mine = global_tensor((2 * WORLD.size, 3), seed=WORLD.rank)
    everyone = [global_tensor((2 * WORLD.size, 3), seed=r) for r in range(WORLD.size)]
    with CommDebugMode() as comm:
        summed = funcol.all_reduce(mine, "sum", mesh1d)
        gathered = funcol.all_gather_tensor(mine, 0, mesh1d)
        scattered = funcol.reduce_scatter_tensor(mine, "sum", 0, mesh1d)
    assert_all_ranks(all(type(t) is AsyncCollectiveTensor for t in (summed, gathered, scattered)))
    assert_close(summed.wait(), sum(everyone))
    assert_close(funcol.wait_tensor(gathered), torch.cat(everyone))
    assert_close(scattered + 0, sum(everyone).chunk(WORLD.size)[WORLD.rank])
    counts = comm.get_comm_counts()  # one collective each, under torch's op and mpidtensor's name alike
    assert_all_ranks(counts[torch.ops.c10d_functional.all_reduce] == 1 and counts["all_gather"] == 1 and
                     counts[torch.ops.c10d_functional.reduce_scatter_tensor] == 1, str(counts))
