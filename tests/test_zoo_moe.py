"""Hugging Face mixture-of-experts models with their experts split over the ranks
(``ExpertParallel``, from the models' own ``ep_plan``), against one process.

* Tensor parallelism: the model's ``tp_plan`` without its tensor-parallel MoE styles
  (``moe_tp_experts``, ``packed_colwise``: test_strided_shard.py has them) plus its ``ep_plan``
  with ``expert_dispatch="all_reduce"``: every rank holds the whole batch, runs its own
  experts on the routes to them, and one all-reduce sums the outputs.
* Expert parallelism over data-parallel ranks (``"all_to_all"``): each rank trains on its
  own shard of the batch, the (token, expert) pairs travel to the experts' ranks and back;
  the other parameters are plain, their gradients averaged by hand, or sharded by FSDP2
  (``fully_shard(..., ignored_params=experts)``).

12 experts split over 1-4 ranks; Qwen2-MoE adds a shared expert, GPT-OSS biased experts.
"""
import copy

import pytest
import torch
import transformers
from mpi4py import MPI
from torch import nn

import mpidtensor.checkpoint as dcp
from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor
from mpidtensor.fsdp import fully_shard
from mpidtensor.parallel import ExpertParallel, from_hf_plan, parallelize_module
from mpidtensor.parallel.experts import ExpertsForward
from zoo_models import (
    ADAM_EPS, GRAD_ATOL, HEADS, LR, PARAM_ATOL, SEQ, VOCAB, _tokens, check_trains_like_one_process, loss_of,
    parameter_differences, shard, train_reference,
)

WORLD = MPI.COMM_WORLD
EXPERTS = 12
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=EXPERTS, **_common()),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        num_experts=EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=48, pad_token_id=0,
        **_common()),
    "gpt_oss": lambda: transformers.GptOssConfig(num_local_experts=EXPERTS, sliding_window=4, pad_token_id=0,
                                                 **_common()),
}


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2 * HEADS, num_key_value_heads=HEADS, head_dim=4, num_experts_per_tok=2,
                max_position_embeddings=4 * SEQ, tie_word_embeddings=False)


def moe_model(name: str, seed: int = 0) -> nn.Module:
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def batches(steps: int = 3) -> list:
    gen = torch.Generator().manual_seed(7)
    return [_tokens(gen) for _ in range(steps)]


def tensor_parallel_plan(model: nn.Module) -> dict:
    """The model's TP plan without its tensor-parallel MoE entries, plus its EP plan."""
    dense = {key: style for key, style in model.tp_plan.items()
             if style not in ("moe_tp_experts", "packed_colwise", "packed_rowwise") and ".experts." not in key}
    return from_hf_plan({**dense, **model.ep_plan}, expert_dispatch="all_reduce", model=model)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_with_expert_parallel_trains_like_one_process(name, mesh1d):
    ref = moe_model(name)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh1d, tensor_parallel_plan(model))
    experts = model.model.layers[0].mlp.experts
    sharded = [p for p in experts.parameters() if isinstance(p, DTensor)]
    assert_all_ranks(sharded and all(p.to_local().shape[0] == EXPERTS // WORLD.size for p in sharded)
                     and experts.num_experts == EXPERTS // WORLD.size, "the experts are not split over the ranks")
    check_trains_like_one_process(model, ref, batches())


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_expert_parallel_over_data_parallel_ranks(name, mesh1d):
    """Each rank its own rows of every batch; expert gradients come summed over the ranks
    by the backward exchanges, so each rank backpropagates its loss / n; the plain
    parameters' gradients are summed by hand (data parallelism)."""
    ref = moe_model(name)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh1d, from_hf_plan(model.ep_plan))
    data = batches()
    ref_losses, ref_grads = train_reference(ref, data, WORLD.size)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for batch in data:
        loss = loss_of(model, *shard(batch, WORLD.rank, WORLD.size))
        (loss / WORLD.size).backward()
        for p in model.parameters():
            if p.grad is not None and not isinstance(p, DTensor):
                WORLD.Allreduce(MPI.IN_PLACE, p.grad.numpy())
        grads = grads or {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                          for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size)
    assert_close(torch.tensor(losses), ref_losses, atol=1e-5, rtol=1e-5)
    bad = {n: (g - ref_grads[n]).abs().max().item() for n, g in grads.items()
           if not torch.allclose(g, ref_grads[n], atol=GRAD_ATOL, rtol=1e-4)}
    assert_all_ranks(not bad, f"first gradients differ from one process: {bad}")
    differ = parameter_differences(model, ref, PARAM_ATOL)
    assert_all_ranks(not differ, f"parameters differ from one process: {differ}")



@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fsdp_with_expert_parallel_trains_like_one_process(name, mesh1d):
    """FSDP2 shards every parameter but the experts (``ignored_params``), which
    ExpertParallel splits over the same ranks; the experts' gradients come summed over
    the ranks, so a hook takes their mean, as FSDP's reduce-scatter does for the rest."""
    ref = moe_model(name)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh1d, from_hf_plan(model.ep_plan))
    experts = {p for m in model.modules() if isinstance(getattr(m, "_parallel_forward", None), ExpertsForward)
               for p in m.parameters()}
    for p in experts:
        p.register_hook(lambda grad: grad / WORLD.size)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh1d, ignored_params=experts)
    fully_shard(model, mesh=mesh1d, ignored_params=experts)
    check_trains_like_one_process(model, ref, batches(), WORLD.rank, WORLD.size, WORLD)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp_over_tensor_and_expert_parallel_trains_like_one_process(name, mesh2d):
    """FSDP x TP on 2x2: the TP + EP plan on the "tp" dim (the experts split over it as
    TP parameters are), then fully_shard over "dp", which shards the experts' blocks on
    their next dim as it does any TP parameter's."""
    ref = moe_model(name)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh2d["tp"], tensor_parallel_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh2d["dp"])
    fully_shard(model, mesh=mesh2d["dp"])
    dp = mesh2d.get_group("dp")
    check_trains_like_one_process(model, ref, batches(), dp.rank, dp.size, dp)

def _experts(seed: int = 0) -> nn.Module:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = CONFIGS["mixtral"]()
    torch.manual_seed(seed)
    experts = MixtralExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    return experts


def test_ranks_whose_experts_get_no_tokens(mesh1d):
    """Every route goes to experts 0-2 (rank 0's at 4 ranks): the other ranks run nothing,
    yet take part in both exchanges and in the backward ones, and every gradient matches."""
    ref = _experts()
    model = parallelize_module(copy.deepcopy(ref), mesh1d, ExpertParallel())
    rows = 5
    hidden = global_tensor((rows * WORLD.size, 48), seed=3)
    index = torch.randint(0, 3, (rows * WORLD.size, 2), generator=torch.Generator().manual_seed(4))
    weights = global_tensor((rows * WORLD.size, 2), seed=5).softmax(-1)
    mine = slice(WORLD.rank * rows, (WORLD.rank + 1) * rows)
    x, w = hidden[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
    out = model(x, index[mine], w)
    out.pow(2).sum().backward()
    xr, wr = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = ref(xr, index, wr)
    expected.pow(2).sum().backward()
    assert_close(out, expected[mine], atol=1e-5, rtol=1e-5)
    assert_close(x.grad, xr.grad[mine], atol=1e-5, rtol=1e-5)
    assert_close(w.grad, wr.grad[mine], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_all_reduce_dispatch_refuses_different_tokens(mesh1d):
    if WORLD.size == 1:
        pytest.skip("one rank always holds the same tokens")
    model = parallelize_module(_experts(), mesh1d, ExpertParallel(dispatch="all_reduce"))
    hidden = global_tensor((4, 48), seed=WORLD.rank)  # each rank its own
    index = torch.zeros(4, 2, dtype=torch.long)
    raises_everywhere(ValueError, lambda: model(hidden, index, torch.ones(4, 2)), match="same tokens")



@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce"])
def test_routes_outside_the_experts_raise_everywhere(dispatch, mesh1d):
    """An expert id outside [0, E) (on the last rank only, with each rank's own tokens) is
    a ValueError on every rank before any token moves: the all-to-all's counts carry each
    sender's verdict; under all_reduce the ranks hold the same routes."""
    model = parallelize_module(_experts(), mesh1d, ExpertParallel(dispatch=dispatch))
    index = torch.zeros(4, 2, dtype=torch.long)
    if dispatch == "all_reduce" or WORLD.rank == WORLD.size - 1:
        index[1, 0] = EXPERTS
    raises_everywhere(ValueError, lambda: model(global_tensor((4, 48), seed=3), index, torch.ones(4, 2)),
                      match="outside [0, 12)")

def test_bad_expert_plans_raise_everywhere(mesh1d):
    raises_everywhere(TypeError, lambda: parallelize_module(nn.Linear(4, 4), mesh1d, ExpertParallel()),
                      match="num_experts")
    raises_everywhere(ValueError, lambda: ExpertParallel(dispatch="broadcast"), match="dispatch")
    raises_everywhere(ValueError, lambda: from_hf_plan({"layers.*.mlp.experts.down_proj": "grouped_gemm"}),
                      match="no ep_dispatch_experts")
    if WORLD.size > 1:
        experts = _experts()
        experts.num_experts = 5 * WORLD.size + 1
        for name, p in list(experts.named_parameters()):
            experts.register_parameter(name, nn.Parameter(p.detach()[:1].expand(experts.num_experts, *p.shape[1:])))
        raises_everywhere(ValueError, lambda: parallelize_module(experts, mesh1d, ExpertParallel()),
                          match="do not split evenly")


def test_expert_parallel_checkpoint_loads_into_one_process(ckpt_dir, mesh1d):
    """The experts' weights are Shard(0) DTensors: saved, each rank's experts once; loaded
    whole into an unsplit model in every process (``no_dist``)."""
    model = parallelize_module(_experts(), mesh1d, ExpertParallel())
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    alone = _experts(seed=5)
    state = alone.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir, no_dist=True)
    differ = [k for k, v in state.items() if not torch.equal(v, _experts().state_dict()[k])]
    assert_all_ranks(not differ, f"loaded experts differ: {differ}")

