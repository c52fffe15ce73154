"""The model zoo under tensor parallelism on the 1-D world mesh: each Hugging Face model with
its own ``tp_plan`` (translated to mpidtensor styles) or, where it has none, the plan in
zoo_models; and with sequence parallelism where the architecture has a sequence (with
eager and SDPA attention). Every rank sees the whole batch; losses, first gradients and
every parameter (``full_tensor``) match one process over several AdamW steps."""
import copy

import pytest
import torch
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Replicate, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.parallel import from_hf_plan, parallelize_module
from zoo_models import ZOO, check_trains_like_one_process, loss_of


def check_tp(zoo, parallelize, mesh, attention: str = "eager") -> nn.Module:
    ref = zoo.build(attention=attention)
    model = copy.deepcopy(ref)
    parallelize(model, mesh)
    assert_all_ranks(any(isinstance(p, DTensor) for p in model.parameters()), "no parameter is distributed")
    check_trains_like_one_process(model, ref, zoo.batches())
    return model


@pytest.mark.parametrize("name", list(ZOO))
def test_tp_trains_like_one_process(name, mesh1d):
    zoo = ZOO[name]
    check_tp(zoo, zoo.tensor_parallel, mesh1d)


# SDPA on each attention path: local GQA heads with a causal mask (Llama), local heads with
# a padding mask (BERT), DTensors (GPT-2).
SP_CASES = [(name, "eager") for name in ZOO] + [(name, "sdpa") for name in ("llama", "bert", "gpt2")]


@pytest.mark.parametrize("name, attention", SP_CASES)
def test_tp_sp_trains_like_one_process(name, attention, mesh1d):
    """With eager attention, and with ``scaled_dot_product_attention``."""
    zoo = ZOO[name]
    if isinstance(zoo.sequence_parallel, str):
        pytest.skip(f"{name}: {zoo.sequence_parallel}")
    model = check_tp(zoo, zoo.sequence_parallel, mesh1d, attention)
    if mesh1d.size() > 1:
        # The residual stream is sequence-sharded: each block's MLP (and, with local heads,
        # its attention) ends in a reduce-scatter; GPT-2's attention runs on DTensors.
        with CommDebugMode() as comm, torch.no_grad():
            loss_of(model, *zoo.batches(1)[0])
        scatters = comm.get_comm_counts()["reduce_scatter"]
        least = len(zoo.blocks(model)) * (1 if name == "gpt2" else 2)
        assert_all_ranks(scatters >= least, f"{scatters} reduce-scatters in forward, expected at least {least}")


def test_to_local_takes_a_gradient_of_any_layout(mesh1d):
    """Found by BERT under TP (its attention's backward hands ColwiseParallel's local output a
    transposed gradient): a view of the DTensor before ``to_local`` still differentiates."""
    weights = global_tensor((6, 2, 2), seed=1)
    a = distribute_tensor(global_tensor((4, 6)), mesh1d, [Replicate()]).requires_grad_()
    local = a.view(2, 2, 6).to_local()
    (local.transpose(0, 2) * weights).sum().backward()  # the local gradient: weights transposed
    assert_close(a.grad.full_tensor(), weights.transpose(0, 2).reshape(4, 6))


def test_hf_plan_translation_rejects_unknown_styles():
    raises_everywhere(ValueError, lambda: from_hf_plan({"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}),
                      match="mla_kv_a_proj")
    raises_everywhere(TypeError, lambda: from_hf_plan(["colwise"]), match="mapping")


def test_replicated_with_grad_allreduce_takes_any_row_wise_module(mesh1d):
    """Apertus' MLP activation (transformers' xIELU) has learnt scalars and runs on the
    column-parallel projection's local columns: each rank's gradient of them is a partial
    sum. Planned ``replicated_with_grad_allreduce`` (Apertus' own plan leaves it out),
    the scalars stay replicated and their gradients are summed over the mesh."""
    from transformers.activations import XIELUActivation

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(24, 48), XIELUActivation(dtype=torch.float32), nn.Linear(48, 24))
    model = copy.deepcopy(ref)
    plan = from_hf_plan({"0": "colwise", "1": "replicated_with_grad_allreduce", "2": "rowwise"})
    parallelize_module(model, mesh1d, plan)
    x = global_tensor((5, 24), seed=3)
    ref(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert_close(grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
