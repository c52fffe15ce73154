"""What the sharding rules of indexing ops share: the choice among placement options by
bytes moved, GLOBAL index values mapped to a local block, and index bounds checked on
every rank. The rules: ``gather_scatter`` (index_select, gather, the scatter family,
index_add, the ``new_*`` factories), ``advanced_indexing`` (``index.Tensor``,
``index_put``, ``masked_fill`` with a tensor value), ``sorting`` (sort, topk, kthvalue).

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

from ..tensor.placements import Partial, Placement, Replicate, Shard
from ..tensor.spec import DTensorSpec
from .registry import COST, OpCall, Sharding, register, replicate_all, valid_placements

R = Replicate()
SUM = Partial("sum")
LINEAR = ("sum", "avg")  # Partial ops that commute with an addition or with zero-filling


@dataclass(frozen=True)
class Option:
    """Placements at one mesh dim: one per tensor input, one per output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


def choose(call: OpCall, options: Callable[[int], list[Option]], inplace: bool = False):
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


def _valid(opt: Option, specs: Sequence[DTensorSpec], out_ndims: list[int]) -> bool:
    """No Shard of a dim its tensor lacks (a 0-d operand can only be replicated or partial)."""
    return all(valid_placements((p,), s.ndim) for p, s in zip(opt.inputs, specs)) and all(
        valid_placements((p,), n) for p, n in zip(opt.outputs, out_ndims)
    )


def _cost(specs: Sequence[DTensorSpec], m: int, opt: Option, out_bytes: list[int]) -> float:
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


def partial_at(specs: Sequence[DTensorSpec], m: int) -> Partial | None:
    """The one Partial placement the inputs share at mesh dim ``m`` (None if none or mixed)."""
    found = {s.placements[m] for s in specs if isinstance(s.placements[m], Partial)}
    return found.pop() if len(found) == 1 else None


def sums_only(spec: DTensorSpec) -> bool:
    """Masking a shard into a new Partial(sum) is only sound next to sum/avg Partials."""
    return all(p.reduce_op in LINEAR for p in spec.placements if isinstance(p, Partial))


def norm_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _span(spec: DTensorSpec, placements, dim: int) -> tuple[int, int]:
    """(global offset, size) along ``dim`` of this rank's block under ``placements``."""
    shape, offset = spec.with_placements(placements).local_shape_and_offset()
    return offset[dim], shape[dim]


def _is_sharded(placements, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in placements)


def is_inplace(call: OpCall) -> bool:
    return call.func._schema.name.endswith("_")


# --- mapping global indices to a local block ----------------------------------------------------


def read_index(index: torch.Tensor, offset: int, size: int):
    """Local positions of global ``index`` in a block [offset, offset+size) of length
    max(size, 1) (clamped) and the mask of those that fall inside it."""
    mask = (index >= offset) & (index < offset + size)
    return (index - offset).clamp_(0, max(size - 1, 0)), mask


def nonempty(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` itself, or one zero slot along ``dim`` if it is empty there (so reads can run)."""
    if t.shape[dim] > 0:
        return t
    shape = list(t.shape)
    shape[dim] = 1
    return t.new_zeros(shape)


def write_index(index: torch.Tensor, offset: int, size: int, length: int | None = None) -> torch.Tensor:
    """Local positions of global ``index`` in the block; entries outside go to slot ``size``.
    ``length`` (the global length) wraps negative indices first."""
    if length is not None:
        index = index.remainder(length)
    inside = (index >= offset) & (index < offset + size)
    return torch.where(inside, index - offset, size)


def padded(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """A copy of ``t`` with one extra zero slot at the end of each of ``dims`` (absorbs foreign writes)."""
    for d in dims:
        shape = list(t.shape)
        shape[d] = 1
        t = torch.cat([t, t.new_zeros(shape)], d)
    return t


def unpadded(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    for d in dims:
        t = t.narrow(d, 0, t.shape[d] - 1)
    return t.contiguous()


def finish(self_local: torch.Tensor, result: torch.Tensor, inplace: bool) -> torch.Tensor:
    return self_local.copy_(result) if inplace else result


def register_on_dim(*ops):
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


def at_index(call: OpCall, dims: Sequence[int], options: Callable[[int], list[Option]], checks: Sequence[tuple],
              local_for: Callable[[dict[int, tuple[int, int]]], Callable], inplace: bool = False,
              error: type = RuntimeError) -> Sharding:
    """The rule of an op on ``self`` at the positions its index tensors give along
    ``dims``: the cheapest of ``options``; where that splits ``self`` along some of
    ``dims``, the local op ``local_for(spans)``, ``spans`` giving this rank's block
    ``(offset, size)`` along each split dim; the indices checked by ``checks`` against
    ``self``'s global lengths (see :func:`_bounded`)."""
    inputs, outputs = choose(call, options, inplace)
    spans = {k: _span(call.tensor_specs[0], inputs[0], k) for k in dims if _is_sharded(inputs[0], k)}
    local = local_for(spans) if spans else None
    return _bounded(call, Sharding(inputs, outputs, local), checks, error)


def on_dim(dim: int) -> list[tuple]:
    """The check of an op whose index is argument 2 (tensor input 1), along ``dim``."""
    return [(1, lambda a: a[2], dim, False)]
