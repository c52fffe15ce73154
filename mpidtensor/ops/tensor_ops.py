"""Tensor ops that keep their input's layout: detach, alias, clones and casts,
``*_like`` factories, fills, ``copy_``. They keep a ``_StridedShard`` as they keep a ``Shard``.
And constant padding, which keeps the shards of the dims it does not pad."""
from __future__ import annotations

import torch

from ..tensor.placements import Partial, Replicate, Shard, shard_dim
from .registry import OpCall, Sharding, broadcast_placements, register, same_as_input, takes_strided

aten = torch.ops.aten


@register(aten.detach, aten.alias, aten.lift_fresh, aten.clone, aten.contiguous, aten._to_copy)
@takes_strided
def keep_layout(call: OpCall) -> Sharding:
    """Local op, same placements (Partial stays Partial: these ops are linear)."""
    return same_as_input(call)


@register(aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.fill_, aten.zero_)
@takes_strided
def fill_like(call: OpCall) -> Sharding:
    """A constant tensor laid out like its input; Partial becomes Replicate (a constant is not
    a partial sum), except for ``empty_like``, whose values are unset: it keeps Partial, as
    torch's (a module's Partial buffer stays Partial through ``to_empty``)."""
    placements = call.tensor_specs[0].placements
    if call.func is not aten.empty_like.default:
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    inputs = [None] * len(call.tensor_specs)
    if call.func._schema.name.endswith("_"):
        inputs[0] = placements
    return Sharding(inputs, [placements])


@register(aten.copy_)
@takes_strided
def copy_(call: OpCall) -> Sharding:
    """``dst.copy_(src)``: src takes dst's placements, mapped through the broadcast of src to dst."""
    dst, src = call.tensor_specs[:2]
    return Sharding([dst.placements, broadcast_placements(dst.placements, dst.shape, src)], [dst.placements])


@register(aten.view_as_real, aten.view_as_complex)
def complex_view(call: OpCall) -> Sharding:
    """Adding or removing the trailing (real, imag) dim keeps every other dim's shard;
    ``view_as_complex`` needs that trailing dim whole."""
    spec = call.tensor_specs[0]
    last = Shard(spec.ndim - 1)
    placements = tuple(Replicate() if p == last and call.func is aten.view_as_complex.default else p
                       for p in spec.placements)
    return Sharding([placements], [placements])


@register(aten._conj, aten._neg_view)
def lazy_view(call: OpCall) -> Sharding:
    """``conj()`` / the negative view: torch only flips a bit on the tensor, but a DTensor
    cannot carry that bit (its local block would be moved and viewed as plain memory,
    losing it), so the local block is conjugated or negated for real. Linear: Partial stays."""
    materialize = torch.conj_physical if call.func is aten._conj.default else torch.neg
    return Sharding([None], [call.tensor_specs[0].placements], lambda a, k: materialize(a[0]))


@register(aten.constant_pad_nd)
@takes_strided
def constant_pad_nd(call: OpCall) -> Sharding:
    """``F.pad(x, pad, value=v)`` (mode "constant"), as torch's rule: a shard of a dim it pads
    (or crops) is gathered, other shards stay; a Partial stays where the padding reduces to
    itself (``v == 0`` for sum, any ``v`` for avg, max and min: every rank pads with ``v``),
    else it is reduced first."""
    spec = call.tensor_specs[0]
    args = call.bound()
    pad, value = list(args["pad"]), args["value"] or 0
    padded = {spec.ndim - 1 - i // 2 for i in range(0, len(pad), 2) if pad[i] or pad[i + 1]}
    keep = []
    for p in spec.placements:
        if shard_dim(p) in padded:
            keep.append(Replicate())
        elif isinstance(p, Partial) and not (p.reduce_op in ("avg", "max", "min") or value == 0):
            keep.append(Replicate())
        else:
            keep.append(p)
    return Sharding([tuple(keep)], [tuple(keep)])
