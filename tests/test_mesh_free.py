"""``DeviceMesh.free()``: the mesh's communicators are released, nothing cached calls them,
a new mesh over the same ranks works, and every use of the freed one raises the same
error on every rank (decided from the mesh every rank freed alike: no collective)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.comm import collectives
from mpidtensor.runtime import caches
from mpidtensor.tensor.spec import DTensorSpec

WORLD = MPI.COMM_WORLD
FREED = "was freed"


def _shape() -> tuple[int, int]:
    return (2, WORLD.size // 2) if WORLD.size % 2 == 0 and WORLD.size > 2 else (WORLD.size, 1)


def test_redistribute_on_a_new_mesh_and_on_the_freed_one():
    full = global_tensor((7, 5))
    old = init_device_mesh("cpu", (WORLD.size,))
    x = distribute_tensor(full, old, [Shard(0)])
    assert_close(x.redistribute(old, [Replicate()]).to_local(), full)
    assert_close(x.full_tensor(), full)
    assert_all_ranks(caches.registered()["redistribute.plans"] > 0)
    old.free()
    assert_all_ranks(all(size <= 0 for name, size in caches.registered().items() if name.startswith(
        ("redistribute.", "dtensor."))), str(caches.registered()))

    new = init_device_mesh("cpu", (WORLD.size,))
    assert_all_ranks(new != old and old == old, "a freed mesh must equal no new one")
    y = distribute_tensor(full, new, [Shard(0)])
    for placements in ([Replicate()], [Shard(1)], [Shard(0)]):
        moved = y.redistribute(new, placements)
        assert_close(moved.full_tensor(), full)
    assert_close(y.redistribute(new, [Replicate()]).to_local(), full)

    raises_everywhere(RuntimeError, lambda: x.redistribute(old, [Replicate()]), FREED)
    raises_everywhere(RuntimeError, lambda: x.redistribute(placements=[Shard(1)]), FREED)
    raises_everywhere(RuntimeError, lambda: x.full_tensor(), FREED)
    raises_everywhere(RuntimeError, lambda: distribute_tensor(full, old, [Shard(0)]), FREED)
    raises_everywhere(RuntimeError, lambda: DTensor.from_local(torch.ones(2), old, [Replicate()]), FREED)
    raises_everywhere(RuntimeError, lambda: DTensor.from_local(torch.ones(2), old, [Shard(0)], shape=(2 * WORLD.size,),
                                                                          stride=(1,)),
                      FREED)
    raises_everywhere(RuntimeError, lambda: collectives.all_reduce(torch.ones(3), old.comm), FREED)
    raises_everywhere(RuntimeError, lambda: old.get_group(), FREED)
    old.free()  # a second free does nothing
    assert_close(y.redistribute(new, [Replicate()]).to_local(), full)  # the new mesh is untouched
    assert_all_ranks(all(spec.mesh is not old for spec in DTensorSpec._interned.values()),
                     "the freed mesh's specs stay interned")
    new.free()


def test_sub_meshes_are_freed_with_their_mesh():
    full = global_tensor((6, 4))
    mesh = init_device_mesh("cpu", _shape(), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    flat = mesh._flatten("all")
    x = distribute_tensor(full, dp, [Shard(0)])
    assert_close(x.full_tensor(), full)
    mesh.free()
    for sub in (dp, tp, flat):
        raises_everywhere(RuntimeError, lambda: sub.comm, FREED)
    raises_everywhere(RuntimeError, lambda: mesh["dp"], FREED)
    raises_everywhere(RuntimeError, lambda: mesh["dp", "tp"], FREED)
    raises_everywhere(RuntimeError, lambda: x.full_tensor(), FREED)


def test_a_sub_mesh_freed_alone_is_made_anew():
    full = global_tensor((6, 4))
    mesh = init_device_mesh("cpu", _shape(), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    dp.free()
    raises_everywhere(RuntimeError, lambda: distribute_tensor(full, dp, [Shard(0)]), FREED)
    again = mesh["dp"]
    assert_all_ranks(again is not dp and again == mesh["dp"])
    assert_close(distribute_tensor(full, again, [Shard(0)]).full_tensor(), full)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert_close(x.full_tensor(), full)  # the parent mesh was not touched
    mesh.free()
