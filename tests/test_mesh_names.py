"""Mesh names and meshes over part of the world, as torch's DeviceMesh has them (issue 38):
``_flatten`` names looked up from the root (accelerate's ParallelismConfig mesh, compared
with torch on gloo), ``with mesh:``, ``_is_current_rank_part_of_mesh`` /
``_sym_get_coordinate``, ``init_device_mesh`` smaller than the world, meshes over a subset of
ranks built by every rank then the process group torn down, and torch's own mesh or
placements given to mpidtensor: a TypeError naming them on every rank."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from mpi4py import MPI

import mpidtensor
import mpidtensor.fsdp
import mpidtensor.parallel
from helpers import assert_all_ranks, raises_everywhere
from mpidtensor import DeviceMesh, Replicate, Shard, init_device_mesh
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank
PROGRAMS = Path(__file__).parent / "programs"
ACCELERATE = ("dp_replicate", "dp_shard", "cp", "tp")


def _four_d_sizes() -> tuple[int, ...]:
    return {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 3: (1, 3, 1, 1), 4: (1, 2, 2, 1)}.get(N, (1, N, 1, 1))


def test_flatten_names_as_accelerate():
    mesh = init_device_mesh("cpu", _four_d_sizes(), mesh_dim_names=ACCELERATE)
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    problems = []
    if dp.mesh_dim_names != ("dp",) or dp_shard_cp.mesh_dim_names != ("dp_shard_cp",):
        problems.append(f"names {dp.mesh_dim_names} {dp_shard_cp.mesh_dim_names}")
    if mesh["dp"] is not dp or mesh["dp_shard_cp"] is not dp_shard_cp or mesh["tp"]["dp"] is not dp:
        problems.append("a flattened name does not find its mesh from the root or a mesh sharing it")
    if mesh["dp_shard", "cp"]._flatten("dp_shard_cp") is not dp_shard_cp:
        problems.append("flattening the same dims under the same name again made another mesh")
    both = mesh["dp_replicate", "dp_shard_cp"]
    if both.mesh_dim_names != ("dp_replicate", "dp_shard_cp") or both.shape != (1, dp_shard_cp.size()):
        problems.append(f"mesh['dp_replicate', 'dp_shard_cp'] is {both}")
    total = torch.ones(1)
    total = mpidtensor.DTensor.from_local(total, dp_shard_cp, [mpidtensor.Partial()]).full_tensor()
    if total.item() != dp_shard_cp.size():
        problems.append(f"a sum over dp_shard_cp gave {total.item()}")
    assert_all_ranks(not problems, "; ".join(problems))
    raises_everywhere(ValueError, lambda: mesh["dp_replicate", "tp"]._flatten("dp"), "already names")
    raises_everywhere(ValueError, lambda: mesh["dp_shard", "cp"]._flatten("tp"), "already names a dim")
    raises_everywhere(KeyError, lambda: mesh["no_such"], "dp_shard_cp")
    raises_everywhere(ValueError, lambda: mesh["no_such"], "no_such")  # as before: ValueError too


@pytest.mark.exhaustive
@pytest.mark.timeout(600)
def test_flatten_names_against_torch():
    """accelerate's build_device_mesh under the switch prints what torch on gloo prints
    (full tier: four jobs, about 160 s here; the quick tier has the in-process test above)."""
    if N != 4:
        pytest.skip("compared at 4 ranks")
    problems = []
    for sizes in (("1", "2", "2", "1"), ("2", "2", "1", "1")):
        ours = run_command([sys.executable, "-m", "mpidtensor.run", str(PROGRAMS / "flatten_names.py"), *sizes],
                           ranks=4, timeout=250, cwd=PROGRAMS)
        theirs = run_peer([sys.executable, str(PROGRAMS / "torch_gloo.py"), str(PROGRAMS / "flatten_names.py"), *sizes],
                          ranks=4, timeout=250, cwd=PROGRAMS)
        got, want = ([line for line in r.output.splitlines() if line.startswith("RANK")] for r in (ours, theirs))
        if ours.returncode != 0 or theirs.returncode != 0 or not want or got != want:
            problems.append(f"{sizes}: exit {ours.returncode}/{theirs.returncode}\n" +
                            "\n".join(f"{a!r} vs {b!r}" for a, b in zip(got, want) if a != b) +
                            f"\n{ours.output[-2000:]}\n--- torch:\n{theirs.output[-1500:]}")
    assert_all_ranks(not problems, "\n".join(problems))


def test_mesh_internals_torch_calls():
    mesh = init_device_mesh("cpu", (N,))
    problems = []
    if not mesh._is_current_rank_part_of_mesh() or mesh._sym_get_coordinate(0) != RANK:
        problems.append("_is_current_rank_part_of_mesh / _sym_get_coordinate")
    with mesh as entered:
        x = mpidtensor.DTensor.from_local(torch.ones(2), placements=[Shard(0)])
        y = mpidtensor.distribute_tensor(torch.arange(4.0 * N), placements=[Shard(0)])
    if entered is not mesh or x.device_mesh is not mesh or y.device_mesh is not mesh or x.shape != (2 * N,):
        problems.append(f"with mesh: {entered} {x.device_mesh} {y.device_mesh}")
    assert_all_ranks(not problems, "; ".join(problems))
    raises_everywhere(ValueError, lambda: mpidtensor.distribute_tensor(torch.ones(2)), "with mesh")


def test_init_device_mesh_smaller_than_world():
    """As torch: ranks 0..n-1 form the mesh, the others get no coordinate; every rank calls."""
    if N < 2:
        pytest.skip("needs a rank outside the mesh")
    mesh = init_device_mesh("cpu", (N - 1,), mesh_dim_names=("dp",))
    inside = RANK < N - 1
    ok = mesh.mesh.tolist() == list(range(N - 1)) and mesh._is_current_rank_part_of_mesh() == inside
    ok = ok and (mesh.get_coordinate() == [RANK] if inside else mesh.get_coordinate() is None)
    if inside:
        x = mpidtensor.distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        ok = ok and torch.equal(x.full_tensor(), torch.arange(6.0))
    assert_all_ranks(ok, f"{mesh} coordinate {mesh.get_coordinate()}")
    raises_everywhere(ValueError, lambda: init_device_mesh("cpu", (N + 1,)), "holds")


def test_two_d_mesh_over_two_ranks_then_teardown():
    """torch's test_init: DeviceMesh("cpu", [[0], [last]]) built by every rank (a 2-D mesh
    over 2 ranks), zeros on it (an empty local tensor outside it, as torch: it raised there
    before, and the members then waited in the next mesh's Split), a DTensor on it, a 1-D
    mesh over [0, 2], then the group torn down."""
    if N < 3:
        pytest.skip("needs ranks outside the meshes")
    from mpidtensor.backend import process_group

    process_group.init_process_group()
    try:
        mesh = DeviceMesh("cpu", [[0], [N - 1]])
        inside = RANK in (0, N - 1)
        ok = mesh._is_current_rank_part_of_mesh() == inside
        z = mpidtensor.zeros([32, 3], device_mesh=mesh, placements=[Shard(0), Shard(1)])  # torch's test_init
        ok = ok and z.shape == (32, 3) and z.to_local().shape == ((16, 3) if inside else (0,))
        if inside:
            x = mpidtensor.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
            ok = ok and x.to_local().shape == (2, 2) and torch.equal(x.full_tensor(), torch.arange(8.0).reshape(4, 2))
        pair = DeviceMesh("cpu", [0, 2])
        if RANK in (0, 2):
            y = mpidtensor.distribute_tensor(torch.arange(4.0), pair, [Shard(0)])
            ok = ok and (y * 2).full_tensor().sum().item() == 12.0
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    assert_all_ranks(ok, f"rank {RANK}")


@pytest.mark.exhaustive
@pytest.mark.timeout(400)
def test_sub_meshes_then_destroy_at_eight_ranks():
    """Meshes over [0, 2] and [[0, 2], [4, 6]] of 8 ranks, then dist.barrier and
    destroy_process_group (a hang in torch's tests run under the switch)."""
    if RANK == 0:
        script = (
            "import torch\nimport torch.distributed as dist\n"
            "from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor\n"
            "pair = DeviceMesh('cpu', [0, 2])\nsquare = DeviceMesh('cpu', [[0, 2], [4, 6]])\n"
            "if dist.get_rank() in (0, 2):\n"
            "    assert distribute_tensor(torch.arange(4.0), pair, [Shard(0)]).full_tensor().sum() == 6\n"
            "if square.get_coordinate() is not None:\n"
            "    assert distribute_tensor(torch.arange(4.0), square, [Shard(0), Shard(0)]).full_tensor().sum() == 6\n"
            "dist.barrier()\ndist.destroy_process_group()\nprint('DONE', flush=True)\n")
        path = Path(tempfile.mkdtemp(prefix="mpidtensor-submesh-")) / "job.py"
    path = WORLD.bcast(str(path) if RANK == 0 else None)
    if RANK == 0:
        Path(path).write_text(script)
    WORLD.Barrier()
    ran = run_command([sys.executable, "-m", "mpidtensor.run", path], ranks=8, timeout=350)
    assert_all_ranks(ran.returncode == 0 and ran.output.count("DONE") == 8, ran.output[-3000:])


def test_torch_objects_rejected_naming_them(mesh1d):
    """torch's DeviceMesh or placements at mpidtensor's entry points: a TypeError that says
    it is torch's class and where it came from, on every rank (not AttributeError
    '_require_live' or "fully_shard needs a 1-D (FSDP) or 2-D (HSDP) DeviceMesh")."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.tensor import Shard as TorchShard

    theirs = TorchMesh.__new__(TorchMesh)  # torch's class; no process group needed to be refused
    model = torch.nn.Linear(2, 2)
    calls = {
        "distribute_tensor": lambda: mpidtensor.distribute_tensor(torch.ones(2), theirs, [Shard(0)]),
        "DTensor.from_local": lambda: mpidtensor.DTensor.from_local(torch.ones(2), theirs, [Shard(0)]),
        "fully_shard": lambda: mpidtensor.fsdp.fully_shard(model, mesh=theirs),
        "parallelize_module": lambda: mpidtensor.parallel.parallelize_module(model, theirs, {}),
        "zeros": lambda: mpidtensor.zeros(2, device_mesh=theirs),
    }
    for api, call in calls.items():
        raises_everywhere(TypeError, call, f"{api} got torch's own DeviceMesh (torch.distributed.device_mesh.DeviceMesh")
    raises_everywhere(TypeError, lambda: mpidtensor.distribute_tensor(torch.ones(2), mesh1d, [TorchShard(0)]),
                      "torch's own placement (torch.distributed.tensor.placement_types.Shard")
    from torch.distributed.tensor import DTensor as TorchDTensor

    theirs_dtensor = torch.Tensor._make_wrapper_subclass(TorchDTensor, (2,))  # torch's class; no mesh needed
    raises_everywhere(TypeError, lambda: mpidtensor.distribute_tensor(theirs_dtensor, mesh1d),
                      "distribute_tensor got torch's own DTensor (torch.distributed.tensor.DTensor")
    raises_everywhere(TypeError, lambda: mpidtensor.DTensor.from_local(theirs_dtensor, mesh1d),
                      "DTensor.from_local got torch's own DTensor")
