"""Checkpoints of a pipelined model through ``mpidtensor.checkpoint``: each stage's state
dict holds the model's own names (examples/llama_pp.py keeps them), so a checkpoint
saved at one pipeline degree loads at another, or into the whole model without a
pipeline. Saved at PP = 2 (FSDP over the other ranks), loaded at PP = world size and
with no PP (FSDP over all ranks, and one plain model per rank); the loaded model and
optimizer state (torch's flat form, ``flatten_optimizer_state_dict``: one entry per
parameter, its group's settings included) equal the saved ones."""
import sys
from pathlib import Path

import pytest
import torch

from helpers import WORLD, assert_all_ranks
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, init_device_mesh
from mpidtensor.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, build_model  # noqa: E402
from llama_pp import shard_stage, split_stages  # noqa: E402

# 5 blocks: uneven over 2 stages (3 + 2) and over 4 (2 + 1 + 1 + 1)
CFG = LlamaConfig(vocab_size=29, dim=16, n_layers=5, n_heads=4, n_kv_heads=2, hidden_dim=24, max_seq_len=8)
SAVED_SEED, TARGET_SEED = 11, 5
FLAT = dcp.StateDictOptions(flatten_optimizer_state_dict=True)
SAVED_LR, TARGET_LR = 0.1, 0.5


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _step(module: torch.nn.Module) -> torch.optim.Optimizer:
    """An AdamW step with gradients ``0.5 * p`` (no data needed): optimizer state to save."""
    opt = torch.optim.AdamW(module.parameters(), lr=SAVED_LR)
    for p in module.parameters():
        p.grad = p.detach() * 0.5
    opt.step()
    return opt


def _stage(pp: int, seed: int):
    """This rank's stage of the model at pipeline degree ``pp``, FSDP over the other dim."""
    mesh = init_device_mesh("cpu", (pp, WORLD.size // pp), mesh_dim_names=("pp", "dp"))
    (stage,) = split_stages(build_model(CFG, seed), pp, [mesh.get_local_rank("pp")])
    return shard_stage(stage, fsdp_mesh=mesh["dp"])


def _reference() -> tuple[dict, dict]:
    """The saved values computed in one process: parameters and optimizer state by name."""
    model = build_model(CFG, SAVED_SEED)
    opt = _step(model)
    names = {p: n for n, p in model.named_parameters()}
    return ({n: p.detach() for n, p in model.named_parameters()},
            {names[p]: dict(s) for p, s in opt.state.items()})


def _differences(module, opt, ref_params, ref_state) -> list[str]:
    differ = []
    names = {p: n for n, p in module.named_parameters()}
    for name, p in module.named_parameters():
        if not torch.equal(_full(p.detach()), ref_params[name]):
            differ.append(name)
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if not torch.equal(_full(state[key]), ref_state[names[p]][key]):
                differ.append(f"{names[p]}.{key}")
    differ += [f"lr {g['lr']}" for g in opt.param_groups if g["lr"] != SAVED_LR]
    return differ


def _load_into(module, ckpt_dir) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(module.parameters(), lr=TARGET_LR)
    state = {"model": dcp.get_model_state_dict(module), "optim": dcp.get_optimizer_state_dict(module, opt, options=FLAT)}
    dcp.load(state, ckpt_dir)
    dcp.set_model_state_dict(module, state["model"])
    dcp.set_optimizer_state_dict(module, opt, state["optim"], options=FLAT)
    return opt


@pytest.fixture
def saved_at_pp2(ckpt_dir):
    """A checkpoint of the model (and its AdamW state) saved from 2 pipeline stages."""
    if WORLD.size % 2:
        pytest.skip("PP = 2 needs an even number of ranks")
    stage = _stage(2, SAVED_SEED)
    opt = _step(stage)
    # flat: the nested form's param groups list each stage's own parameters
    dcp.save({"model": dcp.get_model_state_dict(stage), "optim": dcp.get_optimizer_state_dict(stage, opt, options=FLAT)},
             ckpt_dir)
    return ckpt_dir


def test_stage_names_are_the_model_names():
    model = build_model(CFG, 0)
    names = [n for stage in split_stages(build_model(CFG, 0), 4) for n, _ in stage.named_parameters()]
    assert_all_ranks(sorted(names) == sorted(n for n, _ in model.named_parameters()), f"{names}")


@pytest.mark.parametrize("pp", ["world", "none", "plain"])
def test_saved_on_2d_mesh_at_pp2_loads_at_another_degree(saved_at_pp2, pp):
    """Saved from the 2-D (pp, dp) mesh at PP = 2; loaded with ``world``: one stage per
    rank; ``none``: the whole model, FSDP over all ranks;
    ``plain``: the whole model unsharded on every rank."""
    if pp == "world":
        module = _stage(WORLD.size, TARGET_SEED)
    elif pp == "none":
        module = fully_shard(build_model(CFG, TARGET_SEED), mesh=init_device_mesh("cpu", (WORLD.size,)))
    else:
        module = build_model(CFG, TARGET_SEED)
    opt = _load_into(module, saved_at_pp2)
    differ = _differences(module, opt, *_reference())
    assert_all_ranks(not differ, f"differ from the saved values: {differ}")


def test_flat_optimizer_state_dict_is_torchs():
    """``flatten_optimizer_state_dict`` gives torch's flat keys and values, and sets back."""
    from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

    model = build_model(CFG, SAVED_SEED)
    opt = _step(model)
    flat = dcp.get_optimizer_state_dict(model, opt, options=FLAT)
    torchs = _flatten_optim_state_dict(dcp.get_optimizer_state_dict(model, opt))
    same = flat.keys() == torchs.keys() and all(
        torch.equal(v, torchs[k]) if isinstance(v, torch.Tensor) else v == torchs[k] for k, v in flat.items())
    fresh = build_model(CFG, TARGET_SEED)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=TARGET_LR)
    dcp.set_optimizer_state_dict(fresh, fresh_opt, flat, options=FLAT)
    differ = _differences(fresh, fresh_opt, {n: p.detach() for n, p in fresh.named_parameters()}, _reference()[1])
    assert_all_ranks(same and not differ, f"torch's keys: {same}; differ after set: {differ}")
