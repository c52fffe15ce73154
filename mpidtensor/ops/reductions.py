"""Reduction ops: sum (and nansum), mean, amax/amin, max/min (whole and with indices), argmax/argmin,
var/std (and var_mean/std_mean), linalg_vector_norm, prod, any/all, and the scans
cumsum/cumprod.

Per mesh dim of the input:

* a shard of a kept dim stays a shard (renumbered when ``keepdim=False``): no communication;
* a shard of a reduced dim gives a ``Partial`` output when the global result is that
  reduction of the per-shard results (sum and mean -> P(sum), with mean dividing the local
  sum by the GLOBAL count; amax -> P(max); prod -> P(product); any -> P(max); all -> P(min);
  1-norm -> P(sum)); otherwise the local op combines the shards itself with collectives
  over output-sized statistics (var/std, p-norms, logsumexp, arg-selection, scans), unless
  moving the input's shards to a kept dim first costs less (short reduced dims);
* a ``Partial`` input stays ``Partial`` where the op commutes with its reduction (sum/mean
  of P(sum), amax of P(max), ...); otherwise it is reduced first, by a reduce-scatter onto
  a free kept dim when there is one, else by an all-reduce.

Empty local shards (uneven sizes) contribute the op's identity where torch would raise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..tensor.layout import local_shape_and_offset
from ..comm import collectives
from ..tensor.placements import Partial, Placement, Replicate, Shard
from ..tensor.spec import DTensorSpec
from .registry import COST, OpCall, Sharding, redistribute_cost, register, replicate_all

aten = torch.ops.aten

Placements = tuple[Placement, ...]
_LINEAR = ("sum", "avg")
_NO_INDEX = torch.iinfo(torch.int64).max  # the index of an empty shard: loses every tie


# --- layout shared by all reductions -----------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """How a reduction of the (single) tensor input runs.

    ``spec``: the input after redistribution; ``kept``: per mesh dim, the output placement,
    or None where that mesh dim shards a reduced dim (the op decides what that gives)."""

    spec: DTensorSpec
    dims: tuple[int, ...]
    keepdim: bool
    kept: tuple[Placement | None, ...]

    @property
    def inputs(self) -> Placements:
        return self.spec.placements

    @property
    def across(self) -> tuple[int, ...]:
        """Mesh dims that shard a reduced dim."""
        return tuple(m for m, p in enumerate(self.kept) if p is None)

    def outputs(self, reduced: Placement) -> Placements:
        """Output placements, with ``reduced`` on the mesh dims of :attr:`across`."""
        return tuple(reduced if p is None else p for p in self.kept)

    def comm(self):
        """The communicator over :attr:`across` (made at plan time: collective on first use)."""
        return self.spec.mesh.comm_for(self.across)

    def local_shape(self) -> tuple[int, ...]:
        return self.spec.local_shape_and_offset()[0]

    def kept_empty(self) -> bool:
        """This rank's block is empty along a kept dim: then so is every block of the
        :attr:`across` group (they differ only along reduced dims), which can skip collectives."""
        return any(n == 0 for d, n in enumerate(self.local_shape()) if d not in self.dims)


def _layout(
    call: OpCall, dims: tuple[int, ...], keepdim: bool, keeps: tuple[str, ...] = (), move: bool = False
) -> _Layout:
    """Input and output placements of a reduction over ``dims``. Partial inputs whose op is
    not in ``keeps`` are reduced first; with ``move``, shards of reduced dims are moved away
    too, so that the op runs locally."""
    spec = call.tensor_specs[0]
    targets = list(spec.placements)
    for m, p in enumerate(targets):
        if (isinstance(p, Partial) and p.reduce_op not in keeps) or (move and isinstance(p, Shard) and p.dim in dims):
            targets[m] = _relocate(spec, targets, dims, m)
    kept: list[Placement | None] = []
    for p in targets:
        if isinstance(p, Shard):
            kept.append(None if p.dim in dims else Shard(_out_dim(p.dim, dims, keepdim)))
        else:
            kept.append(p)
    return _Layout(spec.with_placements(targets), dims, keepdim, tuple(kept))


def _relocate(spec: DTensorSpec, targets: list[Placement], dims: tuple[int, ...], m: int) -> Placement:
    """Where mesh dim ``m``'s placement goes when the op cannot keep it: a shard of the
    longest dim outside ``dims`` that no other mesh dim shards (if it has a row per rank;
    reached by a reduce-scatter or an all-to-all), else Replicate."""
    taken = {p.dim for i, p in enumerate(targets) if isinstance(p, Shard) and i != m}
    free = [d for d in range(spec.ndim) if d not in dims and d not in taken and spec.shape[d] >= spec.mesh.shape[m]]
    return Shard(max(free, key=lambda d: spec.shape[d])) if free else Replicate()


def _out_dim(d: int, dims: tuple[int, ...], keepdim: bool) -> int:
    return d if keepdim else d - sum(r < d for r in dims)


def _cheapest_way(
    call: OpCall, lay: _Layout, stats_cost: Callable[[int, int], float], keeps: tuple[str, ...] = ()
) -> _Layout:
    """``lay`` (the op combines the shards of reduced dims itself) or the layout that moves
    them away first, whichever costs less in the registry's units. ``stats_cost(group, kept)``:
    the op's collectives over a group of ``group`` ranks for ``kept`` output elements. Only
    global sizes enter, so every rank chooses alike."""
    if not lay.across:
        return lay
    spec = call.tensor_specs[0]
    moved = _layout(call, lay.dims, lay.keepdim, keeps, move=True)
    group = math.prod(call.mesh.shape[m] for m in lay.across)
    kept = math.prod(n for d, n in enumerate(spec.shape) if d not in lay.dims)
    combined = redistribute_cost(spec, lay.inputs) + stats_cost(group, kept)
    return lay if combined <= redistribute_cost(spec, moved.inputs) else moved


# --- argument helpers --------------------------------------------------------------------------


def _reduced_dims(dim, ndim: int, empty_means_all: bool = True) -> tuple[int, ...]:
    """Sorted non-negative reduced dims; ``None`` (and ``[]``, for most ops) means all."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if not dim and empty_means_all:
        return tuple(range(ndim))
    return tuple(sorted({d % ndim for d in dim})) if ndim else ()


def _name(call: OpCall) -> str:
    return call.func._schema.name.split("::")[-1]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype to sum in across shards (half precisions accumulate in float32, as torch does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _identity(op: str, dtype: torch.dtype):
    """What an empty shard contributes to a max or a min."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _out_local_shape(call: OpCall, placements: Placements, index: int = 0) -> tuple[int, ...]:
    meta = call.out_metas()[index]
    return local_shape_and_offset(meta.shape, placements, call.mesh.shape, call.mesh._coord)[0]


def _filled_if_empty(call: OpCall, lay: _Layout, out: Placements, fill) -> Callable | None:
    """On a rank whose input block is empty, a local op giving ``fill`` (torch would raise
    reducing nothing); elsewhere None (the op itself)."""
    if 0 not in lay.local_shape():
        return None
    shape, dtype = _out_local_shape(call, out), call.out_metas()[0].dtype
    return lambda a, k: torch.full(shape, fill, dtype=dtype, device=a[0].device)


def _empty_outputs(call: OpCall, outs: list[Placements]) -> Callable:
    """A local op returning the (empty) local outputs, for a group with nothing to combine."""
    metas = call.out_metas()
    shapes = [_out_local_shape(call, p, i) for i, p in enumerate(outs)]

    def local(a, k):
        res = [torch.empty(s, dtype=m.dtype, device=a[0].device) for s, m in zip(shapes, metas)]
        return tuple(res) if len(res) > 1 else res[0]

    return local


# --- sum, mean, prod, amax/amin, max/min, any/all: Partial outputs ------------------------------


@register(aten.sum.default, aten.sum.dim_IntList, aten.nansum.default)
def sum_rule(call: OpCall) -> Sharding:
    """Shards of reduced dims give P(sum); P(sum)/P(avg) inputs stay Partial for sum (linear),
    not for nansum (a NaN part need not make a NaN whole)."""
    b = call.bound()
    keeps = _LINEAR if _name(call) == "sum" else ()
    lay = _layout(call, _reduced_dims(b.get("dim"), call.tensor_specs[0].ndim), bool(b.get("keepdim")), keeps)
    return Sharding([lay.inputs], [lay.outputs(Partial("sum"))])


@register(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Sharding:
    """Like sum; across shards the local op is the local sum over the GLOBAL count."""
    b = call.bound()
    spec = call.tensor_specs[0]
    dims = _reduced_dims(b.get("dim"), spec.ndim)
    keepdim = bool(b.get("keepdim"))
    lay = _layout(call, dims, keepdim, _LINEAR)
    out = lay.outputs(Partial("sum"))
    if not lay.across:
        return Sharding([lay.inputs], [out])
    count = math.prod(spec.shape[d] for d in dims)
    out_dtype = call.out_metas()[0].dtype
    acc = _accumulator(out_dtype)
    dim_list = list(dims)

    def local(a, k):
        return torch.sum(a[0], dim_list, keepdim, dtype=acc).div_(count).to(out_dtype)

    return Sharding([lay.inputs], [out], local)


@register(aten.prod.default, aten.prod.dim_int)
def prod_rule(call: OpCall) -> Sharding:
    """Shards of reduced dims give P(product) (an empty shard's product is 1)."""
    b = call.bound()
    lay = _layout(call, _reduced_dims(b.get("dim"), call.tensor_specs[0].ndim), bool(b.get("keepdim")), ("product",))
    return Sharding([lay.inputs], [lay.outputs(Partial("product"))])


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def extremum_rule(call: OpCall) -> Sharding:
    """Shards of reduced dims give P(max)/P(min); empty shards hold the op's identity."""
    op = "max" if _name(call) in ("amax", "max") else "min"
    b = call.bound()
    spec = call.tensor_specs[0]
    lay = _layout(call, _reduced_dims(b.get("dim"), spec.ndim), bool(b.get("keepdim")), (op,))
    out = lay.outputs(Partial(op))
    return Sharding([lay.inputs], [out], _filled_if_empty(call, lay, out, _identity(op, spec.dtype)))


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def any_all_rule(call: OpCall) -> Sharding:
    """Shards of reduced dims give P(max) (any) / P(min) (all) on the 0/1 result. A P(max)/P(min)
    input stays Partial only for bool/uint8 (non-negative, so max/min commute with != 0)."""
    op = "max" if _name(call) == "any" else "min"
    b = call.bound()
    spec = call.tensor_specs[0]
    keeps = (op,) if spec.dtype in (torch.bool, torch.uint8) else ()
    lay = _layout(call, _reduced_dims(b.get("dim"), spec.ndim, empty_means_all=False), bool(b.get("keepdim")), keeps)
    return Sharding([lay.inputs], [lay.outputs(Partial(op))])


# --- max/min with indices, argmax/argmin: a cross-rank selection -------------------------------


@register(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def select_rule(call: OpCall) -> Sharding:
    """Across shards of the selected dim(s), each rank reduces its block, turns the index
    global, and all-gathers of (value, index) per output element pick the winner: the first
    global index holding the extremum (NaN wins, as in torch); the outputs are replicated
    over those mesh dims. Where moving the input's shards away is cheaper (short dims), it
    is done instead and the op runs locally."""
    op = "max" if "max" in _name(call) else "min"
    b = call.bound()
    spec = call.tensor_specs[0]
    flat = b["dim"] is None
    lay = _layout(call, _reduced_dims(b["dim"], spec.ndim), bool(b["keepdim"]))
    pair_size = spec.dtype.itemsize + 8  # a value and an int64 index
    lay = _cheapest_way(call, lay, lambda group, kept: COST["all_gather"] * group * kept * pair_size)
    out = lay.outputs(Replicate())
    n_out = len(call.out_metas())
    if not lay.across:
        return Sharding([lay.inputs], [out] * n_out)
    if lay.kept_empty():
        return Sharding([lay.inputs], [out] * n_out, _empty_outputs(call, [out] * n_out))
    return Sharding([lay.inputs], [out] * n_out, _select_local(call, lay, op, flat, n_out == 2))


def _select_local(call: OpCall, lay: _Layout, op: str, flat: bool, with_values: bool) -> Callable:
    spec = lay.spec
    shape, offset = spec.local_shape_and_offset()
    comm = lay.comm()
    sizes = (1,) * comm.size
    empty = 0 in shape
    fill = _identity(op, spec.dtype)
    pick = torch.amax if op == "max" else torch.amin
    reduce = torch.max if op == "max" else torch.min
    floating = spec.dtype.is_floating_point
    if flat:
        block_shape: tuple[int, ...] = ()
        to_global = _flat_index_to_global(shape, offset, spec.shape)
        out_shape = call.out_metas()[-1].shape
    else:
        d = lay.dims[0]
        block_shape = tuple(1 if i == d else n for i, n in enumerate(shape))
        start = offset[d]

    def local(a, k):
        x = a[0]
        if empty:
            v = torch.full(block_shape, fill, dtype=x.dtype, device=x.device)
            i = torch.full(block_shape, _NO_INDEX, dtype=torch.int64, device=x.device)
        elif flat:
            v, i = reduce(x.reshape(-1), 0)
            i = to_global(i)
        else:
            v, i = reduce(x, d, keepdim=True)
            i = i + start
        values = collectives.all_gather(v.unsqueeze(0), comm, dim=0, sizes=sizes)
        indices = collectives.all_gather(i.unsqueeze(0), comm, dim=0, sizes=sizes)
        best = pick(values, 0)
        hit = values == best
        if floating:
            hit |= values.isnan()  # a NaN anywhere makes ``best`` NaN
        index = torch.where(hit, indices, _NO_INDEX).amin(0)
        if flat:
            index = index.reshape(out_shape)
        elif not lay.keepdim:
            best, index = best.squeeze(d), index.squeeze(d)
        return (best, index) if with_values else index

    return local


def _flat_index_to_global(shape, offset, global_shape) -> Callable:
    """Maps a flat index into this rank's block to a flat index into the global tensor."""
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    dims = list(zip(shape, offset, strides))[::-1]

    def to_global(i: torch.Tensor) -> torch.Tensor:
        g = torch.zeros_like(i)
        for size, off, stride in dims:
            g += (i % size + off) * stride
            i = i // size
        return g

    return to_global


# --- var/std, vector norms: collectives on output-sized statistics ------------------------------


@register(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def moments_rule(call: OpCall) -> Sharding:
    """Across shards: all-reduce the local sums for the global mean, then the squared
    deviations from it. ``var`` skips the second all-reduce and stays P(sum) (when the
    divisor is positive, so that no 0/0 is summed); the mean is replicated. Where moving the
    input's shards away is cheaper (short dims), it is done instead."""
    name = _name(call)
    b = call.bound()
    spec = call.tensor_specs[0]
    dims = _reduced_dims(b["dim"], spec.ndim)
    count = math.prod(spec.shape[d] for d in dims)
    correction = 1 if b["correction"] is None else b["correction"]
    if count == 0:  # nothing to reduce: torch's NaNs, from the (empty) whole tensor
        return replicate_all(call)
    divisor = max(0, count - correction)
    lazy = name.startswith("var") and divisor > 0
    acc = _accumulator(spec.dtype)
    passes = 1 if lazy else 2
    lay = _layout(call, dims, bool(b["keepdim"]))
    lay = _cheapest_way(call, lay, lambda group, kept: COST["all_reduce"] * kept * acc.itemsize * passes)
    n_out = len(call.out_metas())
    if not lay.across:
        outs = [lay.outputs(Replicate())] * n_out
        # torch warns on an empty block (zero degrees of freedom); its outputs are empty anyway
        return Sharding([lay.inputs], outs, _empty_outputs(call, outs) if 0 in lay.local_shape() else None)
    outs = [lay.outputs(Partial("sum") if lazy else Replicate()), lay.outputs(Replicate())][:n_out]
    if lay.kept_empty():
        return Sharding([lay.inputs], outs, _empty_outputs(call, outs))
    comm = lay.comm()
    dim_list, keepdim = list(dims), lay.keepdim
    std, with_mean = name.startswith("std"), n_out == 2
    out_dtypes = [m.dtype for m in call.out_metas()]

    def local(a, k):
        x = a[0].to(acc)
        mean = collectives.all_reduce(x.sum(dim_list, keepdim=True), comm, "sum") / count
        dev = x - mean
        sq = (dev.abs().square() if dev.is_complex() else dev.square()).sum(dim_list, keepdim=True)
        if not lazy:
            sq = collectives.all_reduce(sq, comm, "sum")
        stat = sq / divisor
        if std:
            stat = stat.sqrt()
        if not keepdim:
            stat, mean = stat.squeeze(dim_list), mean.squeeze(dim_list)
        stat = stat.to(out_dtypes[0])
        return (stat, mean.to(out_dtypes[1])) if with_mean else stat

    return Sharding([lay.inputs], outs, local)


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(call: OpCall) -> Sharding:
    """Across shards: ord=inf/-inf give P(max)/P(min) of |x| (an empty shard holds 0 / inf),
    ord=0/1 give P(sum); other ords all-reduce the local sums of |x|^ord and take the root
    (or move the input's shards away, where that is cheaper)."""
    b = call.bound()
    spec = call.tensor_specs[0]
    dims = _reduced_dims(b["dim"], spec.ndim)
    keepdim = bool(b["keepdim"])
    lay = _layout(call, dims, keepdim)
    order = float(b["ord"])
    combine = {math.inf: "max", -math.inf: "min", 0.0: "sum", 1.0: "sum"}.get(order)
    out_dtype = call.out_metas()[0].dtype
    if combine is None:
        lay = _cheapest_way(call, lay, lambda group, kept: COST["all_reduce"] * kept * out_dtype.itemsize)
    if combine is not None or not lay.across:
        out = lay.outputs(Partial(combine) if combine else Replicate())
        fill = 0 if order == math.inf else math.inf
        local = _filled_if_empty(call, lay, out, fill) if combine in ("max", "min") and lay.across else None
        return Sharding([lay.inputs], [out], local)
    out = lay.outputs(Replicate())
    if lay.kept_empty():
        return Sharding([lay.inputs], [out], _empty_outputs(call, [out]))
    comm = lay.comm()
    acc = _accumulator(b["dtype"] or spec.dtype)
    dim_list = list(dims)

    def local(a, k):
        powers = a[0].to(acc).abs().pow(order).sum(dim_list, keepdim=keepdim)
        return collectives.all_reduce(powers, comm, "sum").pow(1.0 / order).to(out_dtype)

    return Sharding([lay.inputs], [out], local)


@register(aten.logsumexp.default)
def logsumexp_rule(call: OpCall) -> Sharding:
    """Across shards: all-reduce the local maxima (an empty shard holds -inf), then the local
    sums of exp(x - max); infinite maxima are shifted by 0, as torch does. Where moving the
    input's shards away is cheaper (short dims), that is done instead."""
    b = call.bound()
    spec = call.tensor_specs[0]
    dims = _reduced_dims(b["dim"], spec.ndim)
    out_dtype = call.out_metas()[0].dtype
    lay = _layout(call, dims, bool(b["keepdim"]))
    lay = _cheapest_way(call, lay, lambda group, kept: 2 * COST["all_reduce"] * kept * out_dtype.itemsize)
    out = lay.outputs(Replicate())
    if not lay.across:
        return Sharding([lay.inputs], [out])
    if lay.kept_empty():
        return Sharding([lay.inputs], [out], _empty_outputs(call, [out]))
    comm = lay.comm()
    acc = _accumulator(out_dtype)
    dim_list, keepdim = list(dims), lay.keepdim
    empty = 0 in lay.local_shape()
    block_shape = tuple(1 if d in dims else n for d, n in enumerate(lay.local_shape()))

    def local(a, k):
        x = a[0].to(acc)
        top = torch.full(block_shape, -math.inf, dtype=acc, device=x.device) if empty else x.amax(dim_list, True)
        top = collectives.all_reduce(top, comm, "max")
        top = top.masked_fill(top.isinf(), 0)
        total = collectives.all_reduce((x - top).exp().sum(dim_list, keepdim=True), comm, "sum")
        res = total.log() + top
        return (res if keepdim else res.squeeze(dim_list)).to(out_dtype)

    return Sharding([lay.inputs], [out], local)


# --- scans --------------------------------------------------------------------------------------


@register(aten.cumsum.default, aten.cumprod.default)
def scan_rule(call: OpCall) -> Sharding:
    """Shards stay shards. Across shards of the scanned dim, an exclusive scan: each rank
    scans its block, all-gathers the blocks' last slices and adds (multiplies by) those
    of the ranks before it (or the shards move to another dim, where that is cheaper).
    P(sum) (cumsum) and P(product) (cumprod) inputs stay Partial."""
    is_sum = _name(call) == "cumsum"
    b = call.bound()
    spec = call.tensor_specs[0]
    dims = _reduced_dims(b["dim"], spec.ndim)
    keeps = _LINEAR if is_sum else ("product",)
    out_dtype = call.out_metas()[0].dtype
    lay = _layout(call, dims, True, keeps)
    lay = _cheapest_way(call, lay, lambda group, kept: COST["all_gather"] * group * kept * out_dtype.itemsize, keeps)
    out = tuple(lay.inputs)
    if not lay.across or lay.kept_empty():
        return Sharding([lay.inputs], [out])
    comm = lay.comm()
    rank, sizes = comm.rank, (1,) * comm.size
    d = dims[0]
    shape = lay.local_shape()
    n = shape[d]
    last_shape = tuple(1 if i == d else s for i, s in enumerate(shape))
    fold = torch.sum if is_sum else torch.prod
    scan = torch.cumsum if is_sum else torch.cumprod
    identity = 0 if is_sum else 1

    def local(a, k):
        c = scan(a[0], d, dtype=out_dtype)
        last = c.narrow(d, n - 1, 1) if n else torch.full(last_shape, identity, dtype=out_dtype, device=c.device)
        totals = collectives.all_gather(last.unsqueeze(0), comm, dim=0, sizes=sizes)
        if rank == 0 or not n:
            return c
        before = fold(totals[:rank], 0)
        return c + before if is_sum else c * before

    return Sharding([lay.inputs], [out], local)


@register(aten.flip.default)
def flip_rule(call: OpCall) -> Sharding:
    """The scans' backward (cumsum, cumprod, prod) flips. A block of a flipped dim would
    belong to the mirrored rank, with another size when shards are uneven, so such shards
    move to a free unflipped dim (all-to-all) or are gathered; other shards and every
    Partial stay (a permutation commutes with any reduction)."""
    spec = call.tensor_specs[0]
    dims = _reduced_dims(call.args[1], spec.ndim, empty_means_all=False)
    targets = list(spec.placements)
    for m, p in enumerate(targets):
        if isinstance(p, Shard) and p.dim in dims:
            targets[m] = _relocate(spec, targets, dims, m)
    return Sharding([tuple(targets)], [tuple(targets)])


@register(aten._foreach_norm.Scalar)
def foreach_norm_rule(call: OpCall) -> Sharding:
    """``_foreach_norm(tensors, ord, dtype)``: each tensor's vector norm, replicated.

    Partial inputs are reduced first (a norm is not linear); shards stay where they are.
    Each rank takes the norm statistic of its blocks (sum of |x|^ord; max/min of |x| for
    ord=inf/-inf, an empty block giving 0/inf; the nonzero count for ord=0), and the
    tensors sharded over the same mesh dims share one all-reduce of the stacked
    statistics, so a list costs one all-reduce per distinct set of sharded mesh dims."""
    b = call.bound()
    order = float(b["ord"])
    combine = {math.inf: "max", -math.inf: "min"}.get(order, "sum")
    inputs, groups = [], {}
    for j, spec in enumerate(call.tensor_specs):
        targets = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        inputs.append(targets)
        across = tuple(m for m, p in enumerate(targets) if p.is_shard() and call.mesh.shape[m] > 1)
        groups.setdefault(across, []).append(j)
    comms = {across: call.mesh.comm_for(across) for across in groups if across}
    out_dtypes = [m.dtype for m in call.out_metas()]
    outputs = [(Replicate(),) * call.ndim] * len(out_dtypes)

    def statistic(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x.abs().to(dtype)  # abs first: a complex tensor's norm is real
        if combine == "max":
            return x.amax() if x.numel() else x.new_zeros(())
        if combine == "min":
            return x.amin() if x.numel() else x.new_full((), math.inf)
        return (x != 0).sum().to(dtype) if order == 0 else x.pow(order).sum()

    def local(a, k):
        tensors = a[0]
        results: list[torch.Tensor | None] = [None] * len(tensors)
        for across, members in groups.items():
            acc = max((_accumulator(out_dtypes[j]) for j in members), key=lambda d: d.itemsize)
            stats = torch.stack([statistic(tensors[j], acc) for j in members])
            if across:
                stats = collectives.all_reduce(stats, comms[across], combine)
            if combine == "sum" and order not in (0.0, 1.0):
                stats = stats.pow(1.0 / order)
            for j, value in zip(members, stats.unbind()):
                results[j] = value.to(out_dtypes[j])
        return results

    return Sharding(inputs, outputs, local)
