"""Matrix products: ``mm``, ``bmm``, ``mv``, ``dot``, ``vdot`` and the forms that add a
term, ``addmm``, ``addmv``, ``addbmm``, ``baddbmm``, ``addr`` (also in place).

Each op is an einsum of two factors with labelled dims (``mm``: ``mk,kn->mn``).
Per mesh dim the candidates are:

* both factors replicated: replicated output;
* one label sharded on every factor that has it: a label kept in the output gives
  an output sharded there (batch dims sharded on both factors, a free dim on one
  factor with the other replicated); a contracted label gives ``Partial(sum)``.
  Both factors are split by ``torch.chunk`` of the same length in the same mesh-dim
  order, so uneven pieces of a contracted dim line up;
* one factor ``Partial(sum/avg)``, the other replicated: the output keeps that Partial;
* as for a shard, a label held as the same ``_StridedShard`` (a split factor some input
  has there) by every factor that has it: kept in the output, or ``Partial(sum)`` (a
  flattened sequence-sharded activation's rows, torch's layout; both factors hold the
  same positions of a contracted one).

Candidates of all mesh dims are combined and the one whose input redistributions
move the fewest bytes wins. Backward ops are products on transposed views (``mm``,
``bmm``, ``mv``, ``mul``), so these rules serve them too.

The added term (``self``) takes the output's placement, or stays replicated along a
dim it broadcasts. Where the output is Partial the term is made Partial too: a
replicated term becomes the redistribution planner's Replicate->Partial (the value
on coordinate 0 of that mesh dim, zeros elsewhere, no communication), so it is
added exactly once; a term that already is ``Partial(sum)`` is used as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch

from ..tensor.placements import Partial, Placement, Replicate, Shard, _StridedShard
from ..tensor.spec import DTensorSpec
from .registry import OpCall, Sharding, cheapest, register, takes_strided

aten = torch.ops.aten

# Partial reductions a product is linear in (it is linear in each factor).
_LINEAR_REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Product:
    """An einsum ``left,right->out``; ``added``: the first tensor argument is a term added to it."""

    left: str
    right: str
    out: str
    added: bool = False


# (mesh-dim option) output placement, added-term placement (None without one), factor placements
Option = tuple[Placement, Placement | None, Placement, Placement]

_MM = ("mk", "kn", "mn")
_BMM = ("bmk", "bkn", "bmn")
_MV = ("mk", "k", "m")

PRODUCTS: dict[torch._ops.OpOverload, Product] = {
    aten.mm.default: Product(*_MM),
    aten.mm.dtype: Product(*_MM),
    aten.bmm.default: Product(*_BMM),
    aten.bmm.dtype: Product(*_BMM),
    aten.mv.default: Product(*_MV),
    aten.dot.default: Product("k", "k", ""),
    aten.vdot.default: Product("k", "k", ""),
    aten.addmm.default: Product(*_MM, added=True),
    aten.addmm.dtype: Product(*_MM, added=True),
    aten.addmm_.default: Product(*_MM, added=True),
    aten.baddbmm.default: Product(*_BMM, added=True),
    aten.baddbmm.dtype: Product(*_BMM, added=True),
    aten.baddbmm_.default: Product(*_BMM, added=True),
    aten.addbmm.default: Product("bmk", "bkn", "mn", added=True),
    aten.addbmm_.default: Product("bmk", "bkn", "mn", added=True),
    aten.addmv.default: Product(*_MV, added=True),
    aten.addmv_.default: Product(*_MV, added=True),
    aten.addr.default: Product("m", "n", "mn", added=True),
    aten.addr_.default: Product("m", "n", "mn", added=True),
}


@takes_strided
@register(*PRODUCTS)
def product_rule(call: OpCall) -> Sharding:
    """The cheapest combination of per-mesh-dim options (see the module docstring)."""
    prod = PRODUCTS[call.func]
    specs = call.tensor_specs
    out_shape = call.out_metas()[0].shape
    inplace = call.func._schema.name.endswith("_")
    per_dim = []
    for m in range(call.ndim):
        options = _options(prod, specs, out_shape, m)
        if inplace:  # ``self`` is the output: keep its placement when some option can
            options = [o for o in options if o[0] == specs[0].placements[m]] or options
        per_dim.append(options)
    best = cheapest(call, (_sharding(prod, choice) for choice in product(*per_dim)))
    if call.func is aten.addmv.default:
        best.local = _addmv_local
    return best


def _addmv_local(a, k):
    """torch's addmv returns a (1,)-shaped ``self`` as is when ``mat`` has no rows (an empty
    block): broadcast it to the local output first."""
    return aten.addmv.default(a[0].expand(a[1].shape[0]), *a[1:], **k)


def _sharding(prod: Product, choice: tuple[Option, ...]) -> Sharding:
    out, added, left, right = (tuple(column) for column in zip(*choice))
    inputs = [added, left, right] if prod.added else [left, right]
    return Sharding(inputs, [out])


def _options(prod: Product, specs: list[DTensorSpec], out_shape: torch.Size, m: int) -> list[Option]:
    """The valid (output, added term, left, right) placements at mesh dim ``m``."""
    added = specs[0] if prod.added else None
    rep = Replicate()
    pairs: list[tuple[Placement, Placement, Placement]] = [(rep, rep, rep)]
    for label in dict.fromkeys(prod.left + prod.right):
        left = Shard(prod.left.index(label)) if label in prod.left else rep
        right = Shard(prod.right.index(label)) if label in prod.right else rep
        out = Shard(prod.out.index(label)) if label in prod.out else Partial("sum")
        pairs.append((out, left, right))
    for sf in _split_factors(specs, m):  # a _StridedShard label held alike by the factors that have it
        for label in dict.fromkeys(prod.left + prod.right):
            left, right = (_StridedShard(f.index(label), split_factor=sf) if label in f else rep
                           for f in (prod.left, prod.right))
            out = _StridedShard(prod.out.index(label), split_factor=sf) if label in prod.out else Partial("sum")
            pairs.append((out, left, right))
    for op in _partial_ops(specs, m):
        pairs += [(Partial(op), Partial(op), rep), (Partial(op), rep, Partial(op))]
    return [(out, _added_placement(added, out, out_shape), left, right) for out, left, right in pairs]


def _split_factors(specs: list[DTensorSpec], m: int) -> list[int]:
    """The split factors of the ``_StridedShard`` inputs at mesh dim ``m``."""
    return list(dict.fromkeys(p.split_factor for s in specs if type(p := s.placements[m]) is _StridedShard))


def _partial_ops(specs: list[DTensorSpec], m: int) -> list[str]:
    """Reduce ops a Partial output may have at mesh dim ``m``: sum, and those of inputs already Partial there."""
    ops = ["sum"]
    for spec in specs:
        p = spec.placements[m]
        if isinstance(p, Partial) and p.reduce_op in _LINEAR_REDUCE_OPS and p.reduce_op not in ops:
            ops.append(p.reduce_op)
    return ops


def _added_placement(spec: DTensorSpec | None, out: Placement, out_shape: torch.Size) -> Placement | None:
    """The added term's placement for an output placed ``out`` (it broadcasts against the output)."""
    if spec is None:
        return None
    if isinstance(out, (Shard, _StridedShard)):
        d = out.dim - (len(out_shape) - spec.ndim)
        if d < 0 or spec.shape[d] != out_shape[out.dim]:
            return Replicate()
        return Shard(d) if isinstance(out, Shard) else _StridedShard(d, split_factor=out.split_factor)
    return out
