"""The all-to-all through shared-memory windows (``comm.shared_memory``): ``S(i) -> S(j)``
whose pieces are strided in the input only and land on the result's leading dim.

Checked against one process on every call: even and uneven pieces (empty ones at 4 ranks),
several dtypes, a 2x2 mesh's dims, windows grown by a larger all-to-all and used in turn,
results handed back never overwritten, the fallback to MPI's collective where the ranks
do not share a node, and the windows freed with their mesh."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Shard, clear_cache, distribute_tensor, init_device_mesh
from mpidtensor.comm import base, shared_memory

WORLD = MPI.COMM_WORLD
N = WORLD.size


@pytest.fixture
def shared(monkeypatch):
    """The packed S(0) -> S(1) (and so the windows) at every size."""
    monkeypatch.setattr(base, "ALLTOALL_PACK_SEND_MIN", ((1, 0),))
    clear_cache()
    yield
    clear_cache()


def windows_of(mesh, dims=(0,)):
    return mesh.comm_for(dims).Get_attr(shared_memory._KEYVAL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64])
@pytest.mark.parametrize("shape", [(2 * N, 3 * N), (2 * N + 1, 3 * N + 2), (3, 5), (1, 3 * N, 2), (2 * N, 3 * N, 2)])
def test_matches_one_process(mesh1d, shared, shape, dtype):
    full = global_tensor(shape, dtype)
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    results = [x.redistribute(mesh1d, [Shard(1)]) for _ in range(3)]  # the first prepares
    for out in results:  # none overwritten by a later call
        assert_close(out.to_local(), full.chunk(N, 1)[WORLD.rank] if WORLD.rank < len(full.chunk(N, 1))
                     else full.narrow(1, 0, 0))
        assert_close(out.full_tensor(), full)
    # a single leading row splits along dim 1 without packing: MPI's collective, no windows
    # (asserted only where this call must have made them: the mesh may hold earlier tests' windows)
    if N > 1 and shape[0] > 1:
        used = windows_of(mesh1d)
        assert_all_ranks(used is not None and used.nbytes > 0, "the windows were not used")


def test_windows_grow_and_alternate(mesh1d, shared):
    small, large = global_tensor((2 * N, 4 * N)), global_tensor((8 * N + 1, 16 * N + 3))
    xs = [distribute_tensor(t, mesh1d, [Shard(0)]) for t in (small, large)]
    held = [(full, x.redistribute(mesh1d, [Shard(1)])) for _ in range(3) for full, x in zip((small, large), xs)]
    for full, out in held:
        assert_close(out.full_tensor(), full)
    # MPI lays the ranks' parts back to back: the even pieces are copied out of all at once
    if N > 1:
        assert_all_ranks(all(rows is not None for rows in windows_of(mesh1d).rows),
                         "the windows' parts do not lie back to back")


def test_2d_mesh_dims(mesh2d, shared):
    full = global_tensor((8, 12, 3))
    for src, dst in [([Shard(0), Shard(1)], [Shard(0), Shard(2)]), ([Shard(1), Shard(0)], [Shard(2), Shard(0)]),
                     ([Shard(0), Shard(0)], [Shard(0), Shard(1)])]:
        x = distribute_tensor(full, mesh2d, src)
        for _ in range(2):
            out = x.redistribute(mesh2d, dst)
            assert_close(out.full_tensor(), full)
            assert_all_ranks(out.placements == tuple(dst))


def test_ranks_on_several_nodes_take_the_collective(mesh1d, shared, monkeypatch):
    monkeypatch.setattr(shared_memory, "one_node", lambda comm: False)
    full = global_tensor((2 * N + 1, 3 * N))
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    for _ in range(2):
        assert_close(x.redistribute(mesh1d, [Shard(1)]).full_tensor(), full)


def test_windows_are_freed_with_their_mesh(shared):
    mesh = init_device_mesh("cpu", (N,))
    full = global_tensor((2 * N, 3 * N))
    assert_close(distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).full_tensor(), full)
    windows = windows_of(mesh)
    mesh.free()
    assert_all_ranks(windows is None or windows.windows == [], "windows left after the mesh was freed")
