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
whose backward is whole (GPipe, 1F1B, Interleaved 1F1B, looped BFS); :func:`problems`
names the others, which the schedules refuse at construction on every rank.
"""
from __future__ import annotations

from torch import nn

from ..fsdp import FSDPModule

__all__ = ["before_backward", "problems"]


def before_backward(module: nn.Module, last: bool) -> None:
    """Set ``module``'s FSDP switches for its next backward: ``last`` is whether it is the
    stage's last backward of the step. Nothing for a module that is not ``fully_shard``-ed."""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)
        module.set_requires_gradient_sync(last)


def problems(schedule: str, modules: list[tuple[int, nn.Module]], kinds: set[str]) -> list[str]:
    """Why this rank's stage modules (``(stage index, module)``) cannot run under
    ``schedule``, whose actions here are of ``kinds``: a ``fully_shard``-ed module under a
    split backward (``I``/``W``)."""
    if not {"I", "W"} & kinds:
        return []
    return [f"{schedule} splits the backward into input and weight gradients (zero bubble), but FSDP "
            f"reduces gradients at the end of a whole backward: the fully_shard-ed module of stage {i} "
            "needs GPipe, 1F1B, Interleaved1F1B or LoopedBFS" for i, m in modules if isinstance(m, FSDPModule)]
