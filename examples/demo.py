"""A tour of mpidtensor's redistributions; any number of ranks.

    mpiexec -n 4 python examples/demo.py

Distributes a 7x5 tensor (sizes that do not divide evenly), moves it between
placements, prints each rank's local shape (rank 0 prints) and checks that
``full_tensor()`` gives the original back. Exits 1 if any check fails.
"""
import sys

import torch
from mpi4py import MPI

from mpidtensor import Replicate, Shard, distribute_tensor, init_device_mesh

world = MPI.COMM_WORLD
device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU per rank, if there are GPUs
torch.manual_seed(0)
original = torch.randn(7, 5)  # the same on every rank: same seed
failures = 0


def show(label, dtensor):
    """Print every rank's local shape and check the global value on all ranks."""
    global failures
    shapes = world.gather(tuple(dtensor.to_local().shape), root=0)
    ok = world.allreduce(torch.equal(dtensor.full_tensor().cpu(), original), op=MPI.LAND)
    failures += not ok
    if world.rank == 0:
        print(f"  {label:<26} local shapes {shapes}  {'ok' if ok else 'MISMATCH'}")


mesh = init_device_mesh(device, (world.size,))
if world.rank == 0:
    print(f"{mesh}, global shape {tuple(original.shape)}")
d = distribute_tensor(original, mesh, [Shard(0)])
show("Shard(0)", d)
show("Shard(0) -> Replicate", d.redistribute(mesh, [Replicate()]))
show("Shard(0) -> Shard(1)", d.redistribute(mesh, [Shard(1)]))
r = distribute_tensor(original, mesh, [Replicate()])
show("Replicate -> Shard(1)", r.redistribute(mesh, [Shard(1)]))

if world.size == 4:
    mesh2 = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    if world.rank == 0:
        print(mesh2)
    d = distribute_tensor(original, mesh2, [Shard(0), Shard(1)])
    show("[S(0), S(1)]", d)
    show("[S(0), S(1)] -> [R, S(0)]", d.redistribute(mesh2, [Replicate(), Shard(0)]))
    show("[S(0), S(1)] -> [S(1), R]", d.redistribute(mesh2, [Shard(1), Replicate()]))

if world.rank == 0:
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
sys.exit(1 if failures else 0)
