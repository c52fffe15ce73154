"""torch.optim on sharded parameters: no communication, the same numbers as on full tensors;
the multi-tensor (foreach) path by default for CPU DTensor parameters (mpidtensor.fast.foreach)."""
import importlib

import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.runtime.settings import settings

ADAM = importlib.import_module("torch.optim.adam")  # torch.optim deletes its submodules' names

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
def test_optimizer_steps(mesh1d, cls, kwargs, foreach, monkeypatch):
    monkeypatch.setattr(settings, "strict", True)
    shapes_placements = [((7, 5), [Shard(0)]), ((5, 3), [Shard(1)]), ((9,), [Replicate()])]
    ref = [torch.nn.Parameter(global_tensor(s, seed=i)) for i, (s, _) in enumerate(shapes_placements)]
    dist = [torch.nn.Parameter(distribute_tensor(global_tensor(s, seed=i), mesh1d, p))
            for i, (s, p) in enumerate(shapes_placements)]
    ref_opt = cls(ref, foreach=foreach, **kwargs)
    dist_opt = cls(dist, foreach=foreach, **kwargs)
    for step in range(3):
        for i, (r, d) in enumerate(zip(ref, dist)):
            g = global_tensor(r.shape, seed=100 * step + i)
            r.grad = g.clone()
            d.grad = distribute_tensor(g, mesh1d, d.placements)
        ref_opt.step()
        with CommDebugMode() as comm:
            dist_opt.step()
        assert_all_ranks(comm.get_total_counts() == 0, f"optimizer step communicated: {comm.get_comm_counts()}")
    for r, d in zip(ref, dist):
        assert_close(d.full_tensor(), r.detach(), atol=1e-6, rtol=1e-5)


def test_dtensor_parameters_get_the_foreach_kernels_plain_ones_get(mesh1d):
    """As with torch's DTensor: the optimizers' and clip_grad_norm_'s choice of the
    multi-tensor kernels treats a DTensor like a plain tensor on its device."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support

    p = distribute_tensor(torch.randn(8, 3), mesh1d, [Shard(0)])
    plain = torch.randn(8, 3)
    assert_all_ranks(_default_to_fused_or_foreach([p], False) == _default_to_fused_or_foreach([plain], False)
                     and _has_foreach_support([p], p.device) == _has_foreach_support([plain], plain.device),
                     "DTensor is not a foreach-supported type")


@pytest.fixture
def adam_paths(monkeypatch):
    """Which of Adam's implementations each step ran: "foreach" or "loop"."""
    taken = []
    for name, label in (("_multi_tensor_adam", "foreach"), ("_single_tensor_adam", "loop")):
        original = getattr(ADAM, name)

        def recorded(*args, _original=original, _label=label, **kwargs):
            taken.append(_label)
            return _original(*args, **kwargs)

        monkeypatch.setattr(ADAM, name, recorded)
    return taken


def sharded_params(mesh, count=3):
    """``count`` DTensor parameters (13 x 5, uneven at 2-4 ranks), gradients set."""
    params = []
    for i in range(count):
        p = torch.nn.Parameter(distribute_tensor(global_tensor((13, 5), seed=i), mesh, [Shard(0)]))
        p.grad = distribute_tensor(global_tensor((13, 5), seed=50 + i), mesh, [Shard(0)])
        params.append(p)
    return params


def test_cpu_dtensor_params_take_the_foreach_path_by_default(mesh1d, adam_paths):
    """Left unset, ``foreach`` is True for the step (one dispatch per op for all parameters)
    and unset again after it; explicit choices, a tensor lr and plain-tensor groups are
    left to torch; the values equal the per-parameter loop's exactly."""
    default = torch.optim.AdamW(sharded_params(mesh1d), lr=0.01)
    loop = torch.optim.AdamW(sharded_params(mesh1d), lr=0.01, foreach=False)
    tensor_lr = torch.optim.AdamW(sharded_params(mesh1d), lr=torch.tensor(0.01))
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.01)
    plain.param_groups[0]["params"][0].grad = torch.ones(3)
    seen = {}
    for name, opt in (("default", default), ("loop", loop), ("tensor lr", tensor_lr), ("plain", plain)):
        adam_paths.clear()
        opt.step()
        seen[name] = (list(adam_paths), opt.param_groups[0]["foreach"])
    expected = {"default": (["foreach"], None), "loop": (["loop"], False), "tensor lr": (["loop"], None),
                "plain": (["loop"], None)}
    same = all(torch.equal(a.to_local(), b.to_local())
               for a, b in zip(default.param_groups[0]["params"], loop.param_groups[0]["params"]))
    assert_all_ranks(seen == expected and same, f"paths and foreach after the step: {seen}; equal values: {same}")


def test_a_step_that_raises_leaves_the_group_unset_after_the_next(mesh1d, monkeypatch):
    opt = torch.optim.AdamW(sharded_params(mesh1d), lr=0.01)

    def broken(*args, **kwargs):
        raise RuntimeError("broken step")

    with monkeypatch.context() as patch:
        patch.setattr(ADAM, "_multi_tensor_adam", broken)
        with pytest.raises(RuntimeError, match="broken step"):
            opt.step()
    opt.step()
    assert_all_ranks(opt.param_groups[0]["foreach"] is None, f"foreach left {opt.param_groups[0]['foreach']}")
