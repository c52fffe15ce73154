"""Bad input never leaves ranks waiting: a decision that could differ between ranks is
taken from what every rank shares (or agreed in the collective that runs anyway), so
every rank raises the same error; where only one rank can know (its own local tensor,
its own plain argument), that rank raises and the abort hook ends the job, in seconds."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from subjob import WORLD, run_job


def _needs_two_ranks() -> None:
    if WORLD.size == 1:
        pytest.skip("the ranks must disagree")


def test_negative_shard_dim_is_resolved_against_the_agreed_rank(mesh1d):
    """Shard(2) with a 3-D local tensor on rank 0 and 2-D ones elsewhere: the other ranks
    used to reject Shard(2) before the shape all-gather that rank 0 had entered."""
    _needs_two_ranks()
    local = torch.zeros(2, 3, 4) if WORLD.rank == 0 else torch.zeros(2, 3)
    for placements in ([Shard(2)], [Shard(-1)]):
        for run_check in (False, True):
            raises_everywhere(ValueError, lambda: DTensor.from_local(local, mesh1d, placements, run_check=run_check),
                              "different numbers of dims")


def test_negative_shard_dim_follows_the_global_shape(mesh1d):
    """With ``shape=``, Shard(-1) is resolved against the global shape (its last dim)."""
    shape = (3, 2 * WORLD.size)
    d = DTensor.from_local(torch.ones(3, 2), mesh1d, [Shard(-1)], shape=shape, stride=(shape[1], 1))
    assert_all_ranks(d.placements == (Shard(1),) and tuple(d.shape) == shape, f"{d.placements} {tuple(d.shape)}")


def test_run_check_agrees_on_shape_argument(mesh1d):
    _needs_two_ranks()
    shape = (WORLD.size, 4) if WORLD.rank == 0 else (WORLD.size, 5)
    raises_everywhere(ValueError, lambda: DTensor.from_local(torch.ones(1, 4), mesh1d, [Shard(0)], run_check=True,
                                                             shape=shape, stride=(shape[1], 1)), "different shape= arguments")
    raises_everywhere(ValueError, lambda: DTensor.from_local(torch.ones(1, 4), mesh1d, [Replicate()], run_check=True,
                                                             shape=(1, 4, 1), stride=(4, 1, 1)), "shape= (1, 4, 1) has 3")


WRONG_SHARD_ON_RANK_1 = """
    import time
    import torch
    from mpi4py import MPI
    from mpidtensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    local = torch.ones(3 if MPI.COMM_WORLD.rank == 1 else 2, 3)  # rank 1 holds a row too many
    if MPI.COMM_WORLD.rank == 1:
        print(f"RAISED={time.time()}", flush=True)
    d = DTensor.from_local(local, mesh, [Shard(0)], shape=(4, 3), stride=(3, 1))
    d.full_tensor()  # rank 0 would wait here forever
    print("rank finished", flush=True)
"""

PLAIN_ON_ANOTHER_DEVICE_ON_RANK_1 = """
    import time
    import torch
    from mpi4py import MPI
    from mpidtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    plain = torch.ones(4, 3, device="meta" if MPI.COMM_WORLD.rank == 1 else "cpu")
    if MPI.COMM_WORLD.rank == 1:
        print(f"RAISED={time.time()}", flush=True)
    torch.add(d, plain).full_tensor()  # rank 0 would wait here forever
    print("rank finished", flush=True)
"""


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
@pytest.mark.parametrize("script, message", [
    (WRONG_SHARD_ON_RANK_1, "ValueError: local tensor of shape (3, 3) does not match the shard (2, 3)"),
    (PLAIN_ON_ANOTHER_DEVICE_ON_RANK_1, "TypeError: aten.add.Tensor: a plain meta tensor was mixed with DTensors"),
], ids=["from_local_wrong_shard", "plain_tensor_device"])
def test_a_fact_only_one_rank_knows_ends_the_job(tmp_path, script, message):
    """The rank that sees the problem raises; the abort hook ends the others (no hang)."""
    result = run_job(script, tmp_path, timeout=180)
    problems = result.abort_problems((message, "aborting the MPI job"), went_on="rank finished")
    assert_all_ranks(not problems, f"{problems} after {result.seconds:.1f} s:\n{result.output[-2000:]}")
    after = result.seconds_after("RAISED")
    assert_all_ranks(after is not None and after < 10, f"ended {after} s after the bad call")


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_out_of_range_indices_raise_on_every_rank(mesh1d, placement):
    """self sharded (masked reads of the indexed dim, or blocks that are empty on some ranks
    with 2 rows over 3+ ranks): a replicated bad index still raises everywhere, as in torch."""
    x = distribute_tensor(torch.arange(10.0).view(2, 5), mesh1d, [placement])
    bad, rows = torch.tensor([1, 5]), torch.tensor([[0], [5]])
    raises_everywhere(RuntimeError, lambda: torch.index_select(x, 1, bad), "out of")
    raises_everywhere(RuntimeError, lambda: x.index_add(1, bad, torch.ones(2, 2)), "out of bounds")
    if placement == Shard(1):  # under Shard(0) the (2, 1) index is sharded with self: checked where held
        raises_everywhere(RuntimeError, lambda: torch.gather(x, 1, rows), "index 5 is out of bounds")
        raises_everywhere(RuntimeError, lambda: x.scatter(1, rows, 1.0), "out of bounds")
    raises_everywhere(IndexError, lambda: x[:, torch.tensor([-6])], "index -6 is out of bounds")
    raises_everywhere(IndexError, lambda: x.index_put((torch.tensor([0]), bad), torch.tensor(1.0)), "out of bounds")
    expected = torch.arange(10.0).view(2, 5)[:, torch.tensor([-1, 0])]
    assert_close(x[:, torch.tensor([-1, 0])].full_tensor(), expected)
