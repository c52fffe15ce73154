"""The dispatcher's and the optimizers' fast paths against the general path.

Each case runs with ``settings.fast_paths`` off (plain dispatch plans, one call per list
position, the per-parameter DTensor optimizer step) and on, and asserts bit-equal
results, that the fast paths it exercises ran (``hits > 0``) when on and that no fast
path ran when off. Covered: ``dispatch.local_plan``, ``dispatch.local_view``, ``dispatch.per_mesh``,
``dispatch.detach`` (mpidtensor.dispatch), ``optim.foreach``, ``optim.local_step``,
``optim.flat_runs`` (mpidtensor.fast): every fast path of these two rooms.
"""
from __future__ import annotations

from math import prod

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.fast import registry
from mpidtensor.runtime.settings import settings
from test_optim_local import _apart_model, _even_model

WORLD = MPI.COMM_WORLD

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
}
MODES = {"default": {}, "loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
# odd sizes: uneven shards at 2-4 ranks (an empty one at 4 for the 3-row tensor)
PARAMS = {
    "1d": [((7, 5), [Shard(0)]), ((5, 3), [Shard(1)]), ((9,), [Replicate()]), ((3, 4), [Shard(0)])],
    "2d": [((7, 5), [Shard(0), Shard(1)]), ((5, 3), [Replicate(), Shard(0)]), ((9,), [Replicate(), Replicate()]),
           ((6, 5), [Shard(1), Replicate()])],
}


def _run(fn, fast: bool, **switches):
    """``fn()`` with fast paths ``fast`` (and other settings): (its result, hits per path)."""
    before = {p.name: p.hits for p in registry.paths()}
    with settings.override(fast_paths=fast, **switches):
        out = fn()
    return out, {p.name: p.hits - before.get(p.name, 0) for p in registry.paths()}


def _as_locals(values) -> list:
    """Tensors to compare bit for bit: a DTensor's placements, shape and local tensor."""
    out = []
    for v in values:
        if isinstance(v, DTensor):
            out.append((v.placements, v.shape, v._local_tensor))
        elif isinstance(v, torch.Tensor):
            out.append((None, v.shape, v))
        elif isinstance(v, (list, tuple)):
            out.extend(_as_locals(v))
        else:
            out.append((None, None, v))
    return out


def _differences(general, fast) -> list[str]:
    """Where ``fast`` is not bit-equal to ``general`` (empty: equal)."""
    a, b = _as_locals(general), _as_locals(fast)
    if len(a) != len(b):
        return [f"{len(a)} results on the general path, {len(b)} on the fast one"]
    bad = []
    for i, ((pa, sa, ta), (pb, sb, tb)) in enumerate(zip(a, b)):
        if isinstance(ta, torch.Tensor):
            same = (pa == pb and sa == sb and isinstance(tb, torch.Tensor) and ta.dtype == tb.dtype
                    and torch.equal(ta, tb))
        else:
            same = ta == tb
        if not same:
            bad.append(f"result {i}: {pa} {sa} vs {pb} {sb}")
    return bad


def _check(fn, expected: set[str], **switches) -> None:
    """``fn`` bit-equal with fast paths off and on; ``expected`` ran when on, nothing when off."""
    general, off = _run(fn, fast=False, **switches)
    fast, on = _run(fn, fast=True, **switches)
    problems = _differences(general, fast)
    ran_off = sorted(name for name, hits in off.items() if hits)
    missed = sorted(name for name in expected if not on.get(name))
    if ran_off:
        problems.append(f"fast paths ran with fast_paths off: {ran_off}")
    if missed:
        problems.append(f"fast paths that did not run: {missed} (hits {on})")
    assert_all_ranks(not problems, "; ".join(problems))


def _steps(cls, kwargs, mesh, specs, steps: int = 3) -> list:
    """``steps`` steps of a fresh optimizer over fresh DTensor parameters, seeded gradients;
    the parameters and every state tensor after them."""
    params = [nn.Parameter(distribute_tensor(global_tensor(s, seed=i), mesh, p)) for i, (s, p) in enumerate(specs)]
    opt = cls(params, **kwargs)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = distribute_tensor(global_tensor(p.shape, seed=100 * step + i), mesh, p.placements)
        opt.step()
    return [p.detach() for p in params] + [v for p in params for v in opt.state[p].values()]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_optimizer_fast_paths_equal_the_general_path(request, layout, name, mode):
    """The DTensor step on plain plans against the same step on LocalPlans (local step
    off) and on local tensors (local step on); foreach left unset takes the foreach path."""
    mesh = request.getfixturevalue("mesh1d" if layout == "1d" else "mesh2d")
    cls, kwargs = OPTIMIZERS[name]
    kwargs = {**kwargs, **MODES[mode]}
    foreach = {"optim.foreach"} if mode == "default" else set()
    run = lambda: _steps(cls, kwargs, mesh, PARAMS[layout])  # noqa: E731
    _check(run, foreach | {"dispatch.local_plan"}, local_optim_step=False)
    _check(run, foreach | {"optim.local_step"}, local_optim_step=True)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_fsdp_flat_runs_equal_the_general_path(mesh1d, name):
    """FSDP's back-to-back shards (two fully_shard-ed Linear(12, 12)) step as flat runs
    from the second step on: bit-equal to the per-parameter DTensor step (forward,
    backward and the gradients' detach too)."""
    cls, kwargs = OPTIMIZERS[name]

    def run():
        model = _even_model(mesh1d)
        opt = cls(model.parameters(), **kwargs)
        for step in range(3):
            model(global_tensor((5, 12), seed=40 + step)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()] + [
            v for p in model.parameters() for v in opt.state[p].values()]

    _check(run, {"optim.local_step", "optim.flat_runs", "optim.foreach"})


def test_fsdp_flat_run_apart_in_the_group_equals_the_general_path(mesh1d):
    """The root group's shards, listed apart in the optimizer's group (another layer's
    between them), step as one flat run: bit-equal to the per-parameter DTensor step."""
    cls, kwargs = OPTIMIZERS["adamw"]

    def run():
        model = _apart_model(mesh1d)
        opt = cls(model.parameters(), **kwargs)
        for step in range(3):
            model(global_tensor((5, 48), seed=60 + step)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()] + [
            v for p in model.parameters() for v in opt.state[p].values()]

    _check(run, {"optim.local_step", "optim.flat_runs", "optim.foreach"})


@pytest.mark.parametrize("change", ["step_in_place", "state_replaced", "param_replaced", "grad_dropped"])
def test_fsdp_flat_runs_after_the_user_changes_the_state(mesh1d, change):
    """Between flat steps the user changes what the cached layouts were checked against:
    one parameter's step count set in place (the run's counts differ: it steps one
    parameter at a time), one state tensor replaced by a new DTensor (the state snapshot
    differs: the layouts are checked again, the states rehomed), one local shard replaced
    (the parameter check fails) or, for one step, one gradient dropped (the run's other
    members step one at a time). Each step equals the per-parameter DTensor step bit for bit."""
    cls, kwargs = OPTIMIZERS["adamw"]

    def run():
        model = _even_model(mesh1d)
        params = list(model.parameters())
        opt = cls(params, **kwargs)
        for step in range(5):
            model(global_tensor((5, 12), seed=40 + step)).square().sum().backward()
            if change == "grad_dropped" and step == 3:
                params[1].grad = None
            opt.step()
            opt.zero_grad()
            if step != 2:
                continue
            entry = opt.state[params[1]]
            if change == "step_in_place":
                entry["step"].fill_(7.0)
            elif change == "state_replaced":
                entry["exp_avg"] = entry["exp_avg"] * 0.5
            elif change == "param_replaced":
                with torch.no_grad():
                    params[1]._local_tensor = params[1]._local_tensor.clone()
        return [p.detach() for p in params] + [v for p in params for v in opt.state[p].values()]

    _check(run, {"optim.local_step", "optim.flat_runs", "optim.foreach"})


def test_elementwise_and_inplace_chains(mesh1d):
    """Pointwise chains, in-place ops (also through a view) and a plain-tensor operand."""
    def run():
        x = distribute_tensor(global_tensor((7, 6), seed=1), mesh1d, [Shard(0)])
        z = distribute_tensor(global_tensor((7, 6), seed=2), mesh1d, [Shard(0)])
        r = distribute_tensor(global_tensor((7, 6), seed=3), mesh1d, [Replicate()])
        y = (x * 2.0 + z).relu().sqrt()
        y.add_(z).mul_(0.5)
        w = torch.addcmul(y, x, z, value=0.3)
        y.t().mul_(-1.0)  # in place through a view: the write reaches y
        plain = global_tensor((6,), seed=4)
        return [y, w, x - r, torch.where(x > 0, x, z), x + plain, torch._foreach_mul([x, z], 3.0)]

    _check(run, {"dispatch.local_plan"})


def test_views_and_detach(mesh1d):
    """View ops that move nothing, detach, and gradients reaching leaves (AccumulateGrad
    detaches them)."""
    def run():
        x = nn.Parameter(distribute_tensor(global_tensor((7, 6), seed=1), mesh1d, [Shard(0)]))
        z = distribute_tensor(global_tensor((7, 6), seed=2), mesh1d, [Shard(0)])
        views = [x.t(), x.transpose(0, 1).unsqueeze(0), x.detach(), *torch.split(z, 4, dim=1), z.unbind(1)]
        ((x * z).tanh() * 2.0).sum().backward()
        return [*views, x.grad]

    _check(run, {"dispatch.local_plan", "dispatch.detach"})


def test_tp_mlp_in_dtensor_ops(mesh1d):
    """The general path's TP MLP (``x @ w1 + b1``, GELU, ``@ w2``, redistribute, ``+ b2``,
    backward: mm, add, gelu, gelu_backward, sum, view, t, detach) with an uneven hidden dim:
    outputs and gradients bit-equal with the fast paths off, global and local strides and
    specs alike."""
    def run():
        leaf = global_tensor((5, 6), seed=1).requires_grad_()
        x = DTensor.from_local(leaf, mesh1d, [Replicate()])
        w1 = nn.Parameter(distribute_tensor(global_tensor((6, 11), seed=2), mesh1d, [Shard(1)]))
        b1 = nn.Parameter(distribute_tensor(global_tensor((11,), seed=3), mesh1d, [Shard(0)]))
        w2 = nn.Parameter(distribute_tensor(global_tensor((11, 6), seed=4), mesh1d, [Shard(0)]))
        b2 = nn.Parameter(distribute_tensor(global_tensor((6,), seed=5), mesh1d, [Replicate()]))
        h = torch.nn.functional.gelu(torch.matmul(x, w1) + b1)
        y = torch.matmul(h, w2).redistribute(mesh1d, [Replicate()]) + b2
        (y.to_local() ** 2).sum().backward()
        out = [h, y, w1.grad, b1.grad, w2.grad, b2.grad]
        return out + [(t.stride(), t._local_tensor.stride(), t._spec) for t in out] + [leaf.grad, leaf.grad.stride()]

    _check(run, {"dispatch.local_plan", "dispatch.local_view", "dispatch.detach"})


def test_foreach_ops_over_two_meshes():
    """``_foreach_*`` ops over DTensors on two meshes (and a plain tensor): one call per
    mesh (fast) or per position (general), results in order."""
    mesh_a = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("a",))
    mesh_b = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("b",))

    def run():
        layouts = [(mesh_a, [Shard(0)]), (mesh_b, [Replicate()]), (mesh_a, [Replicate()]), (mesh_b, [Shard(1)])]
        ds = [distribute_tensor(global_tensor((5, 6), seed=s), m, p) for s, (m, p) in enumerate(layouts)]
        scaled = torch._foreach_mul(ds, [2.0, 3.0, 4.0, 5.0])
        mixed = torch._foreach_add([ds[0], global_tensor((5, 6), seed=9), ds[1]], 1.0)
        norms = torch._foreach_norm(ds)
        torch._foreach_add_(ds, ds, alpha=0.5)
        return [*scaled, *mixed, *norms, *ds]

    _check(run, {"dispatch.per_mesh"})


def _layouts(values) -> list[tuple]:
    """Each DTensor's spec (placements, global shape and strides), local strides and local
    tensor: what a local view must reproduce exactly."""
    return [(v.placements, v.shape, v.stride(), v._local_tensor.stride(), v._local_tensor) for v in values]


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (4,), (2, 2)])
def test_local_views_against_general(mesh_shape):
    """View ops whose rule computes the local view (view/reshape's local size, squeeze,
    expand, slice, select) on DTensors that stay where they are, uneven shards included:
    ``dispatch.local_view`` gives the general Plan's local result, strides and spec."""
    if WORLD.size != prod(mesh_shape):
        pytest.skip(f"needs {prod(mesh_shape)} ranks")
    mesh = init_device_mesh("cpu", mesh_shape)
    two = len(mesh_shape) == 2

    def run():
        a = distribute_tensor(global_tensor((7, 6, 4), seed=1), mesh, [Shard(0), Shard(2)] if two else [Shard(0)])
        b = distribute_tensor(global_tensor((5, 1, 6), seed=2), mesh, [Replicate(), Shard(2)] if two else [Shard(2)])
        c = distribute_tensor(global_tensor((7, 6), seed=3), mesh, [Shard(0), Replicate()] if two else [Shard(0)])
        return [a.view(7, 24) if not two else a.view(7, 6, 2, 2), a.reshape(7, 6, 4, 1), b.squeeze(1),
                b.expand(3, 5, 4, 6), c[:, 1:5], c[:, 2], c.t().view(6, 7), c.unsqueeze(1).view(7, 6)]

    general, off = _run(run, fast=False)
    fast, on = _run(run, fast=True)
    problems = [f"result {i}: {g[:4]} vs {f[:4]}" for i, (g, f) in enumerate(zip(_layouts(general), _layouts(fast)))
                if g[:4] != f[:4] or not torch.equal(g[4], f[4])]
    if off.get("dispatch.local_view"):
        problems.append("dispatch.local_view ran with fast_paths off")
    if not on.get("dispatch.local_view"):
        problems.append(f"dispatch.local_view did not run (hits {on})")
    assert_all_ranks(not problems, "; ".join(problems))
