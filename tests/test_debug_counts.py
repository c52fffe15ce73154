"""CommDebugMode counts as torch's class reports them: by torch's ops (``comm_counts``,
lookups of ``get_comm_counts()``) and per pass (``comm_module_counts["Global"]``), besides
mpidtensor's kind names; checked against one process."""
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Partial, Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD
funcol = torch.ops.c10d_functional  # registered once torch's functional collectives are imported (CommDebugMode does)


def test_counts_by_torch_op_and_by_pass(mesh1d):
    full = global_tensor((7, 5))
    x = distribute_tensor(full, mesh1d, [Shard(0)]).requires_grad_()
    with CommDebugMode() as comm:
        y = x.redistribute(mesh1d, [Replicate()]).to_local(grad_placements=[Partial()])
        (y * y).sum().backward()
    many = int(WORLD.size > 1)  # one rank: nothing to move
    counts = comm.get_comm_counts()
    gather, scatter = funcol.all_gather_into_tensor, funcol.reduce_scatter_tensor
    assert_all_ranks(counts[gather] == many and counts["all_gather"] == many and counts.get(scatter, 0) == many,
                     str(counts))
    assert_all_ranks(counts[torch.ops._c10d_functional.all_gather_into_tensor] == many, str(counts))
    assert_all_ranks((gather in counts) == bool(many) and counts[funcol.all_reduce] == 0, str(counts))
    assert_all_ranks(comm.comm_counts[gather] == many and comm.comm_counts[scatter] == many, str(comm.comm_counts))
    fwd, bwd = comm.comm_module_counts["Global"]["forward"], comm.comm_module_counts["Global"]["backward"]
    assert_all_ranks(dict(fwd) == ({gather: 1} if many else {}) and dict(bwd) == ({scatter: 1} if many else {}),
                     f"{dict(fwd)} {dict(bwd)}")
    assert_all_ranks(dict(counts) == ({"all_gather": 1, "reduce_scatter": 1} if many else {}), str(counts))
    # the gradient: each rank's 2*full summed over ranks (Partial), then its shard
    assert_close(x.grad.full_tensor(), 2 * full * WORLD.size)


def test_counts_start_empty_on_each_enter(mesh1d):
    x = distribute_tensor(global_tensor((6,)), mesh1d, [Partial()])
    comm = CommDebugMode()
    with comm:
        x.redistribute(mesh1d, [Replicate()])
    with comm:
        pass
    assert_all_ranks(comm.get_total_counts() == 0 and not comm.comm_counts and
                     not comm.comm_module_counts["Global"]["forward"], str(comm.comm_counts))
