"""Activation checkpointing (Hugging Face's ``gradient_checkpointing_enable``: each decoder
layer's forward runs again in backward, under ``torch.utils.checkpoint``, reentrant or
not) on the zoo's Llama and GPT-2 under FSDP2, TP + SequenceParallel and FSDP x TP: the
recomputed forward meets gathered parameters and DTensor activations again, and training
matches one process."""
import copy

import pytest

from helpers import assert_all_ranks
from zoo_models import STEPS, ZOO, check_trains_like_one_process, fully_shard_zoo

CASES = [("llama", False), ("llama", True), ("gpt2", False)]


def _checkpointed(name: str, reentrant: bool):
    zoo = ZOO[name]
    ref = zoo.build()
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    runs = []  # transformers checkpoints a layer's forward, not its call: its hooks (FSDP's) run once
    next(zoo.blocks(model)[0].children()).register_forward_pre_hook(lambda *_: runs.append(1))
    return zoo, ref, model, runs


def _recomputed(runs: list) -> None:
    """The first block's first submodule ran twice per step: forward, and again in backward."""
    assert_all_ranks(len(runs) == 2 * STEPS, f"the first block's submodule ran {len(runs)} times in {STEPS} steps")


@pytest.mark.parametrize("name, reentrant", CASES)
def test_checkpointed_fsdp_trains_like_one_process(name, reentrant, mesh1d):
    zoo, ref, model, runs = _checkpointed(name, reentrant)
    fully_shard_zoo(model, zoo, mesh1d)
    check_trains_like_one_process(model, ref, zoo.batches(), mesh1d.get_local_rank(), mesh1d.size(),
                                  mesh1d.get_group())
    _recomputed(runs)


@pytest.mark.parametrize("name, reentrant", CASES)
def test_checkpointed_tp_sp_trains_like_one_process(name, reentrant, mesh1d):
    zoo, ref, model, runs = _checkpointed(name, reentrant)
    zoo.sequence_parallel(model, mesh1d)
    check_trains_like_one_process(model, ref, zoo.batches())
    _recomputed(runs)


@pytest.mark.parametrize("name, reentrant", CASES)
def test_checkpointed_fsdp_tp_trains_like_one_process(name, reentrant, mesh2d):
    zoo, ref, model, runs = _checkpointed(name, reentrant)
    zoo.sequence_parallel(model, mesh2d["tp"])
    fully_shard_zoo(model, zoo, mesh2d["dp"])
    dp = mesh2d.get_group("dp")
    check_trains_like_one_process(model, ref, zoo.batches(), dp.rank, dp.size, dp)
    _recomputed(runs)
