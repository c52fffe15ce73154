"""Sharding rules for indexing ops: index_select, gather, the scatter family,
index_add, advanced indexing (``index.Tensor`` / ``index_put``), sort/topk,
``masked_fill`` with a tensor value and the ``new_*`` factories.

Per mesh dim the rule picks, by bytes moved, one of a few options:

* everything replicated (always correct);
* a dim the op does not index stays sharded, in every operand that has it;
* Partial passes through ops that only select or place values (a selection
  commutes with every elementwise reduction; additions need ``sum``/``avg``);
* the indexed dim of ``self`` stays sharded and the index values, which are
  GLOBAL, are mapped to the local block: a read gives each rank the entries it
  holds (zeros elsewhere: a ``Partial(sum)`` output), a write keeps only the
  entries that land in the block (a sharded output); both exact on uneven and
  empty shards;
* the index (and the source of a write) is sharded: a read gives a sharded
  output, an accumulating write gives a ``Partial`` output.

Creating a new ``Partial`` costs an all-reduce of the output later, counted in
the choice. Ops along a dim (sort, topk, kthvalue) need that dim whole: a shard
of it is moved to another dim by an all-to-all when the cost model prefers it
to an all-gather. An out-of-range index raises on every rank when the index is
replicated (checked against the global length before the local op runs, where self
is not whole); a sharded index is checked on the ranks holding it only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .._layout import contiguous_strides
from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .pointwise import pointwise_rule
from .registry import COST, OpCall, Sharding, register, replicate_all, valid_placements

aten = torch.ops.aten

R = Replicate()
SUM = Partial("sum")
_LINEAR = ("sum", "avg")  # Partial ops that commute with an addition or with zero-filling


@dataclass(frozen=True)
class _Option:
    """Placements at one mesh dim: one per tensor input, one per output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


def _choose(call: OpCall, options: Callable[[int], list[_Option]], inplace: bool = False):
    """Per mesh dim, the option moving the fewest bytes (an in-place op keeps self's placement when it can)."""
    specs = call.tensor_specs
    out_bytes = [max(m.numel(), 1) * m.dtype.itemsize for m in call.out_metas()]
    ins: list[list[Placement]] = [[] for _ in specs]
    outs: list[list[Placement]] = [[] for _ in out_bytes]
    out_ndims = [m.ndim for m in call.out_metas()]
    for m in range(call.ndim):
        opts = [o for o in options(m) if _valid(o, specs, out_ndims)]
        if inplace:
            opts = [o for o in opts if o.inputs[0] == specs[0].placements[m]] or opts
        best = min(opts, key=lambda o: _cost(specs, m, o, out_bytes))
        for acc, p in zip(ins, best.inputs):
            acc.append(p)
        for acc, p in zip(outs, best.outputs):
            acc.append(p)
    return [tuple(p) for p in ins], [tuple(p) for p in outs]


def _valid(opt: _Option, specs: Sequence[DTensorSpec], out_ndims: list[int]) -> bool:
    """No Shard of a dim its tensor lacks (a 0-d operand can only be replicated or partial)."""
    return all(valid_placements((p,), s.ndim) for p, s in zip(opt.inputs, specs)) and all(
        valid_placements((p,), n) for p, n in zip(opt.outputs, out_ndims)
    )


def _cost(specs: Sequence[DTensorSpec], m: int, opt: _Option, out_bytes: list[int]) -> float:
    total = 0.0
    for spec, target in zip(specs, opt.inputs):
        cur = spec.placements[m]
        if cur == target:
            continue
        nbytes = max(spec.shape.numel(), 1) * spec.dtype.itemsize
        if isinstance(cur, Partial):
            total += COST["reduce_scatter" if isinstance(target, Shard) else "all_reduce"] * nbytes
        elif isinstance(cur, Shard):
            total += COST["all_to_all" if isinstance(target, Shard) else "all_gather"] * nbytes
        else:
            total += 0.01 * nbytes
    if not any(isinstance(s.placements[m], Partial) for s in specs):
        # A new Partial output will have to be reduced by whoever reads it.
        total += sum(COST["all_reduce"] * b for p, b in zip(opt.outputs, out_bytes) if isinstance(p, Partial))
    return total


def _partial_at(specs: Sequence[DTensorSpec], m: int) -> Partial | None:
    """The one Partial placement the inputs share at mesh dim ``m`` (None if none or mixed)."""
    found = {s.placements[m] for s in specs if isinstance(s.placements[m], Partial)}
    return found.pop() if len(found) == 1 else None


def _sums_only(spec: DTensorSpec) -> bool:
    """Masking a shard into a new Partial(sum) is only sound next to sum/avg Partials."""
    return all(p.reduce_op in _LINEAR for p in spec.placements if isinstance(p, Partial))


def _norm(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _span(spec: DTensorSpec, placements, dim: int) -> tuple[int, int]:
    """(global offset, size) along ``dim`` of this rank's block under ``placements``."""
    shape, offset = spec.with_placements(placements).local_shape_and_offset()
    return offset[dim], shape[dim]


def _is_sharded(placements, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in placements)


def _inplace(call: OpCall) -> bool:
    return call.func._schema.name.endswith("_")


# --- mapping global indices to a local block ----------------------------------------------------


def _read_index(index: torch.Tensor, offset: int, size: int):
    """Local positions of global ``index`` in a block [offset, offset+size) of length
    max(size, 1) (clamped) and the mask of those that fall inside it."""
    mask = (index >= offset) & (index < offset + size)
    return (index - offset).clamp_(0, max(size - 1, 0)), mask


def _nonempty(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` itself, or one zero slot along ``dim`` if it is empty there (so reads can run)."""
    if t.shape[dim] > 0:
        return t
    shape = list(t.shape)
    shape[dim] = 1
    return t.new_zeros(shape)


def _write_index(index: torch.Tensor, offset: int, size: int, length: int | None = None) -> torch.Tensor:
    """Local positions of global ``index`` in the block; entries outside go to slot ``size``.
    ``length`` (the global length) wraps negative indices first."""
    if length is not None:
        index = index.remainder(length)
    inside = (index >= offset) & (index < offset + size)
    return torch.where(inside, index - offset, size)


def _padded(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """A copy of ``t`` with one extra zero slot at the end of each of ``dims`` (absorbs foreign writes)."""
    for d in dims:
        shape = list(t.shape)
        shape[d] = 1
        t = torch.cat([t, t.new_zeros(shape)], d)
    return t


def _unpadded(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    for d in dims:
        t = t.narrow(d, 0, t.shape[d] - 1)
    return t.contiguous()


def _finish(self_local: torch.Tensor, result: torch.Tensor, inplace: bool) -> torch.Tensor:
    return self_local.copy_(result) if inplace else result


def _register_on_dim(*ops):
    """``register`` for a rule of an op along a ``dim`` of ``self``: a 0-d ``self`` (which
    torch treats as one element) has no dim to shard or map, so all is replicated."""

    def decorate(rule):
        def guarded(call: OpCall) -> Sharding:
            return replicate_all(call) if call.tensor_specs[0].ndim == 0 else rule(call)

        register(*ops)(guarded)
        return rule

    return decorate


def _bounded(call: OpCall, sharding: Sharding, checks: Sequence[tuple], error: type = RuntimeError) -> Sharding:
    """``sharding`` whose local op first checks index tensors against the global lengths.

    ``checks``: (the index's position among the tensor inputs, its getter from the local
    arguments, the dim of self it indexes, whether negative indices count from the end).
    Needed when self is not replicated: a rank's kernel sees only its block (masked, or
    empty and so unchecked), so a bad index would give zeros, or an error on some ranks
    only. A replicated index holds the same values on every rank: every rank raises alike.
    A sharded index is checked by torch's kernel on the ranks holding it; the other ranks
    cannot see those values and end through the abort hook."""
    specs = call.tensor_specs
    self_targets = sharding.inputs[0] or specs[0].placements
    if all(p == R for p in self_targets):
        return sharding  # whole self on every rank: torch's own check, the same everywhere
    active = [
        (get, dim, specs[0].shape[dim], wraps) for pos, get, dim, wraps in checks
        if all(p == R for p in (sharding.inputs[pos] or specs[pos].placements))
    ]
    if not active:
        return sharding
    run = sharding.local or (lambda a, k, f=call.func._op: f(*a, **k))
    name = call.func

    def local(args, kwargs):
        for get, dim, n, wraps in active:
            idx = get(args)
            if idx.numel():
                lo, hi = (int(v) for v in torch.aminmax(idx))
                if lo < (-n if wraps else 0) or hi >= n:
                    raise error(f"{name}: index {hi if hi >= n else lo} is out of bounds for dimension {dim} "
                                f"with size {n}")
        return run(args, kwargs)

    return Sharding(sharding.inputs, sharding.outputs, local, sharding.notes)


def _at_index(call: OpCall, dims: Sequence[int], options: Callable[[int], list[_Option]], checks: Sequence[tuple],
              local_for: Callable[[dict[int, tuple[int, int]]], Callable], inplace: bool = False,
              error: type = RuntimeError) -> Sharding:
    """The rule of an op on ``self`` at the positions its index tensors give along
    ``dims``: the cheapest of ``options``; where that splits ``self`` along some of
    ``dims``, the local op ``local_for(spans)``, ``spans`` giving this rank's block
    ``(offset, size)`` along each split dim; the indices checked by ``checks`` against
    ``self``'s global lengths (see :func:`_bounded`)."""
    inputs, outputs = _choose(call, options, inplace)
    spans = {k: _span(call.tensor_specs[0], inputs[0], k) for k in dims if _is_sharded(inputs[0], k)}
    local = local_for(spans) if spans else None
    return _bounded(call, Sharding(inputs, outputs, local), checks, error)


def _on_dim(dim: int) -> list[tuple]:
    """The check of an op whose index is argument 2 (tensor input 1), along ``dim``."""
    return [(1, lambda a: a[2], dim, False)]


# --- index_select -------------------------------------------------------------------------------


@_register_on_dim(aten.index_select.default)
def index_select(call: OpCall) -> Sharding:
    self, index = call.tensor_specs
    dim = _norm(call.args[1], self.ndim)

    def options(m: int) -> list[_Option]:
        opts = [_Option((R, R), (R,))]
        opts += [_Option((Shard(d), R), (Shard(d),)) for d in range(self.ndim) if d != dim]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(_Option((p, R), (p,)))
        if index.ndim == 1:
            opts.append(_Option((R, Shard(0)), (Shard(dim),)))
        if _sums_only(self):
            opts.append(_Option((Shard(dim), R), (SUM,)))
        return opts

    ndim = self.ndim

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx = args
            pos, mask = _read_index(idx.reshape(-1), offset, size)
            out = torch.index_select(_nonempty(x, dim), dim, pos)
            shape = [1] * ndim
            shape[dim] = -1
            return out.masked_fill_(~mask.view(shape), 0)

        return local

    return _at_index(call, (dim,), options, _on_dim(dim), local_for)


# --- gather -------------------------------------------------------------------------------------


@_register_on_dim(aten.gather.default)
def gather(call: OpCall) -> Sharding:
    self, index = call.tensor_specs
    dim = _norm(call.args[1], self.ndim)

    def options(m: int) -> list[_Option]:
        opts = [_Option((R, R), (R,)), _Option((R, Shard(dim)), (Shard(dim),))]
        opts += [
            _Option((Shard(d), Shard(d)), (Shard(d),))
            for d in range(self.ndim)
            if d != dim and self.shape[d] == index.shape[d]
        ]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(_Option((p, R), (p,)))
        if _sums_only(self):
            opts.append(_Option((Shard(dim), R), (SUM,)))
        return opts

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx = args[:3]
            pos, mask = _read_index(idx, offset, size)
            return torch.gather(_nonempty(x, dim), dim, pos).masked_fill_(~mask, 0)

        return local

    return _at_index(call, (dim,), options, _on_dim(dim), local_for)


# --- scatter family and index_add ---------------------------------------------------------------

# Partial ops a scatter_reduce keeps (with include_self): its reduction applied across ranks.
_REDUCE_PARTIAL = {"sum": "sum", "prod": "product", "amax": "max", "amin": "min"}


def _scatter_partials(call: OpCall, src_given: bool) -> tuple[set[str], str | None]:
    """(Partial ops that self and src may share and keep, the Partial op a write of a
    sharded index/src creates on a replicated self, or None)."""
    name = call.func._schema.name.split("::")[-1].rstrip("_")
    if name in ("scatter_add", "index_add"):
        return set(_LINEAR), "sum"
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


@_register_on_dim(
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
    dim = _norm(call.args[1], self.ndim)
    keep, create = _scatter_partials(call, has_src)

    def aligned(d: int) -> bool:
        return all(s.shape[d] == self.shape[d] for s in specs)

    def options(m: int) -> list[_Option]:
        n = len(specs)
        opts = [_Option((R,) * n, (R,)), _Option((Shard(dim),) + (R,) * (n - 1), (Shard(dim),))]
        opts += [_Option((Shard(d),) * n, (Shard(d),)) for d in range(self.ndim) if d != dim and aligned(d)]
        p = _partial_at([self] + specs[2:], m)
        if p is not None and p.reduce_op in keep:
            opts.append(_Option((p, R) + (p,) * (n - 2), (p,)))
        if create and has_src and specs[2].shape[dim] == index.shape[dim]:
            new = Partial(create)
            opts.append(_Option((new, Shard(dim), Shard(dim)), (new,)))
        return opts

    inplace = _inplace(call)

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]
        op = getattr(aten, call.func._schema.name.split("::")[-1].rstrip("_") + "_")
        overload = getattr(op, call.func._overloadname)

        def local(args, kwargs):
            x, _, idx = args[:3]
            pos = _write_index(idx, offset, size)
            out = overload(_padded(x, (dim,)), dim, pos, *args[3:], **kwargs)
            return _finish(x, _unpadded(out, (dim,)), inplace)

        return local

    return _at_index(call, (dim,), options, _on_dim(dim), local_for, inplace)


@_register_on_dim(aten.index_add.default, aten.index_add_.default)
def index_add(call: OpCall) -> Sharding:
    """``self.index_add(dim, index, source, alpha=)``: source slices added at self's ``index`` positions."""
    self, index, source = call.tensor_specs
    dim = _norm(call.args[1], self.ndim)

    def options(m: int) -> list[_Option]:
        opts = [_Option((R, R, R), (R,)), _Option((Shard(dim), R, R), (Shard(dim),))]
        opts += [_Option((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(self.ndim) if d != dim]
        p = _partial_at([self, source], m)
        if p is not None and p.reduce_op in _LINEAR:
            opts.append(_Option((p, R, p), (p,)))
        if index.ndim == 1:
            opts.append(_Option((SUM, Shard(0), Shard(dim)), (SUM,)))
        return opts

    inplace = _inplace(call)

    def local_for(spans: dict) -> Callable:
        offset, size = spans[dim]

        def local(args, kwargs):
            x, _, idx, src = args[:4]
            out = _padded(x, (dim,)).index_add_(dim, _write_index(idx, offset, size), src, *args[4:], **kwargs)
            return _finish(x, _unpadded(out, (dim,)), inplace)

        return local

    return _at_index(call, (dim,), options, _on_dim(dim), local_for, inplace)


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
    """``_bounded`` checks of ``self[indices]``'s index tensors (negative ones count from the end)."""
    return [(1 + j, lambda a, k=k: a[1][k], k, True) for j, k in enumerate(lay.indexed)]


@register(aten.index.Tensor)
def index(call: OpCall) -> Sharding:
    """``self[indices]`` with tensor indices (integer; boolean masks have data-dependent shapes)."""
    self, indices, index_specs = _index_specs(call)
    if any(_is_mask(s) for s in index_specs):
        return replicate_all(call)  # (boolean masks give data-dependent shapes: not reached)
    lay = _Indexing.of(self.ndim, indices)
    n = len(index_specs)

    def options(m: int) -> list[_Option]:
        opts = [_Option((R,) * (n + 1), (R,))]
        opts += [_Option((Shard(d),) + (R,) * n, (Shard(od),)) for d, od in lay.result_dim.items()]
        p = self.placements[m]
        if isinstance(p, Partial):
            opts.append(_Option((p,) + (R,) * n, (p,)))
        if lay.plain_indices(index_specs):
            opts += [_Option((R,) + (Shard(j),) * n, (Shard(lay.bstart + j),)) for j in range(len(lay.bshape))]
        if _sums_only(self):
            opts += [_Option((Shard(k),) + (R,) * n, (SUM,)) for k in lay.indexed]
        return opts

    before, after = [1] * lay.bstart, [1] * (lay.result_ndim - lay.bstart - len(lay.bshape))

    def local_for(spans: dict) -> Callable:
        lengths = {k: self.shape[k] for k in spans}

        def local(args, kwargs):
            x, idx = args[0], list(args[1])
            keep = None
            for k, (offset, size) in spans.items():
                pos, inside = _read_index(idx[k].remainder(lengths[k]), offset, size)
                idx[k] = pos
                keep = inside if keep is None else keep & inside
                x = _nonempty(x, k)
            out = aten.index.Tensor(x, idx)
            bshape = torch.broadcast_shapes(*(t.shape for t in idx if t is not None))  # local: indices may be sharded
            return out.masked_fill_(~keep.expand(bshape).reshape(before + list(bshape) + after), 0)

        return local

    return _at_index(call, lay.indexed, options, _index_checks(lay), local_for, error=IndexError)


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

    def options(m: int) -> list[_Option]:
        opts = [_Option((R,) * (n + 2), (R,))]
        for d, od in lay.result_dim.items():
            vd = od - lead
            if vd < 0 or values.shape[vd] == 1:
                opts.append(_Option((Shard(d),) + (R,) * n + (R,), (Shard(d),)))
            elif values.shape[vd] == self.shape[d]:
                opts.append(_Option((Shard(d),) + (R,) * n + (Shard(vd),), (Shard(d),)))
        opts += [_Option((Shard(k),) + (R,) * (n + 1), (Shard(k),)) for k in lay.indexed]
        p = _partial_at([self, values], m)
        if p is not None and (p.reduce_op in _LINEAR or not accumulate):
            opts.append(_Option((p,) + (R,) * n + (p,), (p,)))
        if accumulate and lay.plain_indices(index_specs):
            for j, size in enumerate(lay.bshape):
                vd = lay.bstart + j - lead
                if vd >= 0 and values.shape[vd] == size:
                    opts.append(_Option((SUM,) + (Shard(j),) * n + (Shard(vd),), (SUM,)))
        return opts

    inplace = _inplace(call)

    def local_for(spans: dict) -> Callable:
        sharded, lengths = list(spans), {k: self.shape[k] for k in spans}

        def local(args, kwargs):
            x, idx = args[0], list(args[1])
            for k, (offset, size) in spans.items():
                idx[k] = _write_index(idx[k], offset, size, lengths[k])
            out = aten.index_put_.default(_padded(x, sharded), idx, args[2], accumulate)
            return _finish(x, _unpadded(out, sharded), inplace)

        return local

    return _at_index(call, lay.indexed, options, _index_checks(lay), local_for, inplace, IndexError)


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

    def options(m: int) -> list[_Option]:
        opts = [_Option((R,) * (len(masks) + 2), (R,))]
        for d in range(self.ndim):
            along = tuple(mask_at(t, start, d) for t, start in zip(masks, starts))
            opts.append(_Option((Shard(d),) + along + (R,), (Shard(d),)))
        return opts

    inputs, outputs = _choose(call, options, _inplace(call))
    return Sharding(inputs, outputs)


# --- ops along one dim: sort, topk, kthvalue ----------------------------------------------------


def _along_dim(call: OpCall, dim: int, result_dim: Callable[[int], int]) -> Sharding:
    """``dim`` must be whole; every other dim may stay sharded (``result_dim``: its place in the outputs)."""
    self = call.tensor_specs[0]
    n_out = len(call.out_metas())
    others = sorted((d for d in range(self.ndim) if d != dim), key=lambda d: -self.shape[d])

    def options(m: int) -> list[_Option]:
        opts = [_Option((R,), (R,) * n_out)]
        return opts + [_Option((Shard(d),), (Shard(result_dim(d)),) * n_out) for d in others]

    inputs, outputs = _choose(call, options)
    return Sharding(inputs, outputs)


def _dim_arg(call: OpCall, position: int, default: int = -1) -> int:
    args = call.args
    dim = args[position] if len(args) > position else call.kwargs.get("dim", default)
    return _norm(dim, call.tensor_specs[0].ndim)


@_register_on_dim(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_topk(call: OpCall) -> Sharding:
    """Values and (exact, global) indices along ``dim``."""
    if call.func is aten.sort.stable:
        dim = _norm(call.kwargs.get("dim", -1), call.tensor_specs[0].ndim)
    else:
        dim = _dim_arg(call, 2 if call.func is aten.topk.default else 1)
    return _along_dim(call, dim, lambda d: d)


@_register_on_dim(aten.kthvalue.default)
def kthvalue(call: OpCall) -> Sharding:
    dim = _dim_arg(call, 2)
    keepdim = call.args[3] if len(call.args) > 3 else call.kwargs.get("keepdim", False)
    return _along_dim(call, dim, lambda d: d if keepdim or d < dim else d - 1)


# --- masked_fill with a tensor value ------------------------------------------------------------

# The Scalar overloads are tagged pointwise; these take the value as a 0-d tensor.
register(aten.masked_fill.Tensor, aten.masked_fill_.Tensor)(pointwise_rule)


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
