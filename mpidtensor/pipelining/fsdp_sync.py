"""FSDP inside a pipeline stage: gradients reduced once per step, not per micro-batch.

A stage runs one backward per micro-batch. With a ``fully_shard``-ed stage module, every
backward but the last of the step keeps its unsharded gradients locally (no
reduce-scatter) and its parameters gathered (no all-gather per micro-batch); the last one
reduce-scatters the sum over the micro-batches, waits for it and reshards. These are
FSDP's own switches (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``), set before each backward as torch's pipeline stages do.

The zero-bubble schedules split a backward into input gradients (``I``) and weight
gradients (``W``, later), so no backward of theirs is the last whole one: every ``I`` and
``W`` runs with the switches off, and once the step's actions are done
:func:`reduce_held` reduces what they kept (torch's ``perform_reduce_grad``). After a step
the switches are back at FSDP's defaults (all ``True``), so the module behaves as before
outside the pipeline.
"""
from __future__ import annotations

import torch
from torch import nn

from ..fsdp import FSDPModule
from ..fsdp.state import state_of

__all__ = ["autograd_parameters", "before_backward", "reduce_held"]


def before_backward(module: nn.Module, last: bool) -> None:
    """Set ``module``'s FSDP switches for its next backward: ``last`` is whether it is the
    stage's last whole backward of the step. Nothing for a module that is not
    ``fully_shard``-ed."""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)
        module.set_requires_gradient_sync(last)


def autograd_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The tensors autograd recorded for ``module``'s parameters (those requiring
    gradients): for a parameter ``fully_shard`` manages, its unsharded form (the same
    tensor every all-gather refills), whichever form the module holds now; a split
    backward's ``W`` asks for their gradients after later forwards may have resharded."""
    unsharded = {}
    for sub in module.modules():
        state = state_of(sub)
        if state is not None and state.group is not None:
            for fp in state.group.params:
                if fp.unsharded is not None:
                    unsharded[id(fp.sharded)] = fp.unsharded
    return [unsharded.get(id(p), p) for p in module.parameters() if p.requires_grad]


def reduce_held(module: nn.Module) -> None:
    """End of a step: the switches back on; the gradients backwards with them off kept
    (a split backward's ``I`` and ``W``) reduce-scattered, waited for, resharded. Collective
    over the module's data-parallel ranks, which run the same stages."""
    if isinstance(module, FSDPModule):
        before_backward(module, True)
        state = state_of(module)
        if state is not None:
            state.reduce_held()
