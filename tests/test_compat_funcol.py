"""Under the switch, torch's functional collectives and ``dist.get_rank``/``get_world_size``
take mpidtensor's groups (what torchtitan passes): a mesh, ``(mesh, dim)``, a mesh's
communicator; results equal the sums, gathers and pieces computed in one process."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere

from mpidtensor import init_device_mesh
from mpidtensor.backend import distributed as switch_dist, funcol

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))


def _mine(seed: int) -> torch.Tensor:
    return global_tensor((N * 2, 3), torch.float64, seed=seed + RANK)


def _everyone(seed: int) -> list[torch.Tensor]:
    return [global_tensor((N * 2, 3), torch.float64, seed=seed + r) for r in range(N)]


@pytest.mark.parametrize("form", ["mesh", "mesh_dim", "communicator"])
def test_all_reduce_forms(mesh, form):
    group = {"mesh": mesh, "mesh_dim": (mesh, 0), "communicator": mesh.get_group()}[form]
    got = funcol.wait_tensor(funcol.all_reduce(_mine(1), "sum", group))
    assert_close(got, sum(_everyone(1)), atol=1e-12, rtol=1e-12)
    assert_close(funcol.all_reduce(_mine(1), torch.distributed.ReduceOp.MAX, group),
                 torch.stack(_everyone(1)).amax(0), atol=0, rtol=0)


def test_gather_and_reduce_scatter(mesh):
    assert_close(funcol.all_gather_tensor(_mine(2), 1, mesh), torch.cat(_everyone(2), 1), atol=0, rtol=0)
    got = funcol.reduce_scatter_tensor(_mine(3), "sum", 0, mesh)
    assert_close(got, sum(_everyone(3)).chunk(N, 0)[RANK], atol=1e-12, rtol=1e-12)


def test_rank_of_a_communicator(mesh):
    group = mesh.get_group()
    ok = switch_dist.get_rank(group) == group.Get_rank() and switch_dist.get_world_size(group) == N
    assert_all_ranks(ok, "get_rank/get_world_size of a mesh communicator")


def test_bad_input(mesh):
    raises_everywhere(NotImplementedError, lambda: funcol.all_reduce(torch.ones(2), "sum", object()), "DeviceMesh")
    raises_everywhere(ValueError, lambda: funcol.all_reduce(torch.ones(2), "xor", mesh), "reduce with")
    if N > 1:
        raises_everywhere(ValueError, lambda: funcol.reduce_scatter_tensor(torch.ones(N + 1), "sum", 0, mesh),
                          "equal pieces")
