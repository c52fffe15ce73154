"""Sharding rules of ops that read or write ``self`` at index positions along one dim:
``index_select``, ``gather``, the scatter family, ``index_add``; and the ``new_*``
factories that their backward passes write into. The options and the index mapping
are :mod:`.indexing`'s.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..tensor.layout import contiguous_strides
from ..tensor.placements import Partial, Shard
from ..tensor.spec import DTensorSpec
from .indexing import (
    LINEAR,
    R,
    SUM,
    Option,
    at_index,
    finish,
    is_inplace,
    nonempty,
    norm_dim,
    on_dim,
    padded,
    partial_at,
    read_index,
    register_on_dim,
    sums_only,
    unpadded,
    write_index,
)
from .registry import OpCall, Sharding, register

aten = torch.ops.aten


# --- index_select -------------------------------------------------------------------------------


@register_on_dim(aten.index_select.default)
def index_select(call: OpCall) -> Sharding:
    self, index = call.tensor_specs
    dim = norm_dim(call.args[1], self.ndim)

    def options(m: int) -> list[Option]:
        opts = [Option((R, R), (R,))]
        opts += [Option((Shard(d), R), (Shard(d),)) for d in range(self.ndim) if d != dim]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(Option((p, R), (p,)))
        if index.ndim == 1:
            opts.append(Option((R, Shard(0)), (Shard(dim),)))
        if sums_only(self):
            opts.append(Option((Shard(dim), R), (SUM,)))
        return opts

    ndim = self.ndim

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx = args
            pos, mask = read_index(idx.reshape(-1), offset, size)
            out = torch.index_select(nonempty(x, dim), dim, pos)
            shape = [1] * ndim
            shape[dim] = -1
            return out.masked_fill_(~mask.view(shape), 0)

        return local

    return at_index(call, (dim,), options, on_dim(dim), local_for)


# --- gather -------------------------------------------------------------------------------------


@register_on_dim(aten.gather.default)
def gather(call: OpCall) -> Sharding:
    self, index = call.tensor_specs
    dim = norm_dim(call.args[1], self.ndim)

    def options(m: int) -> list[Option]:
        opts = [Option((R, R), (R,)), Option((R, Shard(dim)), (Shard(dim),))]
        opts += [
            Option((Shard(d), Shard(d)), (Shard(d),))
            for d in range(self.ndim)
            if d != dim and self.shape[d] == index.shape[d]
        ]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(Option((p, R), (p,)))
        if sums_only(self):
            opts.append(Option((Shard(dim), R), (SUM,)))
        return opts

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx = args[:3]
            pos, mask = read_index(idx, offset, size)
            return torch.gather(nonempty(x, dim), dim, pos).masked_fill_(~mask, 0)

        return local

    return at_index(call, (dim,), options, on_dim(dim), local_for)


# --- scatter family and index_add ---------------------------------------------------------------

# Partial ops a scatter_reduce keeps (with include_self): its reduction applied across ranks.
_REDUCE_PARTIAL = {"sum": "sum", "prod": "product", "amax": "max", "amin": "min"}


def _scatter_partials(call: OpCall, src_given: bool) -> tuple[set[str], str | None]:
    """(Partial ops that self and src may share and keep, the Partial op a write of a
    sharded index/src creates on a replicated self, or None)."""
    name = call.func._schema.name.split("::")[-1].rstrip("_")
    if name in ("scatter_add", "index_add"):
        return set(LINEAR), "sum"
    if name == "scatter_reduce":
        reduce = call.args[4]
        if not call.kwargs.get("include_self", True) or reduce not in _REDUCE_PARTIAL:
            return set(), None
        op = _REDUCE_PARTIAL[reduce]
        return ({op, "avg"} if op == "sum" else {op}), (op if op in ("sum", "max", "min") else None)
    if call.func._overloadname == "src" and src_given:
        return {"sum", "avg", "max", "min", "product"}, None  # placed values: each rank's part reduces
    if call.func._overloadname == "value":
        value = call.args[3]
        return ({"sum", "avg", "max", "min", "product"} if value == 0 else {"avg", "max", "min"}), None
    return set(), None


@register_on_dim(
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
    aten.scatter_add.default, aten.scatter_add_.default,
    aten.scatter_reduce.two, aten.scatter_reduce_.two,
)
def scatter(call: OpCall) -> Sharding:
    """``self.scatter*(dim, index, src)``: src[i][j] written at self[i][index[i][j]] (for dim=1)."""
    specs = call.tensor_specs
    self, index = specs[0], specs[1]
    has_src = len(specs) == 3
    dim = norm_dim(call.args[1], self.ndim)
    keep, create = _scatter_partials(call, has_src)

    def aligned(d: int) -> bool:
        return all(s.shape[d] == self.shape[d] for s in specs)

    def options(m: int) -> list[Option]:
        n = len(specs)
        opts = [Option((R,) * n, (R,)), Option((Shard(dim),) + (R,) * (n - 1), (Shard(dim),))]
        opts += [Option((Shard(d),) * n, (Shard(d),)) for d in range(self.ndim) if d != dim and aligned(d)]
        p = partial_at([self] + specs[2:], m)
        if p is not None and p.reduce_op in keep:
            opts.append(Option((p, R) + (p,) * (n - 2), (p,)))
        if create and has_src and specs[2].shape[dim] == index.shape[dim]:
            new = Partial(create)
            opts.append(Option((new, Shard(dim), Shard(dim)), (new,)))
        return opts

    inplace = is_inplace(call)

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]
        op = getattr(aten, call.func._schema.name.split("::")[-1].rstrip("_") + "_")
        overload = getattr(op, call.func._overloadname)

        def local(args, kwargs):
            x, _, idx = args[:3]
            pos = write_index(idx, offset, size)
            out = overload(padded(x, (dim,)), dim, pos, *args[3:], **kwargs)
            return finish(x, unpadded(out, (dim,)), inplace)

        return local

    return at_index(call, (dim,), options, on_dim(dim), local_for, inplace)


@register_on_dim(aten.index_add.default, aten.index_add_.default)
def index_add(call: OpCall) -> Sharding:
    """``self.index_add(dim, index, source, alpha=)``: source slices added at self's ``index`` positions."""
    self, index, source = call.tensor_specs
    dim = norm_dim(call.args[1], self.ndim)

    def options(m: int) -> list[Option]:
        opts = [Option((R, R, R), (R,)), Option((Shard(dim), R, R), (Shard(dim),))]
        opts += [Option((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(self.ndim) if d != dim]
        p = partial_at([self, source], m)
        if p is not None and p.reduce_op in LINEAR:
            opts.append(Option((p, R, p), (p,)))
        if index.ndim == 1:
            opts.append(Option((SUM, Shard(0), Shard(dim)), (SUM,)))
        return opts

    inplace = is_inplace(call)

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx, src = args[:4]
            out = padded(x, (dim,)).index_add_(dim, write_index(idx, offset, size), src, *args[4:], **kwargs)
            return finish(x, unpadded(out, (dim,)), inplace)

        return local

    return at_index(call, (dim,), options, on_dim(dim), local_for, inplace)


# --- new_* factories ----------------------------------------------------------------------------


@register(
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory(call: OpCall) -> Sharding:
    """A new constant tensor of a GLOBAL size. Unlike torch.distributed.tensor (which
    replicates unless the size equals the input's), a tensor dim keeps the input's
    sharding whenever the new tensor has the same rank and the same size along it:
    backward passes build ``grad.new_zeros(input_size)`` and then write the gradient
    into it, so a sharded buffer keeps that write local and its memory sharded. Any
    other dim, and Partial, become Replicate: a constant is not a partial value."""
    self = call.tensor_specs[0]
    out = call.out_metas()[0]
    strided = call.func in (aten.new_empty_strided.default,)
    follows = len(out.shape) == self.ndim and not (strided and tuple(out.stride()) != contiguous_strides(out.shape))
    placements = tuple(
        p if follows and isinstance(p, Shard) and out.shape[p.dim] == self.shape[p.dim] else R
        for p in self.placements
    )
    if all(p == R for p in placements):
        return Sharding([None], [placements])
    local_shape, _ = DTensorSpec(call.mesh, placements, out.shape, out.stride(), out.dtype).local_shape_and_offset()
    size = list(local_shape)
    if strided:
        stride = list(contiguous_strides(size))
        return Sharding([None], [placements], lambda a, k: aten.new_empty_strided(a[0], size, stride, *a[3:], **k))
    func = call.func
    return Sharding([None], [placements], lambda a, k: func(a[0], size, *a[2:], **k))
