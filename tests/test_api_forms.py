"""The API forms of DTensor introductions: ``DTensor(local, device_mesh=..., placements=...)``,
``Placement("shard", dim=d)``, ``tensor.to_dtensor(...)`` and the ``DTensor.ones(...)``
class-method factories, each checked against the canonical form and a global reference,
on 1-D meshes (1-4 ranks, uneven shards) and a 2x2 mesh."""
import pytest
import torch
from mpi4py import MPI

import mpidtensor as md
from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD
PLACEMENTS_1D = [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]]


def local_of(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as ``placements``."""
    return distribute_tensor(full, mesh, placements).to_local().clone()


# --- DTensor(local_tensor, device_mesh=..., placements=...) ------------------------------------


@pytest.mark.parametrize("placements", PLACEMENTS_1D, ids=str)
def test_constructor_is_from_local(mesh1d, placements):
    full = global_tensor((7, 5))  # uneven along both dims at 2-4 ranks
    local = local_of(full, mesh1d, placements)
    by_keyword = DTensor(local, device_mesh=mesh1d, placements=placements)
    by_position = DTensor(local, mesh1d, placements)
    canonical = DTensor.from_local(local, mesh1d, placements)
    for x in (by_keyword, by_position):
        assert_all_ranks(type(x) is DTensor and x._spec is canonical._spec, f"spec {x._spec} != {canonical._spec}")
        assert_close(x.full_tensor(), full)


def test_constructor_keywords_and_gradient(mesh1d):
    full = global_tensor((6, 4))
    local = local_of(full, mesh1d, [Shard(0)]).requires_grad_()
    x = DTensor(local, device_mesh=mesh1d, placements=[Shard(0)], shape=(6, 4), stride=(4, 1), run_check=True)
    (x.full_tensor() * 3).sum().backward()
    assert_close(local.grad, torch.full_like(local, 3.0))
    leaf = DTensor(local.detach(), device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    assert_all_ranks(leaf.requires_grad and leaf.is_leaf, "requires_grad=True did not give a leaf requiring grad")


def test_constructor_on_2d_mesh(mesh2d):
    full = global_tensor((5, 6))
    placements = [Shard(0), Shard(1)]
    x = DTensor(local_of(full, mesh2d, placements), device_mesh=mesh2d, placements=placements)
    assert_close(x.full_tensor(), full)
    y = DTensor(torch.ones(2, 3), device_mesh=mesh2d, placements=[Replicate(), Partial()])
    assert_close(y.full_tensor(), torch.full((2, 3), 2.0))


def test_constructor_bad_input(mesh1d):
    local = torch.zeros(2, 3)
    raises_everywhere(TypeError, lambda: DTensor(local, mesh1d, [Replicate()], device_mesh=mesh1d), "both")
    raises_everywhere(ValueError, lambda: DTensor(local, placements=[Replicate()]), "device_mesh")
    raises_everywhere(ValueError, lambda: DTensor(local, device_mesh=mesh1d, placements=[Shard(2)]), "out of range")


# --- Placement("shard", dim=...) ---------------------------------------------------------------


def test_placement_by_name():
    cases = [
        (Placement("shard", dim=1), Shard(1)),
        (Placement("shard", 0), Shard(0)),
        (Placement("shard"), Shard(0)),
        (Placement("replicate"), Replicate()),
        (Placement("partial"), Partial()),
        (Placement("partial", reduce_op="max"), Partial("max")),
        (Placement("Replicate"), Replicate()),
    ]
    for got, want in cases:
        assert type(got) is type(want) and got == want and hash(got) == hash(want), (got, want)
        assert isinstance(got, Placement)
    # the subclasses are untouched by the base's name form
    assert Shard(2).dim == 2 and Partial("avg").reduce_op == "avg" and Replicate() == Replicate()


def test_placement_by_name_bad_input():
    with pytest.raises(ValueError, match="one of"):
        Placement("sharded")
    with pytest.raises(ValueError, match="one of"):
        Placement(0)
    with pytest.raises(TypeError):
        Placement()
    with pytest.raises(TypeError, match="int"):
        Placement("shard", dim="0")
    with pytest.raises(ValueError, match="reduce_op"):
        Placement("partial", reduce_op="mean")


def test_placement_by_name_in_use(mesh1d):
    full = global_tensor((5, 3))
    x = distribute_tensor(full, mesh1d, [Placement("shard", dim=0)])
    assert_all_ranks(x.placements == (Shard(0),), f"placements {x.placements}")
    y = x.redistribute(mesh1d, [Placement("replicate")])
    assert_close(y.to_local(), full)


# --- tensor.to_dtensor(device_mesh=..., placements=...) ----------------------------------------


@pytest.mark.parametrize("placements", PLACEMENTS_1D, ids=str)
def test_to_dtensor(mesh1d, placements):
    full = global_tensor((5, 7))
    local = local_of(full, mesh1d, placements)
    x = local.to_dtensor(device_mesh=mesh1d, placements=placements)
    assert_all_ranks(x._spec is DTensor.from_local(local, mesh1d, placements)._spec, f"spec {x._spec}")
    assert_close(x.full_tensor(), full)
    assert_close(local.to_dtensor(mesh1d, placements).full_tensor(), full)


def test_to_dtensor_on_a_dtensor_is_refused(mesh1d):
    x = distribute_tensor(global_tensor((4, 2)), mesh1d, [Replicate()])
    raises_everywhere(TypeError, lambda: x.to_dtensor(device_mesh=mesh1d, placements=[Replicate()]), "already")


# --- DTensor.zeros/ones/empty/full/rand/randn --------------------------------------------------

FACTORY_CALLS = {
    "zeros": ((3, 5), {}),
    "ones": ((3, 5), {}),
    "empty": ((3, 5), {}),
    "full": (((3, 5), 2.5), {}),
    "rand": ((3, 5), {}),
    "randn": ((3, 5), {"dtype": torch.float64}),
}


@pytest.mark.parametrize("name", sorted(FACTORY_CALLS))
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]], ids=str)
def test_class_method_factories(mesh1d, name, placements):
    args, kwargs = FACTORY_CALLS[name]
    if name == "rand" or name == "randn":
        torch.manual_seed(5)
    x = getattr(DTensor, name)(*args, device_mesh=mesh1d, placements=placements, **kwargs)
    if name == "rand" or name == "randn":
        torch.manual_seed(5)
    y = getattr(md, name)(*args, device_mesh=mesh1d, placements=placements, **kwargs)
    assert_all_ranks(x._spec is y._spec, f"spec {x._spec} != {y._spec}")
    if name != "empty":
        assert_close(x.full_tensor(), y.full_tensor())
    assert_all_ranks(getattr(DTensor, name) is getattr(md, name), "not the module-level factory")


def test_class_method_factory_tuple_size_2d(mesh2d):
    x = DTensor.ones((2, 4), device_mesh=mesh2d, placements=[Shard(0), Shard(1)])
    assert_all_ranks(tuple(x.to_local().shape) == (1, 2), f"local shape {tuple(x.to_local().shape)}")
    assert_close(x.full_tensor(), torch.ones(2, 4))
