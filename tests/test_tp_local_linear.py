"""The local path of ColwiseParallel / RowwiseParallel ``nn.Linear`` (fast/linear.py):
a step does Megatron's work only (no aten op through DTensor dispatch: the parameter
gradients go on ``.grad`` without AccumulateGrad's ``detach``, and exactly Megatron's collectives), equals one process (uneven shards
at 3 ranks, 3-D inputs, sequence parallelism), and hands over to the general path where
it does not apply (autocast, a Linear subclass with its own forward, changed parameters)."""
import copy
import pickle

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import CollectiveLog, assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from mpidtensor.fast.linear import LocalLinearForward
from mpidtensor.parallel.install import install, own_forward
from test_parallel import check_against, full_of, tp_mesh  # noqa: F401 (a fixture)

WORLD = MPI.COMM_WORLD


class DispatchLog:
    """The aten ops DTensor dispatch sees inside a ``with`` block (``.ops``)."""

    def __init__(self, monkeypatch) -> None:
        self.ops: list[str] = []
        inner = DTensor.__torch_dispatch__

        def counting(cls, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return inner(func, types, args, kwargs)
        monkeypatch.setattr(DTensor, "__torch_dispatch__", classmethod(counting))


def mlp(bias: bool = True, hidden: int = 11) -> nn.Sequential:
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(6, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, 5, bias=bias))


MEGATRON = {"0": ColwiseParallel(), "2": RowwiseParallel()}


@pytest.mark.parametrize("bias", [True, False])
def test_step_is_megatrons_work(tp_mesh, monkeypatch, bias):
    """A forward and backward step: one all-reduce each way, and DTensor dispatch sees no op
    (``fast.grads`` puts the parameter gradients on ``.grad``; hidden 11: uneven shards)."""
    ref = mlp(bias)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    assert_all_ranks(all(isinstance(m._parallel_forward, LocalLinearForward) for m in (model[0], model[2])))
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    log = DispatchLog(monkeypatch)
    with CollectiveLog() as comms:
        out = model(x)
        forward_comms = list(comms.calls)
        check_against(ref, model, ref(x), out)
    expected = ["all_reduce"] if tp_mesh.size() > 1 else []
    assert_all_ranks(forward_comms == expected, str(forward_comms))
    assert_all_ranks(comms.calls == expected * 2 + ["all_gather"] * (len(comms.calls) - 2 * len(expected)),
                     str(comms.calls))  # check_against's full_tensor() of the gradients
    assert_all_ranks(log.ops == [], str(log.ops))


def test_gradient_detach_keeps_spec_and_memory(tp_mesh):
    """A DTensor ``detach`` (dispatch's short path, AccumulateGrad's without ``fast.grads``):
    the same spec and local memory, no autograd; a view tagged as computed on a copy keeps its tag."""
    model = parallelize_module(mlp(True), tp_mesh, MEGATRON)
    model(torch.randn(4, 3, 6)).sum().backward()
    grad = model[0].weight.grad
    alias = grad.detach()
    assert_all_ranks(alias._spec is grad._spec and not alias.requires_grad, repr(alias._spec))
    assert_all_ranks(alias.to_local().data_ptr() == grad.to_local().data_ptr(), "detach copied the gradient")
    grad._not_a_view_of = "a test tag"
    assert_all_ranks(getattr(grad.detach(), "_not_a_view_of", None) == "a test tag", "the view tag was dropped")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["plain", "accumulate", "hook", "post_hook", "autograd_grad", "inputs_x",
                                  "inputs_weight", "create_graph"])
def test_param_grad_on_and_off(tp_mesh, case):
    """``fast.grads``: a backward puts the same gradients on ``.grad`` as autograd's
    AccumulateGrad does (fast paths off), and leaves them to autograd where it must: a second
    backward summing into ``.grad``, a tensor hook or post-accumulate-grad hook on the weight,
    ``torch.autograd.grad``, ``backward(inputs=...)``, ``create_graph``."""
    from mpidtensor.fast.grads import PARAM_GRAD
    from mpidtensor.runtime.settings import settings
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(8)).requires_grad_()
    results, hooked = [], []
    for fast in (True, False):
        model = parallelize_module(mlp(True), tp_mesh, MEGATRON)
        weight = model[0].weight
        if case == "hook":
            weight.register_hook(lambda g: hooked.append(fast) or g * 2)
        elif case == "post_hook":
            weight.register_post_accumulate_grad_hook(lambda p: hooked.append(fast))
        before = PARAM_GRAD.hits
        with settings.override(fast_paths=fast):
            loss = (model(x) ** 2).sum()
            if case == "autograd_grad":
                got = {"w": torch.autograd.grad(loss, [weight])[0].full_tensor()}
            elif case in ("inputs_x", "inputs_weight"):
                loss.backward(inputs=[x] if case == "inputs_x" else [weight])
                got = _grads(model)
            elif case == "create_graph":
                loss.backward(create_graph=True)
                got = _grads(model)
            else:
                loss.backward()
                if case == "accumulate":
                    (model(x) ** 2).sum().backward()
                got = _grads(model)
        results.append((got, PARAM_GRAD.hits - before))
    (on, hits_on), (off, hits_off) = results
    # (off: the general path of the whole Linear, which adds a bias inside addmm: equal to rounding)
    bad = [n for n in on if not torch.allclose(on[n], off[n], atol=1e-5, rtol=1e-5)]
    assert_all_ranks(on.keys() == off.keys() and not bad, f"{sorted(on)} vs {sorted(off)}, differ: {bad}")
    expected = {"plain": 4, "accumulate": 4, "hook": 3, "post_hook": 3, "autograd_grad": 0, "inputs_x": 0,
                "inputs_weight": 1, "create_graph": 0}[case]
    assert_all_ranks(hits_on == expected and hits_off == 0, f"hits on {hits_on}, off {hits_off}")
    assert_all_ranks(hooked == ([True, False] if case in ("hook", "post_hook") else []), str(hooked))


def test_sequence_parallel_block(tp_mesh):
    """Megatron-SP: the sequence-sharded input is all-gathered into Colwise, Rowwise
    reduce-scatters its output; backward the mirror (reduce-scatter, all-gather)."""
    ref = mlp()
    plan = {"0": ColwiseParallel(input_layouts=Shard(1)),
            "2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, plan)
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(3))  # 7 tokens: uneven
    xs = distribute_tensor(x, tp_mesh, [Shard(1)]).requires_grad_()
    with CollectiveLog() as comms:
        out = model(xs)
        forward_comms = list(comms.calls)
        (out.to_local() * 2).sum().backward()
    if tp_mesh.size() > 1:
        assert_all_ranks(forward_comms == ["all_gather", "reduce_scatter"], str(forward_comms))
        assert_all_ranks(comms.calls[2:] == ["all_gather", "reduce_scatter"], str(comms.calls))
    assert_all_ranks(isinstance(out, DTensor) and out.placements == (Shard(1),), repr(out))
    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x)
    (ref_out * 2).sum().backward()
    assert_close(out.full_tensor(), ref_out, atol=1e-5, rtol=1e-5)
    assert_close(xs.grad.full_tensor(), ref_x.grad, atol=1e-5, rtol=1e-5)
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5)


def test_frozen_weight_and_input_without_grad(tp_mesh):
    """No input gradient asked: Colwise does not all-reduce one; a frozen weight gets none."""
    ref = mlp()
    ref[0].weight.requires_grad_(False)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    with CollectiveLog() as comms:
        model(x).sum().backward()
    assert_all_ranks(comms.calls == ["all_reduce"] * (tp_mesh.size() > 1), str(comms.calls))
    assert_all_ranks(model[0].weight.grad is None)
    ref(x).sum().backward()
    for name in ("0.bias", "2.weight", "2.bias"):
        got = dict(model.named_parameters())[name].grad.full_tensor()
        assert_all_ranks(torch.allclose(got, dict(ref.named_parameters())[name].grad, atol=1e-5), name)


def test_deepcopy_rebinds_forward(tp_mesh):
    """A deep copy of a parallelized model computes with, and gives gradients to, its own
    parameters."""
    ref = mlp()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    twin = copy.deepcopy(model)
    assert_all_ranks(type(twin[0]) is type(model[0]) and twin[0]._parallel_forward is not model[0]._parallel_forward)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    check_against(ref, twin, ref(x), twin(x))
    assert_all_ranks(all(p.grad is None for p in model.parameters()), "the original got gradients")


class Doubled:
    """A picklable installed forward: twice the module's own."""

    def __call__(self, module, args, kwargs):
        return 2 * nn.Linear.forward(module, *args, **kwargs)


def test_class_swap_keeps_the_module(tp_mesh):
    """The styles install their forward by a cached class swap: the module stays a Linear
    with the same state_dict and parameter names, its own class's forward is known
    (``own_forward``), and a swapped module pickles by its base class (a TP model does
    not pickle: its communicators cannot)."""
    ref = mlp()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    same = (isinstance(model[0], nn.Linear) and type(model[0]) is type(model[2])
            and type(model[0]).__mro__[2] is nn.Linear and own_forward(model[0]) is nn.Linear.forward
            and list(model.state_dict()) == list(ref.state_dict())
            and [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()])
    assert_all_ranks(same, f"{type(model[0]).__mro__}")
    plain = install(nn.Linear(3, 2), Doubled())
    twin = pickle.loads(pickle.dumps(plain))
    x = torch.randn(4, 3)
    assert_all_ranks(type(twin) is type(plain) and torch.equal(twin(x), 2 * nn.Linear.forward(plain, x))
                     and torch.equal(copy.deepcopy(plain)(x), plain(x)), "a swapped module does not round-trip")
    with pytest.raises(Exception):  # mpi4py's: a communicator cannot be pickled
        pickle.dumps(model)


def test_general_path_where_local_does_not_apply(tp_mesh, monkeypatch):
    """Autocast, and parameters another code replaced, go through DTensor dispatch and
    still equal one process."""
    ref = mlp()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(6))
    log = DispatchLog(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(x), ref(x)
    assert_all_ranks(any("addmm" in op or "mm" in op for op in log.ops), "autocast took the local path")
    assert_all_ranks(torch.allclose(full_of(got, tp_mesh).float(), want.float(), atol=3e-2), "autocast output")
    # A Rowwise weight replaced by a replicated one: the general path redistributes it.
    model[2].weight = nn.Parameter(distribute_tensor(ref[2].weight.detach(), tp_mesh, [Replicate()]))
    log.ops.clear()
    check_against(ref, model, ref(x), model(x))
    assert_all_ranks(any("mm" in op for op in log.ops), "a replicated weight took the local path")


class ScaledLinear(nn.Linear):
    """A Linear with its own forward: the style keeps torch's hooks for it."""

    def forward(self, x):
        return super().forward(x) * 2


def test_linear_subclass_keeps_hooks(tp_mesh):
    torch.manual_seed(7)
    ref = nn.Sequential(ScaledLinear(6, 9), nn.ReLU(), ScaledLinear(9, 4))
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MEGATRON)
    assert_all_ranks(all(m._forward_pre_hooks and "forward" not in vars(m) for m in (model[0], model[2])))
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(8))
    check_against(ref, model, ref(x), model(x))


DTENSOR_OUTPUTS = {
    # Rowwise reduce-scatters to a DTensor the Function makes; Colwise hands its shard on as one
    "rowwise Shard(1)": {"0": ColwiseParallel(input_layouts=Shard(1)),
                         "2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)},
    "rowwise Replicate": {"0": ColwiseParallel(),
                          "2": RowwiseParallel(use_local_output=False)},
    "colwise Shard(-1)": {"0": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                               use_local_output=False)},
    # an output wanted in another layout than the Function gives: redistributed after it
    "colwise Replicate": {"0": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)},
    "colwise Replicate, local": {"0": ColwiseParallel(output_layouts=Replicate())},
}


@pytest.mark.parametrize("downstream", ["sum", "weighted"])
@pytest.mark.parametrize("case", sorted(DTENSOR_OUTPUTS))
def test_dtensor_output_takes_any_gradient_layout(tp_mesh, case, downstream):
    """A DTensor output made by the Function: its gradient, in the output's layout (a
    weighting of the full tensor) or another one (``sum``'s backward: replicated), gives
    one process's gradients; 7 tokens and hidden 11: uneven shards."""
    ref = mlp()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, DTENSOR_OUTPUTS[case])
    body = model if "2" in DTENSOR_OUTPUTS[case] else model[0]
    ref_body = ref if "2" in DTENSOR_OUTPUTS[case] else ref[0]
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(9))
    given = body[0]._parallel_forward.given if isinstance(body, nn.Sequential) else body._parallel_forward.given
    xs = distribute_tensor(x, tp_mesh, [given]).requires_grad_()
    out = body(xs)
    ref_x = x.clone().requires_grad_()
    ref_out = ref_body(ref_x)
    if downstream == "sum":
        assert_all_ranks(isinstance(out, DTensor) or "local" in case, type(out).__name__)
        loss, ref_loss = (out.sum() if isinstance(out, DTensor) else out.sum()), ref_out.sum()
    else:
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(10))
        loss, ref_loss = (full_of(out, tp_mesh) * weight).sum(), (ref_out * weight).sum()
    loss.backward()
    ref_loss.backward()
    assert_close(full_of(out, tp_mesh), ref_out, atol=1e-5, rtol=1e-5)
    assert_close(xs.grad.full_tensor(), ref_x.grad, atol=1e-5, rtol=1e-5)
    got = {n: p.grad.full_tensor() for n, p in body.named_parameters()}
    for name, p in ref_body.named_parameters():
        assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5)
