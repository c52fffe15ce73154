"""``register_sharding``: a user's sharding strategies for an op, the cheapest one chosen.

The strategy function gets the op's arguments with every tensor replaced by its
:class:`~mpidtensor.tensor.spec.DTensorSpec` (``.placements``, ``.shape``, ``.ndim``,
``.mesh``) and returns the acceptable shardings for ONE mesh dimension, as pairs
``(output_placements, input_placements)``: one entry per op output, then one per
argument the function received (``None`` for non-tensor arguments; a placement given
for a list of tensors applies to each). On an n-D mesh every combination of one pair
per mesh dimension is a candidate; dispatch takes the one whose input redistributions
move the fewest bytes (:func:`mpidtensor.ops.registry.cheapest`, first wins ties). The
strategy is an ordinary rule of :mod:`mpidtensor.ops.registry`, so it replaces any
built-in rule of the op and is planned once per op signature.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import torch

from ..ops import registry
from ..runtime import caches
from ..tensor.placements import Placement, normalize_placements
from ..tensor.spec import DTensorSpec

__all__ = ["register_sharding"]

PlacementList = Sequence[Placement | None]
StrategyFn = Callable[..., Sequence[tuple[PlacementList, PlacementList]]]


def register_sharding(op) -> Callable[[StrategyFn], StrategyFn]:
    """Decorator registering ``fn`` as the sharding strategy of ``op`` (an ``OpOverload``,
    an overload packet, a ``torch.library.custom_op`` object, or a list of them)."""
    ops = [_as_op(o) for o in (op if isinstance(op, (list, tuple)) else [op])]

    def decorate(fn: StrategyFn) -> StrategyFn:
        registry.register(*ops)(_strategy_rule(fn))
        caches.clear_all()  # plans made before hold the old rule's decision
        return fn

    return decorate


def _as_op(op):
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op
    overload = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(overload, torch._ops.OpOverload):
        return overload
    raise TypeError(f"register_sharding needs an OpOverload (e.g. torch.ops.ns.op.default), got {op!r}")


def _strategy_rule(fn: StrategyFn) -> registry.Rule:
    def rule(call: registry.OpCall) -> registry.Sharding:
        op = call.func
        pairs = list(fn(*call.args, **call.kwargs))
        if not pairs:
            raise ValueError(f"register_sharding strategy for {op} returned no shardings")
        per_dim = [_one_mesh_dim(op, call, i, pair) for i, pair in enumerate(pairs)]
        candidates = [
            registry.Sharding(_by_tensor(c, "inputs"), _by_tensor(c, "outputs"))
            for c in itertools.product(per_dim, repeat=call.ndim)
        ]
        valid = [c for c in map(functools.partial(_normalized, call), candidates) if c is not None]
        if not valid:
            raise ValueError(f"register_sharding strategy for {op}: no sharding fits these inputs ({call.tensor_specs})")
        return registry.cheapest(call, valid)

    return rule


def _one_mesh_dim(op, call: registry.OpCall, index: int, pair) -> dict:
    """One returned pair checked against the call, as per-tensor placements for one mesh dim."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"register_sharding strategy for {op}: sharding {index} must be a pair "
                         f"(output_placements, input_placements), got {pair!r}")
    outs, ins = pair
    if not isinstance(outs, (tuple, list)) or not isinstance(ins, (tuple, list)):
        raise ValueError(f"register_sharding strategy for {op}: sharding {index} must hold two lists "
                         f"(output_placements, input_placements), got {pair!r}")
    returns = _returns(call.out_meta, len(op._schema.returns))
    arguments = list(call.args) + list(call.kwargs.values())
    if len(outs) != len(returns):
        raise ValueError(f"register_sharding strategy for {op}: sharding {index} gives {len(outs)} output "
                         f"placements; the op has {len(returns)} outputs")
    if len(ins) != len(arguments):
        raise ValueError(f"register_sharding strategy for {op}: sharding {index} gives {len(ins)} input "
                         f"placements; the call has {len(arguments)} arguments (None for non-tensors)")
    return {
        "outputs": _expand(op, index, "output", outs, returns),
        "inputs": _expand(op, index, "input", ins, arguments),
    }


def _returns(out_meta, count: int) -> list:
    """The op's outputs, one entry per schema return."""
    if count == 0:
        return []
    return [out_meta] if count == 1 else list(out_meta)


def _expand(op, index: int, what: str, placements: PlacementList, values: list) -> list[Placement]:
    """One placement per tensor of ``values`` (flattened order) from one entry per value."""
    flat = []
    for k, (p, value) in enumerate(zip(placements, values)):
        n = _count_tensors(value)
        if n == 0 and p is not None:
            raise ValueError(f"register_sharding strategy for {op}: sharding {index}, {what} {k} is not a "
                             f"tensor and must be None, got {p!r}")
        if n and not isinstance(p, Placement):
            raise ValueError(f"register_sharding strategy for {op}: sharding {index}, {what} {k} is a tensor "
                             f"and needs a Placement, got {p!r}")
        flat.extend([p] * n)
    return flat


def _count_tensors(value) -> int:
    if isinstance(value, (DTensorSpec, torch.Tensor)):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count_tensors(v) for v in value)
    return 0


def _by_tensor(combination: tuple[dict, ...], key: str) -> list[tuple[Placement, ...]]:
    """Per-mesh-dim choices -> one placement tuple per tensor."""
    return [tuple(per_dim) for per_dim in zip(*(c[key] for c in combination))]


def _normalized(call: registry.OpCall, sharding: registry.Sharding) -> registry.Sharding | None:
    """``sharding`` with negative shard dims counted from the end; None if a Shard(d)
    names no dim of its tensor."""
    ndims = [s.ndim for s in call.tensor_specs] + [m.ndim for m in call.out_metas()]
    lists = list(sharding.inputs) + list(sharding.outputs)
    try:
        fixed = [normalize_placements(p, call.ndim, ndim) for p, ndim in zip(lists, ndims)]
    except ValueError:
        return None
    n = len(sharding.inputs)
    return registry.Sharding(fixed[:n], fixed[n:])
