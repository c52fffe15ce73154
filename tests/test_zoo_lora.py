"""peft's LoRA adapters on the zoo's Llama under FSDP2, TP and FSDP x TP: losses, first
gradients (of the adapters: the base weights are frozen) and every parameter match one
process over several AdamW steps.

peft wraps each targeted Linear in a ``Linear`` of its own holding ``base_layer`` and the
adapters ``lora_A`` / ``lora_B``, and adds ``lora_B(lora_A(x)) * scaling`` to the base
output. torch's TP styles (and these) refuse that wrapper; the plan instead names the
modules inside it (:func:`lora_plan`), and the stock styles then compose:

* a column-parallel projection: ``base_layer`` and ``lora_B`` column-parallel, ``lora_A``
  replicated. Both branches give this rank's output features; the input gradient of each
  is all-reduced, so the two sum to the whole gradient;
* a row-parallel projection: ``base_layer`` and ``lora_A`` row-parallel (each reduces its
  partial output, ``lora_A``'s a rank-``r`` one), ``lora_B`` replicated.
"""
import copy

import pytest
from torch import nn

from helpers import assert_all_ranks
from mpidtensor import DTensor
from mpidtensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, from_hf_plan, parallelize_module
from zoo_models import ZOO, check_trains_like_one_process, fully_shard_zoo

peft = pytest.importorskip("peft")

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
ADAPTER = "default"  # peft's name for the first adapter


def lora_model(seed: int = 0) -> nn.Module:
    """The zoo's Llama with rank-4 LoRA adapters on ``TARGETS``; ``lora_B`` starts random
    (peft starts it at zero), so that every adapter weight gets a gradient from step one."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(ZOO["llama"].build(seed), config)


def lora_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The Hugging Face model's own TP plan, redirected into peft's wrappers (module docstring)."""
    hf = model.base_model.model.tp_plan
    plan = {}
    for key, style in from_hf_plan(hf).items():
        key = f"base_model.model.{key}"
        if key.rsplit(".", 1)[-1] not in TARGETS:
            plan[key] = style
        elif isinstance(style, ColwiseParallel):
            plan |= {f"{key}.base_layer": style, f"{key}.lora_B.{ADAPTER}": ColwiseParallel()}
        else:
            assert isinstance(style, RowwiseParallel), (key, style)
            plan |= {f"{key}.base_layer": style, f"{key}.lora_A.{ADAPTER}": RowwiseParallel()}
    return plan


def trained(model: nn.Module) -> list[str]:
    """Names of the parameters that train (peft freezes the base model's)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_lora_fsdp_trains_like_one_process(mesh1d):
    ref = lora_model()
    model = copy.deepcopy(ref)
    fully_shard_zoo(model.base_model.model, ZOO["llama"], mesh1d)
    names = trained(model)
    assert_all_ranks(names and all("lora_" in name for name in names), f"not only the adapters train: {names}")
    check_trains_like_one_process(model, ref, ZOO["llama"].batches(), mesh1d.get_local_rank(), mesh1d.size(),
                                  mesh1d.get_group())


def test_lora_tp_trains_like_one_process(mesh1d):
    ref = lora_model()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh1d, lora_plan(model))
    sharded = {name for name, p in model.named_parameters() if isinstance(p, DTensor) and "lora_" in name}
    want = {f"{proj}.lora_{'A' if proj in ('o_proj', 'down_proj') else 'B'}" for proj in TARGETS}
    got = {name.split(".self_attn.")[-1].split(".mlp.")[-1].rsplit(".", 2)[0] for name in sharded}
    assert_all_ranks(got == want, f"sharded adapters {sorted(got)}, want {sorted(want)}")
    check_trains_like_one_process(model, ref, ZOO["llama"].batches())


def test_lora_fsdp_tp_trains_like_one_process(mesh2d):
    ref = lora_model()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh2d["tp"], lora_plan(model))
    fully_shard_zoo(model.base_model.model, ZOO["llama"], mesh2d["dp"])
    dp = mesh2d.get_group("dp")
    check_trains_like_one_process(model, ref, ZOO["llama"].batches(), dp.rank, dp.size, dp)
