"""FSDP2's argument checks and state API as torch 2.13's: ``fully_shard.state(module)``,
and each check with torch's exception type and message (torch's ``_fsdp_init``,
``_fsdp_param`` and ``_fsdp_state``), raised on every rank (decided from what every rank
shares) before the module changes, or, for a parameter shared across two groups, at the
first forward as torch does. On a one-rank mesh FSDP runs no collective (torch skips them)."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor import init_device_mesh
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import FSDPModule, fully_shard
from mpidtensor.fsdp.state import FSDPState
from mpidtensor.tensor.placements import Shard

WORLD = MPI.COMM_WORLD
N = WORLD.size


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def unchanged(net: nn.Module) -> bool:
    return not isinstance(net, FSDPModule) and "_fsdp_state" not in vars(net)


def test_state_of_a_module():
    """``fully_shard.state``: the module's FSDP state, one for a list sharded as a group,
    None for a module fully_shard was not applied to."""
    net = Net()
    fully_shard([net.inp, net.out])
    fully_shard(net)
    inner, outer = fully_shard.state(net.inp), fully_shard.state(net)
    assert_all_ranks(isinstance(inner, FSDPState) and isinstance(outer, FSDPState) and inner is not outer
                     and fully_shard.state(net.out) is inner and fully_shard.state(nn.Linear(1, 1)) is None,
                     f"{inner} {outer}")
    net(torch.ones(3, 4)).sum().backward()
    assert_all_ranks(outer.is_root and not inner.is_root)


def test_2d_mesh_without_dim_names():
    net = Net()
    mesh = init_device_mesh("cpu", (1, N))
    raises_everywhere(AssertionError, lambda: fully_shard(net, mesh=mesh),
                      "Please init the 2D mesh for HSDP with mesh_dim_names specified")
    assert_all_ranks(unchanged(net))


def test_3d_mesh():
    net = Net()
    mesh = init_device_mesh("cpu", (1, 1, N), mesh_dim_names=("a", "b", "c"))
    raises_everywhere(ValueError, lambda: fully_shard(net, mesh=mesh), "fully_shard expects a 1D or 2D DeviceMesh but got")
    assert_all_ranks(unchanged(net))


def test_non_contiguous_parameter():
    """A channels_last Conv2d weight: torch's NotImplementedError."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3)).to(memory_format=torch.channels_last)
    raises_everywhere(NotImplementedError, lambda: fully_shard(net),
                      "FSDP does not support non-contiguous parameters yet")
    assert_all_ranks(unchanged(net))


def test_scalar_parameter():
    net = Net()
    net.scalar_p = nn.Parameter(torch.tensor(2.0))
    raises_everywhere(ValueError, lambda: fully_shard(net),
                      "fully_shard doesn't support scalar parameters. Change scalar_p to a 1D tensor with numel equal "
                      "to 1.")
    assert_all_ranks(unchanged(net))


def test_shard_placement_fn_dim_out_of_range():
    net = Net()
    raises_everywhere(AssertionError, lambda: fully_shard(net, shard_placement_fn=lambda p: Shard(1)),
                      "Shard dim 1 is invalid for 1D tensor")
    assert_all_ranks(unchanged(net))


def test_parameter_shared_across_groups_raises_at_first_forward():
    net = Net()
    net.extra = nn.Linear(4, 8)
    net.extra.weight = net.inp.weight
    fully_shard(net.inp)
    fully_shard(net)  # accepted, as torch does
    raises_everywhere(ValueError, lambda: net(torch.ones(3, 4)),
                      "Parameter 'extra.weight' is shared with a parameter already managed by another FSDP group")


def test_no_collectives_on_a_one_rank_mesh():
    """A training step of FSDP (and HSDP) on a one-rank mesh: no collective, as torch; the
    same gradients as the plain module."""
    for shape, names in (((1,), None), ((1, 1), ("replicate", "shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names, comm=MPI.COMM_SELF)
        torch.manual_seed(0)
        ref = Net()
        net = Net()
        net.load_state_dict(ref.state_dict())
        fully_shard(net.inp, mesh=mesh)
        fully_shard(net, mesh=mesh)
        x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
        with CommDebugMode() as comm:
            F.cross_entropy(net(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        grads_equal = all(torch.allclose(p.grad.full_tensor(), q.grad) for p, q in zip(net.parameters(), ref.parameters()))
        assert_all_ranks(comm.get_total_counts() == 0 and grads_equal,
                         f"{shape}: {dict(comm.get_comm_counts())}, gradients equal: {grads_equal}")
