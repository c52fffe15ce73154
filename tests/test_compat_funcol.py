"""Under the switch, torch's functional collectives and ``dist.get_rank``/``get_world_size``
take mpidtensor's groups (what torchtitan passes): a mesh, ``(mesh, dim)``, a mesh's
communicator; results equal the sums, gathers and pieces computed in one process, and so do
their gradients (torch 2.13's collectives are differentiable)."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere

from mpidtensor import DeviceMesh, init_device_mesh
from mpidtensor.backend import distributed as switch_dist, funcol, mesh_groups

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


def _weights(seed: int, shape) -> list[torch.Tensor]:
    """Every rank's weight on its result (the same list on every rank)."""
    return [global_tensor(shape, torch.float64, seed=seed + 100 + r) for r in range(N)]


def _grad(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sum over ranks of (result * weight).sum()`` at this rank's ``x``
    (through the waited result, as programs use it)."""
    (funcol.wait_tensor(result) * weight).sum().backward()
    return x.grad


def test_gradients(mesh):
    """Each collective's gradient is the one of the same objective computed in one process:
    all-reduce (sum) -> all-reduce, all-gather -> reduce-scatter, reduce-scatter -> all-gather,
    all-to-all (uneven rows, transformers' expert parallelism) -> the reverse all-to-all."""
    xs = _everyone(4)
    x = xs[RANK].clone().requires_grad_()
    bad = []
    ws = _weights(4, (N * 2, 3))
    if not torch.allclose(_grad(funcol.all_reduce(x, "sum", mesh), x, ws[RANK]), sum(ws), atol=1e-12):
        bad.append("all_reduce")
    x.grad = None
    ws = _weights(5, (N * 2, 3 * N))
    want = sum(w.chunk(N, 1)[RANK] for w in ws)
    if not torch.allclose(_grad(funcol.all_gather_tensor(x, 1, (mesh, 0)), x, ws[RANK]), want, atol=1e-12):
        bad.append("all_gather_tensor")
    x.grad = None
    ws = _weights(6, (2, 3))
    if not torch.allclose(_grad(funcol.reduce_scatter_tensor(x, "sum", 0, mesh), x, ws[RANK]), torch.cat(ws), atol=1e-12):
        bad.append("reduce_scatter_tensor")
    sends = [[(r + k) % 3 for k in range(N)] for r in range(N)]  # rows rank r sends rank k (some none)
    rows = [global_tensor((sum(sends[r]), 3), torch.float64, seed=7 + r) for r in range(N)]
    mine = rows[RANK].clone().requires_grad_()
    recv = [sends[r][RANK] for r in range(N)]
    ws = [global_tensor((sum(sends[r][k] for r in range(N)), 3), torch.float64, seed=200 + k) for k in range(N)]
    got = funcol.all_to_all_single_autograd(mine, recv, sends[RANK], mesh.get_group())
    # one process: rank k's result is, in rank order, the rows every rank r sends it
    pieces = [rows[r].split(sends[r]) for r in range(N)]
    if not torch.equal(funcol.wait_tensor(got).detach(), torch.cat([pieces[r][RANK] for r in range(N)])):
        bad.append("all_to_all_single values")
    # the rows this rank sent rank k met rank k's weight at their place in its result
    grad = [ws[k].split([sends[r][k] for r in range(N)])[RANK] for k in range(N)]
    if not torch.allclose(_grad(got, mine, ws[RANK]), torch.cat(grad), atol=1e-12):
        bad.append("all_to_all_single_autograd")
    assert_all_ranks(not bad, str(bad))


def test_rank_of_a_communicator(mesh):
    group = mesh.get_group()
    ok = switch_dist.get_rank(group) == group.Get_rank() and switch_dist.get_world_size(group) == N
    assert_all_ranks(ok, "get_rank/get_world_size of a mesh communicator")
    flipped = DeviceMesh("cpu", list(reversed(range(N))))  # group rank 0 is global rank N - 1
    ranks = mesh_groups.get_process_group_ranks(flipped.get_group())
    ok = ranks == list(reversed(range(N))) and mesh_groups.get_global_rank(flipped.get_group(), 0) == N - 1
    ok = ok and mesh_groups.get_group_rank(flipped.get_group(), RANK) == N - 1 - RANK == flipped.get_local_rank()
    assert_all_ranks(ok, f"get_process_group_ranks / get_global_rank / get_group_rank: {ranks}")
    raises_everywhere(ValueError, lambda: mesh_groups.get_global_rank(group, N), "not part of group")
    raises_everywhere(ValueError, lambda: mesh_groups.get_group_rank(group, N + 3), "not part of group")


def test_bad_input(mesh):
    raises_everywhere(NotImplementedError, lambda: funcol.all_reduce(torch.ones(2), "sum", object()), "DeviceMesh")
    raises_everywhere(ValueError, lambda: funcol.all_reduce(torch.ones(2), "xor", mesh), "reduce with")
    if N > 1:
        raises_everywhere(ValueError, lambda: funcol.reduce_scatter_tensor(torch.ones(N + 1), "sum", 0, mesh),
                          "equal pieces")
