"""Optimizer steps on DTensor parameters through dispatch's paths: the single-tensor loop
(one pointwise op per call, the no-move ``_LocalPlan``), ``foreach=True`` (``_foreach_*``
ops with per-parameter scalar lists) and ``fused=True`` (``_fused_adamw_``...), and the
same steps on the local tensors (``mpidtensor.fast.optim_step``, on by default). Each is
checked against one process after 3 steps, bit for bit against the same optimizer on
the local tensors, for no communication, and for a plan cache that stops growing once
the optimizer state exists (scalars that change every step must not re-plan)."""
import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.dispatch import key
from mpidtensor.runtime.settings import settings
from mpidtensor.debug import CommDebugMode

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
}
MODES = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
# odd sizes: uneven shards at 3 ranks (and empty ones at 4 for the 3-row tensor)
PARAMS = {
    "1d": [((7, 5), [Shard(0)]), ((5, 3), [Shard(1)]), ((9,), [Replicate()]), ((3, 4), [Shard(0)])],
    "2d": [((7, 5), [Shard(0), Shard(1)]), ((5, 3), [Replicate(), Shard(0)]), ((9,), [Replicate(), Replicate()]),
           ((6, 5), [Shard(1), Replicate()])],
}


def _train(params, opt, mesh, steps: int) -> tuple[int, list[int]]:
    """``steps`` steps on seeded gradients; (collectives in the steps, plan cache size after each)."""
    collectives, plans = 0, []
    for step in range(steps):
        for i, p in enumerate(params):
            g = global_tensor(p.shape, seed=100 * step + i)
            p.grad = distribute_tensor(g, mesh, p.placements) if mesh is not None else g
        with CommDebugMode() as comm:
            opt.step()
        collectives += comm.get_total_counts()
        plans.append(len(key._PLANS))
    return collectives, plans


@pytest.mark.parametrize("path", ["dispatch", "local"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_optimizer_on_dtensors(request, monkeypatch, layout, name, mode, path):
    monkeypatch.setattr(settings, "local_optim_step", path == "local")
    mesh = request.getfixturevalue("mesh1d" if layout == "1d" else "mesh2d")
    cls, kwargs = OPTIMIZERS[name]
    kwargs = {**kwargs, **MODES[mode]}
    specs = PARAMS[layout]
    ref = [torch.nn.Parameter(global_tensor(s, seed=i)) for i, (s, _) in enumerate(specs)]
    dist = [torch.nn.Parameter(distribute_tensor(global_tensor(s, seed=i), mesh, p)) for i, (s, p) in enumerate(specs)]
    local = [torch.nn.Parameter(d._local_tensor.detach().clone()) for d in dist]
    ref_opt, dist_opt = cls(ref, **kwargs), cls(dist, **kwargs)
    _train(ref, ref_opt, None, 3)
    collectives, plans = _train(dist, dist_opt, mesh, 3)
    assert_all_ranks(collectives == 0, f"optimizer steps ran {collectives} collectives")
    # step 1 differs (state is created: SGD clones its momentum buffer); steps 2 and 3 run the same ops
    assert_all_ranks(plans[1] == plans[2], f"dispatch re-planned on step 3: cache sizes {plans}")
    for r, d in zip(ref, dist):
        assert_close(d.full_tensor(), r.detach(), atol=1e-6, rtol=1e-5)
    # bit for bit: the same optimizer on this rank's local tensors, fed the local gradients
    local_opt = cls(local, **kwargs)
    for step in range(3):
        for i, (p, d) in enumerate(zip(local, dist)):
            p.grad = distribute_tensor(global_tensor(d.shape, seed=100 * step + i), mesh, d.placements)._local_tensor
        local_opt.step()
    assert_all_ranks(all(torch.equal(d._local_tensor, p.detach()) for d, p in zip(dist, local)),
                     "DTensor optimizer step differs from the same step on local tensors")


def test_pointwise_fast_path_results(mesh1d):
    """The no-move plan returns self for in-place ops, fresh DTensors with the global
    metadata for out-of-place ones and lists for ``_foreach_`` ones, all with the local
    values of the plain op."""
    x = distribute_tensor(global_tensor((7, 5), seed=1), mesh1d, [Shard(0)])
    y = distribute_tensor(global_tensor((7, 5), seed=2), mesh1d, [Shard(0)])
    lx, ly = x._local_tensor.clone(), y._local_tensor.clone()
    for _ in range(2):  # the second round runs on cache hits
        same = x.mul_(0.5) is x and x.addcdiv_(y, y.abs() + 1, value=-0.1) is x
        lx.mul_(0.5).addcdiv_(ly, ly.abs() + 1, value=-0.1)
        root = (x.abs() + 1).sqrt()
        roots = torch._foreach_sqrt([x.abs(), y.abs()])
        assert_all_ranks(same, "an in-place op did not return its self argument")
        assert_all_ranks(torch.equal(x._local_tensor, lx), "in-place results differ from the local op's")
        assert_all_ranks(root.shape == x.shape and root.placements == x.placements
                         and torch.equal(root._local_tensor, (lx.abs() + 1).sqrt()), "out-of-place result differs")
        assert_all_ranks(len(roots) == 2 and torch.equal(roots[1]._local_tensor, ly.abs().sqrt()),
                         "_foreach_sqrt result differs")
