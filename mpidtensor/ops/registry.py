"""The sharding-rule registry: what each op family module declares.

A rule gets an :class:`OpCall` (the op, its arguments with every tensor replaced
by its :class:`DTensorSpec`, and the output metadata computed on meta tensors)
and returns a :class:`Sharding`: the placements each tensor input must have,
the placements of each tensor output, and optionally how to run the op locally
when the local op differs from the global one (e.g. a ``view`` whose size
argument must become the local size). Rules run once per op signature; their
result is cached by the dispatcher, so they may be slow but must be pure.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch

from ..tensor.placements import Partial, Placement, Replicate, Shard, _StridedShard, shard_dim
from ..tensor.spec import DTensorSpec

Placements = tuple[Placement, ...]


@dataclass
class OpCall:
    """One call of an op, as a rule sees it."""

    func: torch._ops.OpOverload
    args: tuple  # tensors replaced by DTensorSpec
    kwargs: dict
    mesh: Any  # DeviceMesh
    out_meta: Any  # the op's output on meta tensors (same structure)
    tensor_specs: list[DTensorSpec]  # every tensor input, in flattened argument order

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def bound(self) -> dict:
        """The arguments by schema name; absent ones take their default (or None)."""
        out = {}
        for i, arg in enumerate(self.func._schema.arguments):
            if i < len(self.args) and not arg.kwarg_only:
                out[arg.name] = self.args[i]
            elif arg.name in self.kwargs:
                out[arg.name] = self.kwargs[arg.name]
            else:
                out[arg.name] = arg.default_value if arg.has_default_value() else None
        return out

    def out_metas(self) -> list[torch.Tensor]:
        """Output meta tensors in flattened order."""
        return [t for t in _flatten(self.out_meta) if isinstance(t, torch.Tensor)]


@dataclass
class Sharding:
    """A rule's decision.

    ``inputs``: target placements for each tensor input (flattened order); ``None``
    keeps that input as it is. ``outputs``: placements of each tensor output
    (flattened order). ``local``: a callable ``(args, kwargs) -> result`` run on the
    local tensors instead of ``func(*args, **kwargs)``; it receives the call's
    arguments with tensors replaced by the local tensors, already redistributed.
    """

    inputs: Sequence[Placements | None]
    outputs: Sequence[Placements]
    local: Callable | None = None
    notes: dict = field(default_factory=dict)


Rule = Callable[[OpCall], Sharding]
_RULES: dict[torch._ops.OpOverload, Rule] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    """Register a rule for op overloads or packets (a packet registers all its overloads)."""

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            for overload in _overloads(op):
                _RULES[overload] = rule
        return rule

    return decorate


def rule_for(func: torch._ops.OpOverload) -> Rule | None:
    return _RULES.get(func)


def restore_rule(func: torch._ops.OpOverload, rule: Rule | None) -> None:
    """Give ``func`` back a rule ``rule_for`` returned earlier (None: no rule), after a
    ``register`` replaced it for a while (the context-parallel dispatcher does)."""
    if rule is None:
        _RULES.pop(func, None)
    else:
        _RULES[func] = rule


def takes_strided(rule: Rule) -> Rule:
    """Mark a rule that places ``_StridedShard`` inputs itself (the pointwise ones)."""
    rule.takes_strided = True
    return rule


def strided_safe(rule: Rule) -> Rule:
    """``rule``, made safe for ``_StridedShard`` inputs when it does not place them itself:
    a call with one is shown to it with those mesh dims ``Replicate``, and each such input
    the rule would keep is moved there, so the rule decides on the placements it knows.
    Planning-time only (the dispatcher and the fast paths ask rules through this)."""
    if getattr(rule, "takes_strided", False):
        return rule

    def safe(call: OpCall) -> Sharding | None:
        plain = [_without_strided(s) for s in call.tensor_specs]
        if all(p is s for p, s in zip(plain, call.tensor_specs)):
            return rule(call)
        swap = {id(s): p for s, p in zip(call.tensor_specs, plain)}
        shown = replace(call, args=_swap_specs(call.args, swap), kwargs=_swap_specs(call.kwargs, swap),
                        tensor_specs=plain)
        sharding = rule(shown)
        if sharding is None:
            return None
        inputs = [p.placements if t is None and p is not s else t
                  for t, p, s in zip(sharding.inputs, plain, call.tensor_specs)]
        return replace(sharding, inputs=inputs)

    return safe


def _without_strided(spec: DTensorSpec) -> DTensorSpec:
    if not any(type(p) is _StridedShard for p in spec.placements):
        return spec
    return spec.with_placements([Replicate() if type(p) is _StridedShard else p for p in spec.placements])


def _swap_specs(obj, swap: dict):
    if isinstance(obj, DTensorSpec):
        return swap.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap_specs(x, swap) for x in obj)
    if isinstance(obj, dict):
        return {k: _swap_specs(v, swap) for k, v in obj.items()}
    return obj


def _overloads(op) -> Iterable[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _flatten(obj) -> list:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    return [obj]


# --- helpers shared by rules -------------------------------------------------------------------

COST = {"all_gather": 1.0, "all_to_all": 0.5, "all_reduce": 2.0, "reduce_scatter": 1.0, "chunk": 0.0}


def transition_cost(current: Placement, target: Placement) -> float:
    """Relative bytes moved to take one mesh dim from ``current`` to ``target``."""
    if current == target:
        return 0.0
    if isinstance(current, Partial):
        return COST["reduce_scatter" if shard_dim(target) is not None else "all_reduce"]
    if shard_dim(current) is not None:
        return COST["all_to_all" if shard_dim(target) is not None else "all_gather"]
    return 0.01  # a local chunk or partition


def redistribute_cost(spec: DTensorSpec, target: Placements) -> float:
    """A rough byte count for moving ``spec`` to ``target`` (0 when nothing moves)."""
    if spec.placements == target:
        return 0.0
    nbytes = max(spec.shape.numel(), 1) * spec.dtype.itemsize
    return nbytes * (sum(transition_cost(c, t) for c, t in zip(spec.placements, target)) + 1e-9)


def cheapest(call: OpCall, candidates: Iterable[Sharding]) -> Sharding:
    """The candidate whose input redistributions move the fewest bytes (first wins ties)."""
    best, best_cost = None, None
    for cand in candidates:
        cost = sum(
            redistribute_cost(spec, target)
            for spec, target in zip(call.tensor_specs, cand.inputs)
            if target is not None
        )
        if best_cost is None or cost < best_cost:
            best, best_cost = cand, cost
    return best


def valid_placements(placements: Placements, ndim: int) -> bool:
    """Whether every ``Shard`` (or ``_StridedShard``) in ``placements`` names one of a tensor's ``ndim`` dims."""
    return all(shard_dim(p) is None or 0 <= p.dim < ndim for p in placements)


def replicated(ndim: int) -> Placements:
    return (Replicate(),) * ndim


def replicate_all(call: OpCall) -> Sharding:
    """Every input replicated, every output replicated: always correct."""
    rep = replicated(call.ndim)
    return Sharding([rep] * len(call.tensor_specs), [rep] * len(call.out_metas()))


def same_as_input(call: OpCall, index: int = 0) -> Sharding:
    """Outputs keep the placements of input ``index``; the other inputs match them."""
    placements = call.tensor_specs[index].placements
    return Sharding([placements] * len(call.tensor_specs), [placements] * len(call.out_metas()))


def broadcast_placements(placements: Placements, out_shape: Sequence[int], spec: DTensorSpec) -> Placements:
    """The placements an input ``spec`` needs to feed an output laid out as ``placements``
    when the op broadcasts it to ``out_shape``: a shard of an output dim that the input
    has at full size shards the input's matching dim; a shard of a dim the input lacks
    or broadcasts (size 1) replicates it, so no rank gets an empty or mismatched block."""
    lead = len(out_shape) - spec.ndim
    result = []
    for p in placements:
        if shard_dim(p) is not None:
            d = p.dim - lead
            if d < 0 or spec.shape[d] != out_shape[p.dim]:
                p = Replicate()
            else:
                p = Shard(d) if isinstance(p, Shard) else _StridedShard(d, split_factor=p.split_factor)
        result.append(p)
    return tuple(result)

