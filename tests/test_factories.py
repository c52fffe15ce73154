"""DTensor factories: local blocks follow the torch.chunk layout, values and
dtypes are right, nothing is communicated, rand/randn are layout-invariant."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_all_ranks, assert_close
from mpidtensor import Partial, Replicate, Shard, distribute_tensor
from mpidtensor.tensor import factories
from mpidtensor.tensor.layout import local_shape_and_offset
from mpidtensor.comm import recorders

PLACEMENTS_1D = [[Shard(0)], [Shard(1)], [Replicate()]]
PLACEMENTS_2D = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Replicate()]]


def _expected_local_shape(shape, placements, mesh):
    return tuple(local_shape_and_offset(shape, placements, mesh.shape, mesh._coord)[0])


def _check(t, shape, placements, mesh, expected: torch.Tensor, dtype=torch.float32, requires_grad=False):
    local = t.to_local()
    ok = (
        tuple(t.shape) == tuple(shape)
        and t.placements == tuple(placements)
        and tuple(local.shape) == _expected_local_shape(shape, placements, mesh)
        and t.dtype == dtype
        and local.dtype == dtype
        and t.requires_grad == requires_grad
    )
    assert_all_ranks(ok, f"{tuple(t.shape)} {t.placements} local {tuple(local.shape)} {t.dtype} {t.requires_grad}")
    assert_close(t.full_tensor().detach(), expected)


@pytest.mark.parametrize("placements", PLACEMENTS_1D)
def test_constant_factories_1d(mesh1d, placements):
    shape = (7, 9)
    calls = []

    def record(kind, nbytes):
        calls.append(kind)

    recorders.push(record)
    try:
        z = factories.zeros(7, 9, device_mesh=mesh1d, placements=placements)
        o = factories.ones((7, 9), dtype=torch.float64, device_mesh=mesh1d, placements=placements)
        f = factories.full(shape, 3, device_mesh=mesh1d, placements=placements)
        e = factories.empty(torch.Size(shape), requires_grad=True, device_mesh=mesh1d, placements=placements)
    finally:
        recorders.pop(record)
    assert_all_ranks(calls == [], f"factories communicated: {calls}")
    _check(z, shape, placements, mesh1d, torch.zeros(shape))
    _check(o, shape, placements, mesh1d, torch.ones(shape, dtype=torch.float64), torch.float64)
    _check(f, shape, placements, mesh1d, torch.full(shape, 3), torch.int64)
    local = e.to_local()
    assert_all_ranks(
        e.requires_grad and e.is_leaf and tuple(local.shape) == _expected_local_shape(shape, placements, mesh1d),
        "empty: requires_grad or local shape",
    )


@pytest.mark.parametrize("placements", PLACEMENTS_2D)
def test_constant_factories_2d(mesh2d, placements):
    shape = (5, 11)
    _check(factories.full(shape, 2.5, device_mesh=mesh2d, placements=placements), shape, placements, mesh2d,
           torch.full(shape, 2.5))
    _check(factories.ones(*shape, requires_grad=True, device_mesh=mesh2d, placements=placements), shape, placements,
           mesh2d, torch.ones(shape), requires_grad=True)


def test_partial_placement(mesh1d):
    t = factories.full((3, 4), 2.0, device_mesh=mesh1d, placements=[Partial()])
    _check(t, (3, 4), [Partial()], mesh1d, torch.full((3, 4), 2.0))


def test_default_placements_and_gradient(mesh1d):
    t = factories.ones(4, 3, requires_grad=True, device_mesh=mesh1d)
    assert_all_ranks(t.placements == (Replicate(),), f"{t.placements}")
    sharded = factories.zeros(5, 3, requires_grad=True, device_mesh=mesh1d, placements=[Shard(0)])
    (sharded.full_tensor() * torch.arange(15.0).view(5, 3)).sum().backward()
    assert_close(sharded.grad.full_tensor(), torch.arange(15.0).view(5, 3))


@pytest.mark.parametrize("fn", [factories.rand, factories.randn])
def test_random_factories_layout_invariant(mesh1d, fn):
    torch.manual_seed(11)
    expected = fn(7, 9, device_mesh=mesh1d).full_tensor()
    for placements in PLACEMENTS_1D + [[Partial()]]:
        torch.manual_seed(11)
        t = fn(7, 9, device_mesh=mesh1d, placements=placements)
        _check(t, (7, 9), placements, mesh1d, expected)
    torch.manual_seed(11)
    like = distribute_tensor(torch.zeros(7, 9), mesh1d, [Shard(1)])
    like = like.uniform_() if fn is factories.rand else like.normal_()
    assert_close(like.full_tensor(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("placements", PLACEMENTS_2D)
def test_random_factories_2d(mesh1d, mesh2d, placements):
    torch.manual_seed(5)
    expected = factories.randn(5, 11, dtype=torch.float64, device_mesh=mesh1d).full_tensor()
    torch.manual_seed(5)
    t = factories.randn(5, 11, dtype=torch.float64, device_mesh=mesh2d, placements=placements)
    _check(t, (5, 11), placements, mesh2d, expected, torch.float64)


def test_statistics(mesh1d):
    torch.manual_seed(0)
    u = factories.rand(400, 250, device_mesh=mesh1d, placements=[Shard(0)]).full_tensor()
    n = factories.randn(400, 250, device_mesh=mesh1d, placements=[Shard(1)]).full_tensor()
    ok = abs(u.mean().item() - 0.5) < 0.005 and abs(n.mean().item()) < 0.015 and abs(n.std().item() - 1) < 0.01
    assert_all_ranks(ok and bool((u >= 0).all() and (u < 1).all()), f"{u.mean()} {n.mean()} {n.std()}")


def test_errors(mesh1d):
    with pytest.raises(ValueError, match="device_mesh"):
        factories.zeros(3, 4)
    with pytest.raises(ValueError, match="Shard"):
        factories.ones(3, device_mesh=mesh1d, placements=[Shard(1)])
    with pytest.raises(ValueError, match="floating"):
        factories.rand(3, dtype=torch.int64, device_mesh=mesh1d)
    with pytest.raises(NotImplementedError):
        factories.zeros(3, layout=torch.sparse_coo, device_mesh=mesh1d)
