"""FSDP inside a pipeline stage: gradients reduced once per step, not per micro-batch.

A stage runs one backward per micro-batch. With a ``fully_shard``-ed stage module, every
backward but the last of the step keeps its unsharded gradients locally (no
reduce-scatter) and its parameters gathered (no all-gather per micro-batch); the last one
reduce-scatters the sum over the micro-batches, waits for it and reshards. These are
FSDP's own switches (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``), set before each backward as torch's pipeline stages do. After
a step they are back at FSDP's defaults (all ``True``), so the module behaves as before
outside the pipeline.

The zero-bubble schedules split a backward into input gradients (``I``) and weight
gradients (``W``) computed later; FSDP's reduction runs at the end of a backward pass,
so with those a stage's last ``W`` would come after it: PP x FSDP is for the schedules
whose backward is whole (GPipe, 1F1B, the interleaved and looped ones).
"""
from __future__ import annotations

from torch import nn

from ..fsdp import FSDPModule

__all__ = ["before_backward"]


def before_backward(module: nn.Module, last: bool) -> None:
    """Set ``module``'s FSDP switches for its next backward: ``last`` is whether it is the
    stage's last backward of the step. Nothing for a module that is not ``fully_shard``-ed."""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)
        module.set_requires_gradient_sync(last)
