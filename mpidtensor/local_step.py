"""torch.optim steps on the local tensors of DTensor parameters.

An elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam)
updates each element of a parameter from the same element of its gradient and state,
so on a DTensor whose gradient and state share its spec the update is the local update
of every rank: dispatch would plan each op, unwrap every list and wrap every result for
no communication. On CPU that cost 0.5-0.7 ms of a 2 ms AdamW step over the demo's 21
FSDP parameters (docs/performance.md, "The optimizer"). A global step pre-hook therefore
runs such a step on the local tensors themselves: for the step, each qualifying
parameter group holds the parameters' local tensors (their ``.grad`` the gradients'
local tensors) and ``optimizer.state`` a shadow whose entries hold the states' local
tensors; the post-hook puts the groups and the state back and wraps any state the step
created (first step, SGD's momentum buffer) as DTensors of the parameter's spec. Same
ops on the same values, so bit for bit the DTensor path's result. The choice of kernels
(``foreach``) is left to ``mpidtensor.foreach``, whose pre-hook, registered first, sees
the DTensor parameters.

A group qualifies when ``differentiable`` and ``capturable`` are off, it holds a DTensor
parameter, and every DTensor parameter's local tensor is a plain tensor and its gradient
and tensor states are DTensors of its own spec (or the states are 0-d step counts).
Anything else (a Replicate gradient of a Shard parameter, a quantized local tensor, a
subclass of these optimizers, ``torch.compile``) takes the DTensor path as before.

A step that raises leaves the swap in place until the next step, ``state_dict()`` or
``load_state_dict()``, which restore it first (and a ``zero_grad()`` run in between
reaches the parameters). ``MPIDTENSOR_LOCAL_OPTIM_STEP=0`` turns the path off.
"""
from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .dtensor import DTensor

ENABLED = os.environ.get("MPIDTENSOR_LOCAL_OPTIM_STEP", "1") != "0"

# torch's elementwise optimizers, by exact type: a subclass may add non-elementwise work
ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
})

_SWAP = "_mpidtensor_local_step"  # optimizer attribute: the _Swap in place
_HOOKED = "_mpidtensor_local_step_hooks"  # optimizer attribute: its state_dict hooks are registered
_handles = None


class _Swap:
    """What a swapped step changed: ``(group, params)`` per group, the real state,
    and ``(parameter, local tensor)`` of every DTensor parameter swapped."""

    __slots__ = ("groups", "state", "pairs")

    def __init__(self, groups: list, state: defaultdict, pairs: list) -> None:
        self.groups, self.state, self.pairs = groups, state, pairs


def _qualifies(group: dict, state: defaultdict) -> bool:
    """Whether ``group``'s step may run on local tensors (see the module doc)."""
    if group.get("differentiable") or group.get("capturable"):
        return False
    found = False
    for p in group["params"]:
        if type(p) is not DTensor:
            continue
        spec = p._spec
        if type(p._local_tensor) is not torch.Tensor:
            return False
        g = p.grad
        if g is not None and (type(g) is not DTensor or g._spec is not spec):
            return False
        for v in state.get(p, {}).values():
            if type(v) is DTensor:
                if v._spec is not spec:
                    return False
            elif isinstance(v, torch.Tensor) and v.dim():
                return False
        found = True
    return found


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    restore(optimizer)  # a step that raised left its swap in place
    if not ENABLED or type(optimizer) not in ELEMENTWISE or torch.compiler.is_compiling():
        return
    state = optimizer.state
    groups = [g for g in optimizer.param_groups if _qualifies(g, state)]
    if not groups:
        return
    if not getattr(optimizer, _HOOKED, False):
        optimizer.register_state_dict_pre_hook(restore)
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: restore(opt))
        setattr(optimizer, _HOOKED, True)
    shadow = defaultdict(dict, state)  # the other groups' entries as they are
    saved, pairs = [], []
    for group in groups:
        params = group["params"]
        saved.append((group, params))
        locals_ = []
        for p in params:
            if type(p) is not DTensor:
                locals_.append(p)
                continue
            local = p._local_tensor
            g = p.grad
            local.grad = None if g is None else g._local_tensor
            entry = state.get(p)
            if entry:
                shadow[local] = {k: v._local_tensor if type(v) is DTensor else v for k, v in entry.items()}
            pairs.append((p, local))
            locals_.append(local)
        group["params"] = locals_
    optimizer.state = shadow
    setattr(optimizer, _SWAP, _Swap(saved, state, pairs))


def restore(optimizer: torch.optim.Optimizer, *_) -> None:
    """Put back what a swapped step changed (no-op without one); the step's new or
    replaced states become DTensors of their parameter's spec."""
    swap = optimizer.__dict__.pop(_SWAP, None)
    if swap is None:
        return
    shadow, state = optimizer.state, swap.state
    for group, params in swap.groups:
        group["params"] = params
    swapped = set()
    for p, local in swap.pairs:
        swapped.add(local)
        if local.grad is None and p.grad is not None:  # a zero_grad() ran on the swapped groups
            p.grad = None
        local.grad = None
        new = shadow.get(local)
        if not new:
            continue
        entry = state[p]
        for k, v in new.items():
            old = entry.get(k)
            if type(old) is DTensor and old._local_tensor is v:
                continue
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == local.shape and v.dtype == p.dtype:
                v = DTensor(v, p._spec)
            entry[k] = v
    for key, entry in shadow.items():  # entries the step made for other parameters
        if key not in swapped:
            state[key] = entry
    optimizer.state = state


def install() -> None:
    """Register the step hooks (once per process)."""
    global _handles
    if _handles is None:
        _handles = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(restore))
