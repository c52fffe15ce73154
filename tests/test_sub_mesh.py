"""DTensors on a sub-mesh (the even ranks), every rank taking part as torch requires: a rank
outside the mesh holds an empty local tensor, runs no collective and gets torch's default
results (an empty tensor, a 0-d zero, ``True`` for ``equal``), and its global metadata
equals the members'. Compared with one process on the members."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from helpers import CollectiveLog, assert_all_ranks
from subjob import run_job
from mpidtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD
MEMBERS = list(range(0, WORLD.size, 2))
INSIDE = WORLD.rank in MEMBERS


def _sub_mesh() -> DeviceMesh:
    return DeviceMesh("cpu", MEMBERS)


def _check_local(local: torch.Tensor, inside: torch.Tensor, outside: torch.Tensor, what: str) -> None:
    expected = inside if INSIDE else outside
    ok = local.shape == expected.shape and local.dtype == expected.dtype and torch.equal(local, expected)
    assert_all_ranks(ok, f"{what}: local {local} where {expected} was expected")


def test_coordinate_and_membership():
    mesh = _sub_mesh()
    coord = mesh.get_coordinate()
    ok = (coord == [MEMBERS.index(WORLD.rank)]) if INSIDE else coord is None
    ok = ok and mesh._is_current_rank_part_of_mesh() == INSIDE
    assert_all_ranks(ok, f"get_coordinate() {coord!r} on rank {WORLD.rank}")


def test_from_local_and_ops():
    mesh = _sub_mesh()
    n = len(MEMBERS)
    with CollectiveLog() as log:
        d = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
        e = d + 2
    outside_quiet = INSIDE or not log.calls
    assert_all_ranks(d.shape == (3 * n, 4) and e.shape == (3 * n, 4) and outside_quiet,
                     f"shape {tuple(d.shape)}, collectives outside {log.calls}")
    _check_local(d.to_local(), torch.ones(3, 4), torch.tensor([]), "from_local")
    _check_local(e.to_local(), torch.ones(3, 4) + 2, torch.tensor([]), "d + 2")
    _check_local(e.full_tensor(), torch.full((3 * n, 4), 3.0), torch.tensor([]), "full_tensor")


def test_default_results():
    mesh = _sub_mesh()
    a = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)])
    b = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)])
    same = a.equal(b)
    assert_all_ranks(same is True, f"equal gave {same!r}")
    total = a.sum()
    _check_local(total.to_local(), torch.tensor(12.0), torch.tensor(0.0), "sum's local")
    _check_local(total.full_tensor(), torch.tensor(12.0 * len(MEMBERS)), torch.tensor(0.0), "sum's full tensor")
    parts = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)]).split([2, 2], dim=1)
    assert_all_ranks(len(parts) == 2 and all(p.shape == (3 * len(MEMBERS), 2) for p in parts), "split's shapes")
    for p in parts:
        _check_local(p.to_local(), torch.ones(3, 2), torch.tensor([]), "split")
    a.add_(1)  # in place: the members' shards change, the others' stay empty
    _check_local(a.to_local(), torch.full((4, 3), 2.0), torch.tensor([]), "add_")


def test_redistribute_and_distribute():
    mesh = _sub_mesh()
    n = len(MEMBERS)
    full = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    with CollectiveLog() as log:
        d = distribute_tensor(full, mesh, [Shard(0)])
        rep = d.redistribute(mesh, [Replicate()])
        again = rep.redistribute(mesh, [Shard(0)])
    assert_all_ranks(INSIDE or not log.calls, f"collectives outside the mesh: {log.calls}")
    me = MEMBERS.index(WORLD.rank) if INSIDE else 0
    _check_local(rep.to_local(), full, torch.tensor([]), "Shard -> Replicate")
    _check_local(again.to_local(), full.chunk(n)[me], torch.tensor([]), "Replicate -> Shard")
    assert_all_ranks(again.placements == (Shard(0),) and again.shape == full.shape, "metadata")


def test_gradient_through_sub_mesh():
    mesh = _sub_mesh()
    x = torch.ones(2, 3, requires_grad=True)
    d = DTensor.from_local(x, mesh, [Shard(0)])
    (d * 3).sum().backward()
    # a member's local tensor is x: its gradient is 3 everywhere; outside, x took no part (torch's)
    ok = torch.equal(x.grad, torch.full((2, 3), 3.0)) if INSIDE else x.grad is None
    assert_all_ranks(ok, f"x.grad {x.grad}")


MESH_BUILT_BY_RANK_0_ONLY = """
    import time
    from mpi4py import MPI
    from mpidtensor import DeviceMesh

    if MPI.COMM_WORLD.rank == 0:
        DeviceMesh("cpu", [0])  # rank 1 never builds it: torch requires every rank to
        print("rank 0 went on", flush=True)
    else:
        time.sleep(120)
"""


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
def test_mesh_built_by_some_ranks_is_named_by_the_watchdog(tmp_path):
    """A sub-mesh built by only some ranks cannot be detected without them: the builders wait,
    and the watchdog's report names the mesh construction and ends the job."""
    result = run_job(MESH_BUILT_BY_RANK_0_ONLY, tmp_path, env={"MPIDTENSOR_TIMEOUT": "3"}, timeout=100)
    problems = result.abort_problems(("DeviceMesh construction",), went_on="rank 0 went on")
    assert_all_ranks(not problems, f"{problems} after {result.seconds:.1f} s:\n{result.output[-2000:]}")
