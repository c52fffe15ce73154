"""Pointwise ops: every aten op tagged ``torch.Tag.pointwise``, their in-place forms,
the ``_foreach_*`` list ops and the fused optimizer steps (``_fused_adamw_``...), which
are elementwise over their lists of parameters and states.

Per mesh dim the output is sharded like one of the inputs, replicated, or (for
linear ops) kept ``Partial``; the choice moving the fewest bytes wins. Inputs
broadcast along a dim cannot be sharded along it and are replicated there. A
``_StridedShard`` input is followed like a ``Shard``: every input sharded alike holds
the same positions of the output, so the local op is the global one's block.
"""
from __future__ import annotations

import torch

from ..tensor.placements import Partial, Placement, Replicate, Shard, _StridedShard
from ..tensor.spec import DTensorSpec
from .registry import COST, OpCall, Sharding, register, replicated, takes_strided, transition_cost

aten = torch.ops.aten

# Linear in all tensor operands together: Partial inputs (same op) give a Partial output.
_ADDITIVE = {"add", "sub", "add_", "sub_"}
# Linear in one tensor operand when the others are not Partial (the first operand for division).
_SCALING = {"mul", "mul_", "div", "div_", "neg", "neg_", "clone", "positive", "alias", "real", "imag"}
# Elementwise max/min: max(max_r a_r, max_r b_r) = max_r max(a_r, b_r), so Partial("max") inputs
# (and replicas) give a Partial("max") output with no collective (min alike).
_EXTREMUM = {"maximum": "max", "minimum": "min"}


def is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags


def placement_ignores_scalars(func) -> bool:
    """Whether the op's placements and output metadata depend on its scalar arguments'
    types only, never their values (pointwise, ``_foreach_*`` and fused optimizer ops):
    dispatch then keys scalars by type, so a learning rate or per-parameter step sizes
    that change every step reuse one plan."""
    name = func._schema.name.split("::")[-1]
    return is_pointwise(func) or name.startswith("_foreach_") and name not in _FOREACH_NOT_POINTWISE or name in _FUSED


def _linearity(func) -> str | None:
    name = func._schema.name.split("::")[-1].removeprefix("_foreach_")
    if name in _ADDITIVE and func._overloadname in ("Tensor", "List"):
        return "additive"
    if name in _SCALING:
        return "scaling"
    if name in _EXTREMUM:
        return _EXTREMUM[name]
    if name in ("max", "min") and func._overloadname == "other":  # torch.max(a, b)
        return name
    return None


def _is_inplace(func) -> bool:
    return func._schema.name.endswith("_")


@takes_strided
def pointwise_rule(call: OpCall) -> Sharding:
    out = call.out_metas()[0]
    inputs, output = _choose(call.func, call.tensor_specs, out.shape, call.ndim)
    return Sharding(inputs, [output] * len(call.out_metas()))


@takes_strided
def _foreach_rule(call: OpCall) -> Sharding:
    """``_foreach_op(list, list | tensor | scalar, ...)`` and the fused optimizer steps: the
    pointwise choice made per list position (an in-place op keeps its first list's
    placements). A lone tensor argument (a scalar tensor, a tensor learning rate) is
    replicated."""
    lists = [a for a in list(call.args) + list(call.kwargs.values()) if isinstance(a, (list, tuple))
             and a and all(isinstance(x, DTensorSpec) for x in a)]
    n = len(lists[0])
    choices = []
    for j in range(n):
        group = [lst[j] for lst in lists]
        choices.append(_choose(call.func, group, group[0].shape, call.ndim))
    inputs = []
    for a in list(call.args) + list(call.kwargs.values()):
        if isinstance(a, DTensorSpec):
            inputs.append(replicated(call.ndim))
        elif any(a is lst for lst in lists):
            k = next(i for i, lst in enumerate(lists) if lst is a)
            inputs += [choices[j][0][k] for j in range(n)]
        elif isinstance(a, (list, tuple)):
            inputs += [replicated(call.ndim) for x in a if isinstance(x, DTensorSpec)]
    outputs = [choices[j][1] for j in range(n)] if call.out_metas() else []
    return Sharding(inputs, outputs)


# Elementwise but not tagged pointwise in torch.
register(aten.real, aten.imag, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)(pointwise_rule)


def _register_foreach() -> None:
    names = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")}
    for name in sorted(names - _FOREACH_NOT_POINTWISE):
        register(getattr(aten, name))(_foreach_rule)


_FOREACH_NOT_POINTWISE = {"_foreach_norm", "_foreach_max", "_foreach_mm", "_foreach_powsum"}
# torch's fused optimizer kernels (``fused=True``): in place on lists of same-shaped tensors
_FUSED = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}


def _choose(func, specs, out_shape, mesh_ndim: int):
    """Per mesh dim, the cheapest (output placement, input placements) pair.

    An in-place op keeps its self argument's placement where an option does; where none
    does (``clamp_`` of a Partial) self is reduced first and takes the new placement, so
    the value equals one process's. torch refuses that case; mpidtensor does not, because
    torch's own decompositions write in place into Partial intermediates (``rms_norm``'s
    ``add_`` of eps to the mean of a dim sharded across ranks)."""
    linearity = _linearity(func)
    divides = func._schema.name.split("::")[-1] in ("div", "div_")
    inplace = _is_inplace(func)
    ins: list[list[Placement]] = [[] for _ in specs]
    out: list[Placement] = []
    for m in range(mesh_ndim):
        options = _options(specs, out_shape, m, linearity, divides)
        if inplace:  # self keeps its placement where an option does
            options = [o for o in options if o[0] == specs[0].placements[m]] or options
        best = min(options, key=lambda o: _cost(specs, m, o[1]))
        out.append(best[0])
        for i, p in enumerate(best[1]):
            ins[i].append(p)
    return [tuple(p) for p in ins], tuple(out)


def _options(specs, out_shape, m: int, linearity: str | None, divides: bool):
    """Candidate (output placement, input placements) pairs at mesh dim ``m``."""
    out_ndim = len(out_shape)
    current = tuple(s.placements[m] for s in specs)
    options = [(Replicate(), tuple(Replicate() for _ in specs))]

    def shard_all(od: int, split_factor: int):
        def like(d):
            return Shard(d) if split_factor == 0 else _StridedShard(d, split_factor=split_factor)

        targets = []
        for s in specs:
            d = od - (out_ndim - s.ndim)
            targets.append(like(d) if d >= 0 and s.shape[d] == out_shape[od] else Replicate())
        return (like(od), tuple(targets))

    shard_dims = set()  # (output dim, split factor: 0 for a Shard)
    for s, p in zip(specs, current):
        if isinstance(p, (Shard, _StridedShard)):
            od = p.dim + out_ndim - s.ndim
            if s.shape[p.dim] == out_shape[od]:
                shard_dims.add((od, p.split_factor if isinstance(p, _StridedShard) else 0))
    partials = [p for p in current if isinstance(p, Partial)]
    if partials:
        shard_dims.update((od, 0) for od in range(out_ndim))  # a reduce-scatter can feed any output shard
    options += [shard_all(od, sf) for od, sf in sorted(shard_dims)]
    if partials and len(set(partials)) == 1 and partials[0].reduce_op in ("sum", "avg"):
        p = partials[0]
        if linearity == "additive" and len(partials) == len(specs) >= 2:  # x + scalar is not linear
            options.append((p, current))
        elif linearity == "additive" and len(specs) >= 2 and all(c == p or c == Replicate() for c in current):
            # Partial + Replicate: the replica becomes a Partial term locally (no collective, as torch)
            options.append((p, tuple(p for _ in current)))
        elif linearity == "scaling" and (current[0] == p or not divides):
            # one operand stays Partial, the others are reduced (Partial * Partial: one all-reduce, as torch)
            keep = [i for i, c in enumerate(current) if c == p and (i == 0 or not divides)]
            options += [(p, tuple(c if i == k else Replicate() for i, c in enumerate(current))) for k in keep]
    elif partials and len(set(partials)) == 1 and partials[0].reduce_op == linearity:
        if all(c == partials[0] or c == Replicate() for c in current):
            options.append((partials[0], current))
    return options


def _cost(specs, m: int, targets) -> float:
    """Bytes moved, plus one per collective: of two choices moving the same bytes, the one
    with fewer collectives wins (Partial * Partial: one all-reduce, not two reduce-scatters)."""
    total = 0.0
    for s, t in zip(specs, targets):
        step = transition_cost(s.placements[m], t)
        total += step * max(s.shape.numel(), 1) * s.dtype.itemsize + (step >= COST["all_to_all"])
    return total


_register_foreach()
register(*(getattr(aten, name) for name in sorted(_FUSED) if hasattr(aten, name)))(_foreach_rule)
