"""Multi-tensor (``foreach``) kernels for DTensor parameters, on CPU too.

torch's optimizers take their ``foreach`` path by default only for CUDA-like devices; on
CPU they loop over the parameters, about 8 ops each (AdamW). For plain tensors that costs
a few µs per op; for DTensors every op is a trip through ``__torch_dispatch__`` (15-60 µs
on loaded cores), so the loop dominated a small model's step (docs/performance.md,
"The optimizer"). One ``_foreach_*`` op handles all parameters in one dispatch.

Two process-wide effects, installed at the first mesh (:mod:`mpidtensor.runtime.effects`):
DTensor joins torch's foreach type lists, as torch's DTensor does (``"foreach types"``),
and a global optimizer step pre-hook (``"optimizer foreach"``, the fast path
``optim.foreach``): for a parameter group whose ``foreach`` is left unset (None), not
``fused``, ``differentiable`` or ``capturable``, with a float learning rate, at least one
CPU DTensor and only plain local tensors (a tensor subclass inside, e.g. a quantized
weight, may not implement the ``_foreach_*`` ops: torch would not pick them for it
either), the step runs with ``foreach=True``; a post-hook sets it back, so ``state_dict``
keeps the user's setting. Same ops in the same order, so the same values. An explicit
``foreach=False`` is respected. The ``_foreach_*`` ops themselves go through dispatch and
the foreach sharding rule.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import (
    _foreach_supported_types as _optim_foreach_types,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types

from ..tensor.dtensor import DTensor
from ..runtime.effects import effect
from . import registry

__all__ = ["wants_foreach", "PATH", "HOOKS"]

PATH = registry.register(
    "optim.foreach",
    shortcuts="torch.optim's per-parameter loop (about 8 DTensor dispatches per parameter and step) for "
              "groups of CPU DTensor parameters left at foreach=None",
    decided_by="torch's own choice of multi-tensor kernels (_default_to_fused_or_foreach: plain foreach-"
               "supported tensor types, not differentiable), applied to the local tensors, the CPU device "
               "aside; the _foreach_* ops go through dispatch and the foreach rule")
HOOKS = "optimizer foreach"  # the effect's name
_SET = "_mpidtensor_foreach_groups"  # optimizer attribute: the groups the pre-hook changed


def wants_foreach(group: dict[str, Any]) -> bool:
    """Whether a parameter group left to torch's default should take the foreach path here:
    it holds a CPU DTensor, and nothing (see the module doc) rules the path out."""
    if "foreach" not in group or group["foreach"] is not None:
        return False
    if group.get("fused") or group.get("differentiable") or group.get("capturable"):
        return False
    if isinstance(group.get("lr"), torch.Tensor):  # torch keeps the loop for a tensor lr
        return False
    found = False
    for p in group["params"]:
        if type(p) is DTensor:
            if type(p._local_tensor) not in _optim_foreach_types:  # e.g. a quantized subclass
                return False
            found = found or not p.is_cuda
        elif type(p) not in _optim_foreach_types:
            return False
    return found


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _SET in optimizer.__dict__:  # a step that raised left its groups changed
        _after_step(optimizer, args, kwargs)
    if not registry.enabled():
        return
    changed = [group for group in optimizer.param_groups if wants_foreach(group)]
    for group in changed:
        group["foreach"] = True
    PATH.hits += len(changed)
    setattr(optimizer, _SET, changed)


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.__dict__.pop(_SET, ()):
        group["foreach"] = None


@effect("foreach types", "first mesh",
        "DTensor joins torch's foreach-supported type lists (torch.optim.optimizer, torch.utils._foreach_utils), "
        "as torch's DTensor does: optimizers and clip_grad_norm_ treat it as a plain tensor on its device")
def _register_types() -> None:
    for types in (_optim_foreach_types, _util_foreach_types):
        if DTensor not in types:
            types.append(DTensor)


@effect(HOOKS, "first mesh",
        "a global optimizer step pre-hook and post-hook: groups of CPU DTensor parameters left at "
        "foreach=None step with foreach=True (mpidtensor.fast.foreach)")
def _install_hooks() -> tuple:
    return register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)
