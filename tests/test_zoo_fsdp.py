"""The model zoo under FSDP2: each Hugging Face model with ``fully_shard`` on every block and
on the root trains like one process (losses, first gradients and every parameter over
several AdamW steps, each rank on its shard of the batch); ``generate()`` on an FSDP-wrapped decoder gives the
unsharded model's tokens."""
import copy

import pytest
import torch

import mpidtensor.fsdp as fsdp
from helpers import assert_all_ranks
from mpidtensor import DTensor
from zoo_models import ZOO, check_trains_like_one_process, fully_shard_zoo


@pytest.mark.parametrize("name", list(ZOO))
def test_fsdp_trains_like_one_process(name, mesh1d, world):
    zoo = ZOO[name]
    ref = zoo.build()
    model = fully_shard_zoo(copy.deepcopy(ref), zoo, mesh1d)
    assert_all_ranks(all(isinstance(p, DTensor) for p in model.parameters()), "a parameter is not sharded")
    check_trains_like_one_process(model, ref, zoo.batches(), world.rank, world.size, world)


@pytest.mark.parametrize("registered", [False, True])
def test_generate_matches_unsharded_model(registered, mesh1d):
    """Greedy ``generate()`` on the FSDP-wrapped Llama gives the unsharded model's tokens:
    as is (each forward unshards the blocks and the root), and with
    ``register_fsdp_forward_method(model, "generate")`` (``generate`` itself unshards the
    root's parameters)."""
    if registered and not hasattr(fsdp, "register_fsdp_forward_method"):
        pytest.skip("mpidtensor.fsdp has no register_fsdp_forward_method")
    zoo = ZOO["llama"]
    ref = zoo.build().eval()
    model = fully_shard_zoo(copy.deepcopy(ref), zoo, mesh1d)
    if registered:
        fsdp.register_fsdp_forward_method(model, "generate")
    prompt = zoo.batches(1)[0][0]["input_ids"][:2, :4]
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=6, do_sample=False)
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert_all_ranks(torch.equal(tokens, expected), f"{tokens.tolist()} != {expected.tolist()}")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_save_pretrained_from_a_full_state_dict(layout, mesh1d, ckpt_dir):
    """transformers' ``save_pretrained`` reads storage pointers, which a DTensor has not: an
    FSDP or TP model is saved from its gathered state dict (as with torch's FSDP2), rank 0
    writing, and ``from_pretrained`` reads back the unsharded model's values."""
    import transformers

    from mpidtensor.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    zoo = ZOO["llama"]
    ref = zoo.build()
    model = copy.deepcopy(ref)
    if layout == "fsdp":
        fully_shard_zoo(model, zoo, mesh1d)
    else:
        zoo.tensor_parallel(model, mesh1d)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    path = f"{ckpt_dir}/{layout}"
    if mesh1d.get_rank() == 0:
        model.save_pretrained(path, state_dict=state)
    mesh1d.get_group().Barrier()
    back = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    differ = [k for k, v in ref.state_dict().items() if not torch.equal(back[k], v)]
    assert_all_ranks(not differ, f"differ after the round trip: {differ}")
