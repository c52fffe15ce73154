"""``DTensor.from_local(run_check=True)`` refuses, on every rank, local tensors whose
``requires_grad`` or strides (at equal local shapes) differ across ranks, as torch's check
does; uneven shards (different shapes, so different strides) stay accepted; ``run_check=False``
does not look."""
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD


def test_requires_grad_must_agree(mesh1d):
    local = torch.randn(3, 3, requires_grad=WORLD.rank != 0)
    if WORLD.size > 1:
        raises_everywhere(ValueError, lambda: DTensor.from_local(local, mesh1d, [Shard(0)], run_check=True),
                          match="requires_grad")
    DTensor.from_local(local, mesh1d, [Shard(0)], run_check=False)


def test_strides_must_agree(mesh1d):
    local = torch.randn(4, 4)
    local = local.t() if WORLD.rank == 0 else local  # same shape, another layout on rank 0
    if WORLD.size > 1:
        raises_everywhere(ValueError, lambda: DTensor.from_local(local, mesh1d, [Shard(0)], run_check=True),
                          match="strides")
    DTensor.from_local(local, mesh1d, [Shard(0)], run_check=False)


def test_uneven_shards_still_pass(mesh1d):
    full = global_tensor((7, 5))
    mine = distribute_tensor(full, mesh1d, [Shard(1)]).to_local()  # widths differ: so do the strides
    d = DTensor.from_local(mine, mesh1d, [Shard(1)], run_check=True)
    assert_close(d.full_tensor(), full)
    assert_all_ranks(d.shape == full.shape)
