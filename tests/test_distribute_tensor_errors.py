"""distribute_tensor's errors and answers as torch's: a placement count that differs from the
mesh's dims, a non-leaf tensor, a DTensor given back (itself when laid out alike, else a
ValueError) — on every rank, before any data moves."""
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, global_tensor, raises_everywhere
from mpidtensor import Replicate, Shard, distribute_tensor, init_device_mesh

WORLD = MPI.COMM_WORLD


def test_placement_count(mesh1d):
    raises_everywhere(ValueError, lambda: distribute_tensor(global_tensor((4, 4)), mesh1d, [Shard(0), Shard(1)]),
                      match="must have the same length as `device_mesh.ndim`")


def test_non_leaf(mesh1d):
    made = global_tensor((4, 4)).requires_grad_() + 2
    raises_everywhere(RuntimeError, lambda: distribute_tensor(made, mesh1d, [Shard(0)]), match="leaf tensors")
    # checked before the placements, as torch does
    raises_everywhere(RuntimeError, lambda: distribute_tensor(made, mesh1d, [Shard(0), Shard(1)]), match="leaf tensors")


def test_dtensor_given_back(mesh1d):
    d = distribute_tensor(global_tensor((5, 3)), mesh1d, [Shard(0)])
    assert_all_ranks(distribute_tensor(d, mesh1d, [Shard(0)]) is d)
    raises_everywhere(ValueError, lambda: distribute_tensor(d, mesh1d, [Replicate()]), match="to a different placements")
    other = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("other",))
    if other != mesh1d:  # an equal mesh is the same mesh to torch too
        raises_everywhere(ValueError, lambda: distribute_tensor(d, other, [Shard(0)]), match="to a different device mesh")
    assert_all_ranks(torch.equal(d.full_tensor(), global_tensor((5, 3))))
