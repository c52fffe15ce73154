"""The plan of an op on a rank outside its DTensors' mesh (a sub-mesh such as ``[0, 2]`` of 4).

torch lets every rank take part in ops on a sub-mesh: a rank outside it holds an empty
local tensor, runs no collective and gets default results (torch's ``_dispatch``): an
empty tensor of the output's dtype (a 0-d zero for a 0-d output) for each tensor output,
``None`` for a number, ``True`` for ``equal``, the written arguments themselves for an
in-place or ``out=`` op. The outputs' global shapes come from meta tensors and their
placements from the op's rule (``Replicate`` where it has none), so every rank holds the
same metadata.
"""
from __future__ import annotations

import torch

from ..tensor.dtensor import DTensor
from ..ops import registry
from ..tensor.spec import DTensorSpec
from .args import mutated_inputs, replace_tensors, tensors

__all__ = ["OutsidePlan", "make_outside_plan"]

_EQUAL = torch.ops.aten.equal.default


class OutsidePlan:
    """Default results for a rank outside the mesh; nothing runs, nothing moves."""

    __slots__ = ("written", "constant", "specs", "shaped")

    def __init__(self, written, constant, specs, shaped) -> None:
        self.written, self.constant, self.specs, self.shaped = written, constant, specs, shaped

    def __call__(self, args, kwargs):
        if self.written:
            outs = [args[i] if kind == "pos" else kwargs[i] for kind, i in self.written]
            return outs[0] if len(outs) == 1 else tuple(outs)
        if self.specs is None:
            return self.constant
        results = iter(DTensor(_empty(spec), spec, requires_grad=False) for spec in self.specs)
        return self.shaped(results)


def _empty(spec: DTensorSpec) -> torch.Tensor:
    return torch.zeros((), dtype=spec.dtype) if len(spec.shape) == 0 else torch.tensor([], dtype=spec.dtype)


def make_outside_plan(func, args, kwargs, specs, mesh, out_meta, rule) -> OutsidePlan:
    """The plan of ``func`` on a rank outside ``mesh``. ``out_meta``: the op's outputs on
    meta tensors (None: it returns none; anything else not a tensor: a number)."""
    written = mutated_inputs(func, args)
    if written:
        return OutsidePlan(written, None, None, None)
    metas = [t for t in registry._flatten(out_meta) if isinstance(t, torch.Tensor)] \
        if isinstance(out_meta, (torch.Tensor, list, tuple)) else []
    if not metas:
        return OutsidePlan([], True if func is _EQUAL else None, None, None)
    placements = _rule_placements(func, args, kwargs, specs, mesh, out_meta, rule, len(metas))
    out_specs = [DTensorSpec(mesh, p, m.shape, m.stride(), m.dtype) for m, p in zip(metas, placements)]
    if isinstance(out_meta, torch.Tensor):
        return OutsidePlan([], None, out_specs, next)
    kind = type(out_meta)
    return OutsidePlan([], None, out_specs, lambda results: kind(
        next(results) if isinstance(m, torch.Tensor) else m for m in out_meta))


def _rule_placements(func, args, kwargs, specs, mesh, out_meta, rule, count: int) -> list[tuple]:
    """The output placements the op's rule gives (as on the mesh's ranks), else Replicate."""
    replicated = [registry.replicated(mesh.ndim)] * count
    if rule is None:
        return replicated
    n_args = len(tensors(args))
    call = registry.OpCall(func, replace_tensors(args, specs), replace_tensors(kwargs, specs[n_args:]),
                           mesh, out_meta, specs)
    sharding = rule(call)
    if sharding is None or len(sharding.outputs) != count or any(p is None for p in sharding.outputs):
        return replicated
    return [tuple(p) for p in sharding.outputs]
