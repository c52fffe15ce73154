"""Ask the dispatcher's sharding rule about a call, from specs alone.

A module fast path stands in for a few aten ops on DTensors (a Linear's ``mm``, a norm's
``native_layer_norm``, an embedding's lookup). Whether its local Function computes what
dispatch would is the rule's answer, not a restated placement check: ``rule_sharding``
builds the :class:`~mpidtensor.ops.registry.OpCall` the dispatcher builds (the output
metadata from meta tensors of the specs) and returns the rule's decision, and
``keeps_layout`` reads it: every input used where it lies, the outputs laid out as the
Function lays them. The paths ask once per set of specs and shapes and cache the verdict.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..dispatch.planner import rule_of
from ..ops import registry
from ..tensor.placements import Placement
from ..tensor.spec import DTensorSpec

__all__ = ["rule_sharding", "keeps_layout"]


def rule_sharding(func: torch._ops.OpOverload, args: tuple, mesh: Any) -> registry.Sharding | None:
    """The dispatcher rule's :class:`Sharding` for ``func(*args)``, tensors given as their
    ``DTensorSpec``; None where no rule places the call (the dispatcher would fall back)."""
    rule = rule_of(func)
    if rule is None:
        return None
    specs = [a for a in args if isinstance(a, DTensorSpec)]
    metas = iter([torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in specs])
    try:
        out_meta = func(*[next(metas) if isinstance(a, DTensorSpec) else a for a in args])
    except (RuntimeError, NotImplementedError):  # an invalid call, or no meta kernel: the general path decides
        return None
    return rule(registry.OpCall(func, args, {}, mesh, out_meta, specs))


def keeps_layout(func: torch._ops.OpOverload, args: tuple, mesh: Any,
                 outputs: Sequence[tuple[Placement, ...]]) -> bool:
    """Whether the rule for ``func(*args)`` moves no input and gives ``outputs`` (the first
    ``len(outputs)`` output placements): then the op's local kernel on the local blocks is
    what dispatch runs."""
    sharding = rule_sharding(func, args, mesh)
    if sharding is None:
        return False
    specs = [a for a in args if isinstance(a, DTensorSpec)]
    moved = any(t is not None and tuple(t) != s.placements for t, s in zip(sharding.inputs, specs))
    return not moved and [tuple(p) for p in sharding.outputs[:len(outputs)]] == [tuple(p) for p in outputs]
