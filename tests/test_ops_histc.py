"""``histc`` of DTensors equals one process; with a fixed range a sharded input is counted
where it lies (``Partial(sum)`` bins, no collective, as torch's rule), with the data's range
it is gathered once; 1-D and 2-D meshes, uneven shards, a Partial input."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()])
@pytest.mark.parametrize("fixed", [True, False])
def test_histc(mesh1d, placement, fixed):
    full = global_tensor((7, 5))
    kwargs = dict(bins=9, min=-1.0, max=1.0) if fixed else dict(bins=6)
    d = distribute_tensor(full, mesh1d, [placement])
    with CommDebugMode() as comm:
        out = d.histc(**kwargs)
    sharded = isinstance(placement, Shard)
    want = (Partial("sum"),) if sharded and fixed else (Replicate(),)
    gathers = int(sharded and not fixed and WORLD.size > 1)
    assert_all_ranks(out.placements == want and comm.get_total_counts() == gathers,
                     f"{out.placements} {comm.get_comm_counts()}")
    assert_close(out.full_tensor(), full.histc(**kwargs), atol=0, rtol=0)


def test_histc_partial_input(mesh1d):
    full = global_tensor((6, 4))
    d = DTensor.from_local(full / WORLD.size, mesh1d, [Partial()])
    out = d.histc(bins=5, min=-2.0, max=2.0)
    assert_all_ranks(out.placements == (Replicate(),), str(out.placements))
    assert_close(out.full_tensor(), d.full_tensor().histc(bins=5, min=-2.0, max=2.0), atol=0, rtol=0)


def test_histc_2d_mesh(mesh2d):
    full = global_tensor((5, 7))
    d = distribute_tensor(full, mesh2d, [Shard(0), Shard(1)])
    out = d.histc(bins=4, min=-1.5, max=1.5)
    assert_all_ranks(out.placements == (Partial("sum"), Partial("sum")), str(out.placements))
    assert_close(out.full_tensor(), full.histc(bins=4, min=-1.5, max=1.5), atol=0, rtol=0)
