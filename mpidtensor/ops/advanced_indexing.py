"""Sharding rules of advanced indexing: ``self[indices]`` (``index.Tensor``), ``self[indices]
= values`` (``index_put``, ``+=`` with accumulate), boolean-mask writes and ``masked_fill``
with a tensor value. The options and the index mapping are :mod:`.indexing`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..tensor.placements import Partial, Placement, Shard
from ..tensor.spec import DTensorSpec
from .indexing import (
    LINEAR,
    R,
    SUM,
    Option,
    at_index,
    choose,
    finish,
    is_inplace,
    nonempty,
    padded,
    partial_at,
    read_index,
    sums_only,
    unpadded,
    write_index,
)
from .pointwise import pointwise_rule
from .registry import OpCall, Sharding, register, replicate_all

aten = torch.ops.aten


# --- advanced indexing --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Indexing:
    """Where ``self[indices]`` puts things: indexed dims, the broadcast index shape ``B``,
    where B starts in the result, and the result dim of each non-indexed dim."""

    indexed: tuple[int, ...]
    bshape: tuple[int, ...]
    bstart: int
    result_dim: dict[int, int]
    result_ndim: int

    @staticmethod
    def of(ndim: int, indices: Sequence) -> "_Indexing":
        indexed = tuple(k for k, t in enumerate(indices) if t is not None)
        bshape = tuple(torch.broadcast_shapes(*(indices[k].shape for k in indexed)))
        adjacent = indexed == tuple(range(indexed[0], indexed[-1] + 1))
        bstart = indexed[0] if adjacent else 0
        rest = [d for d in range(ndim) if d not in indexed]
        if adjacent:  # self[:first] + B + self[last+1:]
            result_dim = {d: d if d < indexed[0] else d - len(indexed) + len(bshape) for d in rest}
        else:  # B first, then the other dims in order
            result_dim = {d: len(bshape) + i for i, d in enumerate(rest)}
        return _Indexing(indexed, bshape, bstart, result_dim, ndim - len(indexed) + len(bshape))

    def plain_indices(self, specs: Sequence[DTensorSpec]) -> bool:
        """Every index tensor has the broadcast shape (so they can be sharded alike)."""
        return all(tuple(s.shape) == self.bshape for s in specs)


def _index_specs(call: OpCall) -> tuple[DTensorSpec, list, list[DTensorSpec]]:
    indices = list(call.args[1])
    return call.tensor_specs[0], indices, [t for t in indices if t is not None]


def _index_checks(lay: _Indexing) -> list[tuple]:
    """``at_index`` checks of ``self[indices]``'s index tensors (negative ones count from the end)."""
    return [(1 + j, lambda a, k=k: a[1][k], k, True) for j, k in enumerate(lay.indexed)]


@register(aten.index.Tensor)
def index(call: OpCall) -> Sharding:
    """``self[indices]`` with tensor indices (integer; boolean masks have data-dependent shapes)."""
    self, indices, index_specs = _index_specs(call)
    if any(_is_mask(s) for s in index_specs):
        return replicate_all(call)  # (boolean masks give data-dependent shapes: not reached)
    lay = _Indexing.of(self.ndim, indices)
    n = len(index_specs)

    def options(m: int) -> list[Option]:
        opts = [Option((R,) * (n + 1), (R,))]
        opts += [Option((Shard(d),) + (R,) * n, (Shard(od),)) for d, od in lay.result_dim.items()]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(Option((p,) + (R,) * n, (p,)))
        if lay.plain_indices(index_specs):
            opts += [Option((R,) + (Shard(j),) * n, (Shard(lay.bstart + j),)) for j in range(len(lay.bshape))]
        if sums_only(self):
            opts += [Option((Shard(k),) + (R,) * n, (SUM,)) for k in lay.indexed]
        return opts

    before, after = [1] * lay.bstart, [1] * (lay.result_ndim - lay.bstart - len(lay.bshape))

    def local_for(spans: dict) -> Callable:
        lengths = {k: self.shape[k] for k in spans}

        def local(args, kwargs):
            x, idx = args[0], list(args[1])
            keep = None
            for k, (offset, size) in spans.items():
                pos, inside = read_index(idx[k].remainder(lengths[k]), offset, size)
                idx[k] = pos
                keep = inside if keep is None else keep & inside
                x = nonempty(x, k)
            out = aten.index.Tensor(x, idx)
            bshape = torch.broadcast_shapes(*(t.shape for t in idx if t is not None))  # local: indices may be sharded
            return out.masked_fill_(~keep.expand(bshape).reshape(before + list(bshape) + after), 0)

        return local

    return at_index(call, lay.indexed, options, _index_checks(lay), local_for, error=IndexError)


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(call: OpCall) -> Sharding:
    """``self[indices] = values`` (``+=`` with accumulate); values broadcast to ``self[indices]``."""
    self, indices, index_specs = _index_specs(call)
    values = call.tensor_specs[-1]
    if any(_is_mask(s) for s in index_specs):
        return _masked_put(call, self, indices, values)
    lay = _Indexing.of(self.ndim, indices)
    n = len(index_specs)
    accumulate = call.args[3] if len(call.args) > 3 else call.kwargs.get("accumulate", False)
    lead = lay.result_ndim - values.ndim  # result dims values lacks (broadcast)

    def options(m: int) -> list[Option]:
        opts = [Option((R,) * (n + 2), (R,))]
        for d, od in lay.result_dim.items():
            vd = od - lead
            if vd < 0 or values.shape[vd] == 1:
                opts.append(Option((Shard(d),) + (R,) * n + (R,), (Shard(d),)))
            elif values.shape[vd] == self.shape[d]:
                opts.append(Option((Shard(d),) + (R,) * n + (Shard(vd),), (Shard(d),)))
        opts += [Option((Shard(k),) + (R,) * (n + 1), (Shard(k),)) for k in lay.indexed]
        p = partial_at([self, values], m)
        if p is not None and (p.reduce_op in LINEAR or not accumulate):
            opts.append(Option((p,) + (R,) * n + (p,), (p,)))
        if accumulate and lay.plain_indices(index_specs):
            for j, size in enumerate(lay.bshape):
                vd = lay.bstart + j - lead
                if vd >= 0 and values.shape[vd] == size:
                    opts.append(Option((SUM,) + (Shard(j),) * n + (Shard(vd),), (SUM,)))
        return opts

    inplace = is_inplace(call)

    def local_for(spans: dict) -> Callable:
        sharded, lengths = list(spans), {k: self.shape[k] for k in spans}

        def local(args, kwargs):
            x, idx = args[0], list(args[1])
            for k, (offset, size) in spans.items():
                idx[k] = write_index(idx[k], offset, size, lengths[k])
            out = aten.index_put_.default(padded(x, sharded), idx, args[2], accumulate)
            return finish(x, unpadded(out, sharded), inplace)

        return local

    return at_index(call, lay.indexed, options, _index_checks(lay), local_for, inplace, IndexError)


def _is_mask(spec: DTensorSpec) -> bool:
    return spec.dtype in (torch.bool, torch.uint8)


def _masked_put(call: OpCall, self: DTensorSpec, indices: list, values: DTensorSpec) -> Sharding:
    """``self[mask] = value`` with boolean masks (each covering as many dims of self as it
    has): with a single value, every dim stays sharded, masks sharded alike; a tensor of
    values is matched to the True entries in order, so then all is replicated."""
    if values.shape.numel() != 1 or not all(t is None or _is_mask(t) for t in indices):
        return replicate_all(call)
    starts, dim = [], 0
    for t in indices:
        if t is not None:
            starts.append(dim)
        dim += 1 if t is None else t.ndim
    masks = [t for t in indices if t is not None]

    def mask_at(mask: DTensorSpec, start: int, d: int) -> Placement:
        return Shard(d - start) if start <= d < start + mask.ndim else R

    def options(m: int) -> list[Option]:
        opts = [Option((R,) * (len(masks) + 2), (R,))]
        for d in range(self.ndim):
            along = tuple(mask_at(t, start, d) for t, start in zip(masks, starts))
            opts.append(Option((Shard(d),) + along + (R,), (Shard(d),)))
        return opts

    inputs, outputs = choose(call, options, is_inplace(call))
    return Sharding(inputs, outputs)


# --- masked_fill with a tensor value ------------------------------------------------------------

# The Scalar overloads are tagged pointwise; these take the value as a 0-d tensor.
register(aten.masked_fill.Tensor, aten.masked_fill_.Tensor)(pointwise_rule)
