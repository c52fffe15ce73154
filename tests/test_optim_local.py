"""Elementwise torch.optim steps on the local tensors of DTensor parameters
(``mpidtensor.local_step``): bit for bit the DTensor path's values, the state kept as
DTensors of the parameters' specs, the DTensor path for what does not qualify, and the
optimizer whole again after a step that raised."""
import importlib

import pytest
import torch
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard, dispatch, distribute_tensor, local_step
from mpidtensor.fsdp import fully_shard

SGD = importlib.import_module("torch.optim.sgd")  # torch.optim deletes its submodules' names
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
}


def _model(seed: int = 0) -> nn.Module:
    """Odd sizes: uneven (and at 4 ranks empty) FSDP shards."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _fsdp_model(mesh) -> nn.Module:
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x = global_tensor((6, 7), seed=10 + step)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _count_dispatches(monkeypatch) -> list:
    calls = []
    original = dispatch.dispatch

    def counted(func, args, kwargs):
        calls.append(func)
        return original(func, args, kwargs)
    monkeypatch.setattr(dispatch, "dispatch", counted)
    monkeypatch.setattr(DTensor, "__torch_dispatch__",
                        classmethod(lambda cls, func, types, args=(), kwargs=None: counted(func, args, kwargs or {})))
    return calls


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fsdp_step_on_local_tensors_matches_dispatch_bit_for_bit(mesh1d, monkeypatch, name):
    """An FSDP model's steps without a DTensor op, equal to the DTensor path's and close
    to one process; the state is DTensors of the parameters' specs."""
    cls, kwargs = OPTIMIZERS[name]
    ref = _model()
    ref_opt = cls(ref.parameters(), **kwargs)
    _train(ref, ref_opt, 3)
    results = {}
    for path in ("dispatch", "local"):
        monkeypatch.setattr(local_step, "ENABLED", path == "local")
        model = _fsdp_model(mesh1d)
        opt = cls(model.parameters(), **kwargs)
        _train(model, opt, 2)
        for p in model.parameters():  # the last step's gradients, for the counted step
            p.grad = distribute_tensor(global_tensor(p.shape, seed=7), mesh1d, p.placements)
        with monkeypatch.context() as patch:
            calls = _count_dispatches(patch)
            opt.step()
            opt.zero_grad()
        results[path] = (model, opt, len(calls))
    ref_opt.param_groups[0]["params"][0].grad = None
    (dmodel, dopt, dcalls), (lmodel, lopt, lcalls) = results["dispatch"], results["local"]
    same = all(torch.equal(a._local_tensor, b._local_tensor) for a, b in zip(dmodel.parameters(), lmodel.parameters()))
    states = [lopt.state[p] for p in lmodel.parameters()]
    wrapped = all(type(v) is DTensor and v._spec is p._spec
                  for p, s in zip(lmodel.parameters(), states) for v in s.values() if v.dim())
    equal_state = all(torch.equal(a._local_tensor if type(a) is DTensor else a, b._local_tensor if type(b) is DTensor else b)
                      for p, q in zip(dmodel.parameters(), lmodel.parameters())
                      for a, b in zip(dopt.state[p].values(), lopt.state[q].values()))
    assert_all_ranks(same and equal_state, f"local step differs from the DTensor path: params {same}, state {equal_state}")
    assert_all_ranks(wrapped and all(states), "the state is not DTensors of the parameters' specs")
    assert_all_ranks(lcalls == 0 and dcalls > 0, f"DTensor ops in the step: local {lcalls}, dispatch {dcalls}")
    # and the state_dict round trip keeps stepping as the DTensor path does
    lopt.load_state_dict(lopt.state_dict())
    monkeypatch.setattr(local_step, "ENABLED", False)
    _train(dmodel, dopt, 1, start=5)
    monkeypatch.setattr(local_step, "ENABLED", True)
    _train(lmodel, lopt, 1, start=5)
    same = all(torch.equal(a._local_tensor, b._local_tensor) for a, b in zip(dmodel.parameters(), lmodel.parameters()))
    assert_all_ranks(same, "after load_state_dict the local step differs from the DTensor path")


def test_sharded_model_matches_one_process(mesh1d):
    """2 FSDP steps of AdamW (default path: local) against one process."""
    cls, kwargs = OPTIMIZERS["adamw"]
    ref, model = _model(), _fsdp_model(mesh1d)
    ref_opt, opt = cls(ref.parameters(), **kwargs), cls(model.parameters(), **kwargs)
    _train(ref, ref_opt, 2)
    _train(model, opt, 2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.full_tensor(), q.detach(), atol=1e-6, rtol=1e-5)


def test_a_gradient_of_another_spec_takes_the_dtensor_path(mesh1d, monkeypatch):
    """A Replicate gradient on a Shard parameter: the group is not swapped, and the step
    still matches the same step on full tensors."""
    full, grad = global_tensor((7, 5), seed=1), global_tensor((7, 5), seed=2)
    p = nn.Parameter(distribute_tensor(full, mesh1d, [Shard(0)]))
    p.grad = distribute_tensor(grad, mesh1d, [Replicate()])
    ref = nn.Parameter(full.clone())
    ref.grad = grad.clone()
    opt, ref_opt = torch.optim.AdamW([p], lr=0.01), torch.optim.AdamW([ref], lr=0.01)
    with monkeypatch.context() as patch:
        calls = _count_dispatches(patch)
        opt.step()
    ref_opt.step()
    assert_all_ranks(len(calls) > 0, "a group with a Replicate gradient was swapped")
    assert_close(p.full_tensor(), ref.detach(), atol=1e-6, rtol=1e-5)


def test_a_step_that_raises_is_undone_by_state_dict_and_zero_grad_reaches_the_params(mesh1d, monkeypatch):
    model = _fsdp_model(mesh1d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1)
    params = list(model.parameters())
    model(global_tensor((6, 7), seed=3)).sum().backward()

    def broken(*args, **kwargs):
        raise RuntimeError("broken step")

    with monkeypatch.context() as patch:
        patch.setattr(SGD, "_multi_tensor_sgd", broken)
        patch.setattr(SGD, "_single_tensor_sgd", broken)
        with pytest.raises(RuntimeError, match="broken step"):
            opt.step()
    opt.zero_grad()  # on the swapped groups: it must still clear the parameters' gradients
    keys = list(opt.state_dict()["state"].keys())
    whole = opt.param_groups[0]["params"] == params and all(p.grad is None for p in params)
    states = all(type(opt.state[p]["momentum_buffer"]) is DTensor for p in params)
    assert_all_ranks(whole and states and keys == list(range(len(params))),
                     f"optimizer after a raised step: params back {whole}, states {states}, keys {keys}")
