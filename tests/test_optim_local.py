"""Elementwise torch.optim steps on the local tensors of DTensor parameters
(``mpidtensor.fast.optim_step``): bit for bit the DTensor path's values, the state kept as
DTensors of the parameters' specs, the DTensor path for what does not qualify, and the
optimizer whole again after a step that raised."""
import importlib

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.fast import optim_step
from mpidtensor.fsdp import fully_shard
from mpidtensor.runtime.settings import settings
from test_tp_local_linear import DispatchLog

WORLD = MPI.COMM_WORLD
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
        monkeypatch.setattr(settings, "local_optim_step", path == "local")
        model = _fsdp_model(mesh1d)
        opt = cls(model.parameters(), **kwargs)
        _train(model, opt, 2)
        for p in model.parameters():  # the last step's gradients, for the counted step
            p.grad = distribute_tensor(global_tensor(p.shape, seed=7), mesh1d, p.placements)
        with monkeypatch.context() as patch:
            log = DispatchLog(patch)
            opt.step()
            opt.zero_grad()
        results[path] = (model, opt, len(log.ops))
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
    monkeypatch.setattr(settings, "local_optim_step", False)
    _train(dmodel, dopt, 1, start=5)
    monkeypatch.setattr(settings, "local_optim_step", True)
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


def _partial(full: torch.Tensor, mesh) -> DTensor:
    """``full`` as a Partial DTensor (each rank holds its share of the sum)."""
    return DTensor.from_local(full / WORLD.size, mesh, [Partial()])


# (parameter, gradient) placements the dispatcher does not step locally, and the optimizer
PLACED_ELSEWHERE = {
    "replicate_grad": ([Shard(0)], [Replicate()], torch.optim.AdamW, {}),
    "partial_loop": ("partial", "partial", torch.optim.Adam, dict(foreach=False)),
    "partial_foreach": ("partial", "partial", torch.optim.Adam, {}),
    "partial_fused": ("partial", "partial", torch.optim.Adam, dict(fused=True)),
}


@pytest.mark.parametrize("case", sorted(PLACED_ELSEWHERE))
def test_specs_the_dispatcher_moves_take_the_dtensor_path(mesh1d, monkeypatch, case):
    """A Replicate gradient on a Shard parameter, or a Partial parameter under Adam (not
    linear: the dispatcher reduces before its ops): the local step asks the dispatcher and
    leaves the group alone, and the step (in-place foreach and fused ops written back
    into the moved parameter) matches the same step on full tensors."""
    placed, grad_placed, cls, mode = PLACED_ELSEWHERE[case]
    full, grad = global_tensor((7, 5), seed=1), global_tensor((7, 5), seed=2)
    def place(t, where):
        return _partial(t, mesh1d) if where == "partial" else distribute_tensor(t, mesh1d, where)

    p = nn.Parameter(place(full, placed))
    p.grad = place(grad, grad_placed)
    ref = nn.Parameter(full.clone())
    ref.grad = grad.clone()
    opt, ref_opt = cls([p], lr=0.01, **mode), cls([ref], lr=0.01)
    with monkeypatch.context() as patch:
        log = DispatchLog(patch)
        opt.step()
    ref_opt.step()
    assert_all_ranks(len(log.ops) > 0, f"the group was swapped ({case})")
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


def _even_model(mesh) -> nn.Module:
    """Two Linear(12, 12) layers, each fully_shard-ed: at 1-4 ranks each layer's weight and
    bias shards lie back to back in its flat buffers (one run per layer)."""
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train12(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        model(global_tensor((5, 12), seed=40 + step)).square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_back_to_back_shards_step_as_one_tensor(mesh1d, monkeypatch, name):
    """From the second step on, each layer's weight and bias step as one flat tensor; the
    values equal the per-parameter step's bit for bit, before and after a state_dict
    round trip (which separates the states again until the next step rehomes them)."""
    cls, kwargs = OPTIMIZERS[name]
    module = importlib.import_module("torch.optim.adam" if name == "adamw" else "torch.optim.sgd")
    fn = "_multi_tensor_adam" if name == "adamw" else "_multi_tensor_sgd"
    seen = []
    original = getattr(module, fn)

    def recorded(params, *args, **kw):
        seen.append(len(params))
        return original(params, *args, **kw)
    monkeypatch.setattr(module, fn, recorded)
    models = {}
    for coalesce in (False, True):
        monkeypatch.setattr(optim_step, "COALESCE", coalesce)
        model = _even_model(mesh1d)
        opt = cls(model.parameters(), **kwargs)
        seen.clear()
        _train12(model, opt, 3)
        counts = list(seen)
        saved = opt.state_dict()  # its tensors are the live ones: load copies of them
        saved["state"] = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                          for i, entry in saved["state"].items()}
        opt.load_state_dict(saved)
        _train12(model, opt, 2, start=3)
        models[coalesce] = (model, opt, counts, list(seen[3:]))
    (pmodel, popt, pcounts, _), (fmodel, fopt, fcounts, fafter) = models[False], models[True]
    same = all(torch.equal(a._local_tensor, b._local_tensor) for a, b in zip(pmodel.parameters(), fmodel.parameters()))
    same_state = all(torch.equal(x._local_tensor if type(x) is DTensor else x, y._local_tensor if type(y) is DTensor else y)
                     for a, b in zip(pmodel.parameters(), fmodel.parameters())
                     for x, y in zip(popt.state[a].values(), fopt.state[b].values()))
    assert_all_ranks(same and same_state, f"flat steps differ from per-parameter ones: params {same}, state {same_state}")
    expected = ([4, 4, 4], [4, 2, 2], [4, 2])  # per parameter; flat after the first; reloaded: rehomed after one
    assert_all_ranks((pcounts, fcounts, fafter) == expected,
                     f"tensors per step: per-parameter {pcounts}, flat {fcounts}, after the reload {fafter}")
    params = list(fmodel.parameters())
    views = all(fopt.state[params[i]][k]._local_tensor.untyped_storage().data_ptr()
                == fopt.state[params[i + 1]][k]._local_tensor.untyped_storage().data_ptr()
                for i in (0, 2) for k, v in fopt.state[params[i]].items() if type(v) is DTensor)
    assert_all_ranks(views, "a layer's states are not views of one buffer")


def _apart_model(mesh) -> nn.Module:
    """Three Linear(48, 48) layers, the middle one fully_shard-ed: the root group holds the
    first and the last layer, whose shards lie back to back in its flat buffers at 1-4 ranks
    (even shards, whole 16-byte units) while the optimizer's group lists the middle layer's
    between them."""
    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48))
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_a_run_spans_parameters_apart_in_the_group(mesh1d, monkeypatch):
    """The root group's four shards step as one flat tensor though the group lists the
    middle layer's two between them (two tensors a step from the second step on), bit for
    bit the per-parameter step; a step count changed in place is noticed (the run steps
    one parameter at a time) though the run's counts agreed at its last step."""
    module = importlib.import_module("torch.optim.adam")
    seen = []
    original = module._multi_tensor_adam

    def recorded(params, *args, **kw):
        seen.append(len(params))
        return original(params, *args, **kw)
    monkeypatch.setattr(module, "_multi_tensor_adam", recorded)
    cls, kwargs = OPTIMIZERS["adamw"]
    results = {}
    for coalesce in (False, True):
        monkeypatch.setattr(optim_step, "COALESCE", coalesce)
        model = _apart_model(mesh1d)
        params = list(model.parameters())
        opt = cls(params, **kwargs)
        seen.clear()
        for step in range(5):
            model(global_tensor((5, 48), seed=60 + step)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                opt.state[params[5]]["step"].add_(1.0)  # the run's counts differ now
        results[coalesce] = ([p.detach()._local_tensor for p in params]
                             + [v._local_tensor if type(v) is DTensor else v for p in params for v in opt.state[p].values()],
                             list(seen))
    (general, pcounts), (fast, fcounts) = results[False], results[True]
    same = len(general) == len(fast) and all(torch.equal(a, b) for a, b in zip(general, fast))
    assert_all_ranks(same, "flat steps over a run apart in the group differ from per-parameter ones")
    assert_all_ranks((pcounts, fcounts) == ([6] * 5, [6, 2, 2, 5, 5]),
                     f"tensors per step: per-parameter {pcounts}, flat {fcounts}")


def test_groups_that_do_not_qualify_step_beside_swapped_ones(mesh1d):
    """One group swapped (FSDP parameters), one not (a Shard parameter with a Replicate
    gradient, and a plain tensor): both match one process, and the state holds the
    parameters only."""
    model, ref = _even_model(mesh1d), None
    with torch.random.fork_rng():
        torch.manual_seed(3)
        ref = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
    full, plain_full = global_tensor((6, 4), seed=8), global_tensor((3,), seed=9)
    odd = nn.Parameter(distribute_tensor(full, mesh1d, [Shard(0)]))
    plain, ref_odd, ref_plain = nn.Parameter(plain_full.clone()), nn.Parameter(full.clone()), nn.Parameter(plain_full.clone())
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [odd, plain], "lr": 0.05}], lr=0.01)
    ref_opt = torch.optim.AdamW([{"params": list(ref.parameters())}, {"params": [ref_odd, ref_plain], "lr": 0.05}], lr=0.01)
    for step in range(3):
        for m, o, a, b in ((model, opt, odd, plain), (ref, ref_opt, ref_odd, ref_plain)):
            m(global_tensor((5, 12), seed=40 + step)).square().sum().backward()
            g = global_tensor((6, 4), seed=60 + step)
            a.grad = distribute_tensor(g, mesh1d, [Replicate()]) if a is odd else g
            b.grad = global_tensor((3,), seed=70 + step)
            o.step()
            o.zero_grad()
    for p, q in zip([*model.parameters(), odd], [*ref.parameters(), ref_odd]):
        assert_close(p.full_tensor(), q.detach(), atol=1e-6, rtol=1e-5)
    assert_close(plain.detach(), ref_plain.detach(), atol=1e-6, rtol=1e-5)
    keys = sorted(opt.state_dict()["state"])
    assert_all_ranks(keys == list(range(6)) and len(opt.state) == 6, f"state keys {keys}, {len(opt.state)} entries")


def test_a_step_with_a_closure_takes_the_dtensor_path(mesh1d):
    """``step(closure)``: the closure's backward sets the DTensor parameters' gradients
    inside the step, so the step must read those, as one process does."""
    ref, model = _model(), _fsdp_model(mesh1d)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = global_tensor((6, 7), seed=20 + step)
        for m, o in ((ref, ref_opt), (model, opt)):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = m(x).square().sum()
                loss.backward()
                return loss
            o.step(closure)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.full_tensor(), q.detach(), atol=1e-6, rtol=1e-5)


def test_other_step_hooks_see_the_dtensor_parameters(mesh1d, monkeypatch):
    """An optimizer's own step hooks, or a global pre-hook registered later, run while a
    swap would be in place: the step keeps the DTensor path for them."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    model = _even_model(mesh1d)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    seen = []

    def look(optimizer, args, kwargs):
        seen.append(all(type(p) is DTensor for g in optimizer.param_groups for p in g["params"]))
    own = opt.register_step_pre_hook(look)
    _train12(model, opt, 2)
    own.remove()
    later = register_optimizer_step_pre_hook(look)
    try:
        _train12(model, opt, 2, start=2)
    finally:
        later.remove()
    assert_all_ranks(seen == [True] * 4, f"hooks saw DTensor parameters: {seen}")
