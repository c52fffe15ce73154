"""The local path of SequenceParallel ``nn.RMSNorm`` / ``nn.LayerNorm`` (fast/norm.py),
a piece of the FSDP x TP step at the hand-written step's cost: the norm runs on this rank's
sequence block with no aten op through DTensor dispatch and exactly Megatron's collectives
(one all-reduce per parameter gradient, backward only), equals one process (odd sequence
lengths: uneven blocks at 2-4 ranks, empty blocks at 4; the "tp" half of the 2x2 mesh),
takes an output gradient in another layout, and hands over to the general path where it
does not apply (a plain input, a norm over the sharded dim, autocast)."""
import copy

import pytest
import torch
from torch import nn

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import SequenceParallel, parallelize_module
from mpidtensor.fast.norm import LocalNormForward
from test_parallel import check_against, tp_mesh  # noqa: F401 (a fixture)
from test_tp_local_linear import DispatchLog


def norm(kind: str, dim: int = 6) -> nn.Module:
    torch.manual_seed(4)
    module = {"rms": nn.RMSNorm(dim, eps=1e-6), "rms_no_eps": nn.RMSNorm(dim),
              "layer": nn.LayerNorm(dim), "rms_no_affine": nn.RMSNorm(dim, elementwise_affine=False)}[kind]
    with torch.no_grad():  # not the ones init: the gradients must carry the weights
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("kind", ["rms", "rms_no_eps", "layer", "rms_no_affine"])
@pytest.mark.parametrize("seq", [7, 3])  # 3 over 4 ranks: one rank holds no position
def test_local_norm_is_megatrons_work(tp_mesh, monkeypatch, kind, seq):
    """Forward and backward: no aten op through dispatch but AccumulateGrad's ``detach``,
    no collective forward, one all-reduce per parameter backward; values and gradients
    (input and parameters) equal one process's."""
    ref = norm(kind)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    assert_all_ranks(isinstance(model._parallel_forward, LocalNormForward))
    x_ref = global_tensor((2, seq, 6)).requires_grad_()
    x = distribute_tensor(x_ref.detach(), tp_mesh, [Shard(1)]).requires_grad_()
    weight = global_tensor((2, seq, 6), seed=7)
    log = DispatchLog(monkeypatch)
    local_weight = distribute_tensor(weight, tp_mesh, [Shard(1)]).to_local()
    with CollectiveLog() as comms:
        out = model(x)
        forward_comms = list(comms.calls)
        (out.to_local() * local_weight).sum().backward()  # the sum over ranks is the global loss
    params = list(model.parameters())
    expected = ["all_reduce"] * len(params) if tp_mesh.size() > 1 else []
    assert_all_ranks(forward_comms == [] and comms.calls == expected, str(comms.calls))
    # AccumulateGrad's detach of each leaf's gradient (the parameters and x)
    assert_all_ranks(log.ops == ["aten.detach.default"] * (len(params) + 1), str(log.ops))
    assert_all_ranks(out.placements == (Shard(1),) and out.stride() == x_ref.stride(), repr(out))
    out_ref = ref(x_ref)
    (out_ref * weight).sum().backward()
    assert_close(out.full_tensor(), out_ref.detach(), atol=1e-5, rtol=1e-5)
    assert_close(x.grad.full_tensor(), x_ref.grad, atol=1e-5, rtol=1e-5)
    for p, p_ref in zip(params, ref.parameters()):
        assert_all_ranks(p.grad.placements == (Replicate(),), repr(p.grad.placements))
        assert_close(p.grad.full_tensor(), p_ref.grad, atol=1e-5, rtol=1e-5)


def test_gradient_in_another_layout(tp_mesh):
    """An output gradient that comes back replicated is moved to the input's layout."""
    ref = norm("rms")
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = global_tensor((3, 5, 6))
    out = model(distribute_tensor(x, tp_mesh, [Shard(1)]))
    check_against(ref, model, ref(x), out.redistribute(tp_mesh, [Replicate()]))


def test_norm_in_sp_block_over_3d_input(tp_mesh):
    """A 4-D activation sharded on dim 2 with a 2-D normalized shape, in a residual block
    (the residual add runs on DTensors): equals one process."""
    torch.manual_seed(5)
    ref = nn.LayerNorm((3, 4))
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel(sequence_dim=0))
    x = global_tensor((5, 2, 3, 4))
    dx = distribute_tensor(x, tp_mesh, [Shard(0)])
    check_against(ref, model, x + ref(x), dx + model(dx))


def test_general_path_where_local_does_not_apply(tp_mesh, monkeypatch):
    """A plain (local) input, a norm whose normalized dim is the sharded one, and autocast
    go through DTensor dispatch, and still equal one process."""
    ref = norm("rms")
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = global_tensor((2, 7, 6))
    log = DispatchLog(monkeypatch)
    local = distribute_tensor(x, tp_mesh, [Shard(1)]).to_local()
    out = model(local)  # read as Shard(1) by the style's input hook: then the local path
    assert_all_ranks(not any("pow" in op for op in log.ops), str(log.ops))
    assert_close(out.full_tensor(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    # sharded on the normalized dim: the style redistributes to Shard(1) first
    wide = distribute_tensor(x, tp_mesh, [Shard(2)])
    assert_close(model(wide).full_tensor(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    # a module whose forward sees a last-dim shard (called directly, no hooks): general path
    log.ops.clear()
    direct = LocalNormForward(tp_mesh, nn.RMSNorm.forward)
    if tp_mesh.size() > 1:
        got = direct(model, (distribute_tensor(x, tp_mesh, [Shard(2)]),), {})
        assert_all_ranks(any("pow" in op for op in log.ops), str(log.ops))
        assert_close(got.full_tensor(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    log.ops.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(distribute_tensor(x, tp_mesh, [Shard(1)]))
    assert_all_ranks(len(log.ops) > 0, "autocast took the local path")
    assert_all_ranks(torch.allclose(got.full_tensor().float(), ref(x).detach(), atol=3e-2), "autocast output")


def test_deepcopy_rebinds_forward(tp_mesh):
    model = parallelize_module(norm("layer"), tp_mesh, SequenceParallel())
    twin = copy.deepcopy(model)
    assert_all_ranks(type(twin) is type(model) and twin._parallel_forward is not model._parallel_forward)
    x = distribute_tensor(global_tensor((2, 5, 6)), tp_mesh, [Shard(1)])
    assert_close(twin(x).full_tensor(), model(x).full_tensor())


def test_bfloat16_gradients_keep_dtype(tp_mesh):
    """bfloat16 activations and weights: outputs and gradients stay bfloat16 (the fused
    kernel's statistics are float32), close to one process."""
    ref = norm("rms").to(torch.bfloat16)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = global_tensor((2, 7, 6)).to(torch.bfloat16)
    dx = distribute_tensor(x, tp_mesh, [Shard(1)]).requires_grad_()
    out = model(dx)
    out.sum().backward()
    x_ref = x.clone().requires_grad_()
    ref(x_ref).sum().backward()
    assert_all_ranks(out.dtype == dx.grad.dtype == model.weight.grad.dtype == torch.bfloat16)
    assert_close(dx.grad.full_tensor().float(), x_ref.grad.float(), atol=3e-2, rtol=3e-2)
    assert_close(model.weight.grad.full_tensor().float(), ref.weight.grad.float(), atol=6e-2, rtol=3e-2)
    assert_all_ranks(isinstance(out, DTensor))


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("hooked", [False, True])
def test_param_grads_on_grad_on_and_off(tp_mesh, kind, hooked):
    """``fast.grads`` for a norm's parameters: where a parameter has no tensor hook (FSDP's
    unsharded parameters: here, parameters registered again without SequenceParallel's
    hook) the backward puts each all-reduced gradient on ``.grad`` itself, one hit per
    parameter; with the hook it leaves them to autograd. ``.grad`` (values, placements,
    strides) equals the fast-paths-off backward's, which without the hook leaves it ``Partial``
    (full_tensor compared) and with it settles it ``Replicate``."""
    from mpidtensor.fast.grads import PARAM_GRAD
    from mpidtensor.runtime.settings import settings
    x_ref = global_tensor((2, 5, 6))
    results = []
    for fast in (True, False):
        model = parallelize_module(norm(kind), tp_mesh, SequenceParallel())
        if not hooked:
            for name, p in list(model.named_parameters()):
                model.register_parameter(name, nn.Parameter(p.detach()))
        x = distribute_tensor(x_ref, tp_mesh, [Shard(1)]).requires_grad_()
        before = PARAM_GRAD.hits
        with settings.override(fast_paths=fast):
            (model(x) ** 2).sum().backward()
        grads = {n: (p.grad.full_tensor(), p.grad.placements, p.grad.stride()) for n, p in model.named_parameters()}
        results.append((grads, x.grad.full_tensor(), PARAM_GRAD.hits - before))
    (on, gx_on, hits_on), (off, gx_off, hits_off) = results
    # (off: the general path's decomposition of the norm, equal to rounding)
    same = on.keys() == off.keys() and torch.allclose(gx_on, gx_off, atol=1e-5, rtol=1e-5) and all(
        torch.allclose(on[n][0], off[n][0], atol=1e-5, rtol=1e-5) and on[n][1] == (Replicate(),)
        and on[n][2] == off[n][2] and (off[n][1] == (Replicate(),) if hooked else off[n][1][0].is_partial())
        for n in on)
    assert_all_ranks(same, f"{on} vs {off}")
    expected = 0 if hooked else len(on)
    assert_all_ranks(hits_on == expected and hits_off == 0, f"hits on {hits_on}, off {hits_off}")
