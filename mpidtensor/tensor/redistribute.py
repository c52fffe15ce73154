"""Redistribution: the plan of collectives that turns one placement list into another.

Planning works on one rank's view (sizes depend on its coordinate) and is cached
per (source spec, target spec). Two passes over the mesh dims:

A. inner to outer: every mesh dim whose placement changes, or that shards a
   tensor dim whose outer sharding changes, leaves its placement: Shard(i)->Shard(j)
   by one all-to-all, Partial->Shard by reduce-scatter where the target nesting
   allows it directly, otherwise Shard->Replicate by all-gather and
   Partial->Replicate by all-reduce;
B. outer to inner: Replicate->Shard by a local chunk (no communication) and
   Replicate->Partial (internal: gradients) by keeping the value on one rank.

A ``_StridedShard`` is planned as a ``Shard`` of its block listed in another order
(:func:`layout.split_order`: its pieces, rank after rank): the same collectives with
its piece sizes, a local :class:`Take` that lists the block in that order before a
collective scatters it, and one that restores the block's order after a collective
gathered it; Replicate->_StridedShard takes this rank's runs of the block.

Adjacent all-gathers of one tensor dim, and adjacent all-reduces of one op, are
merged into a single collective over the flattened communicator of their mesh dims.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

from .layout import Runs, chunk_span, inverse_order, local_span, nested_sizes, runs_of, split_order, split_runs
from ..comm import collectives
from ..comm.collectives import (
    Prepared,
    prepare_all_gather,
    prepare_all_reduce,
    prepare_all_to_all,
    prepare_reduce_scatter,
)
from .placements import Partial, Placement, Replicate, Shard, shard_dim
from ..runtime import caches
from .spec import DTensorSpec


class _Collective:
    """A step that is one collective. Its first run on a plain tensor prepares the collective
    for that tensor's shape and dtype on the mesh's communicator
    (:class:`comm.prepared.Prepared`: checks, algorithm, counts and datatypes decided once)
    and keeps it on the step, which a plan holds: later runs go straight to MPI.
    ``inplace``: the caller owns ``t`` and no longer needs it (an all-reduce may reuse it)."""

    def run(self, t, mesh, inplace=False):
        if type(t) is not torch.Tensor:  # e.g. traced by torch.compile: nothing to keep
            return self.collective(t, mesh.comm_for(self.mesh_dims), inplace)
        return self.prepared(t, mesh, inplace)(t)

    def prepared(self, t: torch.Tensor, mesh, inplace: bool = False) -> Prepared:
        """The collective prepared for ``t``'s shape and dtype on ``mesh``, kept on the step."""
        kept = self.__dict__.get("_kept")
        if kept is None:
            kept = {}
            object.__setattr__(self, "_kept", kept)  # not a field: equality and hash ignore it
        entry = kept.get(inplace)
        if entry is None or entry[0] is not mesh:
            entry = kept[inplace] = (mesh, self.prepare(t.shape, t.dtype, mesh.comm_for(self.mesh_dims), inplace))
        return entry[1]


@dataclass(frozen=True)
class AllGather(_Collective):
    mesh_dims: tuple[int, ...]
    dim: int
    sizes: tuple[int, ...]
    block: int  # length along `dim` of the block gathered (for merging)
    parts: tuple[int, ...]  # mesh sizes of `mesh_dims` (for merging)
    chunked: bool = True  # the pieces are torch.chunk's of the block (a Shard's), nested over `parts`

    def prepare(self, shape, dtype, comm, inplace):
        return prepare_all_gather(shape, dtype, comm, dim=self.dim, sizes=self.sizes)

    def collective(self, t, comm, inplace):
        return collectives.all_gather(t, comm, dim=self.dim, sizes=self.sizes)


@dataclass(frozen=True)
class AllToAll(_Collective):
    mesh_dims: tuple[int, ...]
    split_dim: int
    concat_dim: int
    split_sizes: tuple[int, ...]
    concat_sizes: tuple[int, ...]

    def prepare(self, shape, dtype, comm, inplace):
        return prepare_all_to_all(shape, dtype, comm, **self._args())

    def collective(self, t, comm, inplace):
        return collectives.all_to_all(t, comm, **self._args())

    def _args(self) -> dict:
        return dict(split_dim=self.split_dim, concat_dim=self.concat_dim, split_sizes=self.split_sizes,
                    concat_sizes=self.concat_sizes)


@dataclass(frozen=True)
class AllReduce(_Collective):
    mesh_dims: tuple[int, ...]
    op: str

    def prepare(self, shape, dtype, comm, inplace):
        return prepare_all_reduce(shape, dtype, comm, self.op, inplace=inplace)

    def collective(self, t, comm, inplace):
        return collectives.all_reduce(t, comm, self.op, inplace=inplace)


@dataclass(frozen=True)
class ReduceScatter(_Collective):
    mesh_dims: tuple[int, ...]
    op: str
    dim: int
    sizes: tuple[int, ...]

    def prepare(self, shape, dtype, comm, inplace):
        return prepare_reduce_scatter(shape, dtype, comm, self.op, dim=self.dim, sizes=self.sizes)

    def collective(self, t, comm, inplace):
        return collectives.reduce_scatter(t, comm, self.op, dim=self.dim, sizes=self.sizes)


@dataclass(frozen=True)
class Chunk:
    """Keep this rank's chunk of a replicated tensor: no communication. The chunk is
    made contiguous (a copy only when it is not already), as a shard held on its own
    would be, so that local views match the global tensor's; with ``contiguous=False``
    a ``Restride`` that follows lays it out instead (a transposed global tensor)."""

    dim: int
    offset: int
    size: int
    contiguous: bool = True

    def run(self, t, mesh):
        t = t.narrow(self.dim, self.offset, self.size)
        return t.contiguous() if self.contiguous else t


@dataclass(frozen=True)
class Take:
    """Keep runs of positions along ``dim``, in this order, as one contiguous tensor: a
    rank's runs of a block (Replicate->_StridedShard), or the block listed in another
    order (before a _StridedShard's pieces are scattered, after they were gathered)."""

    dim: int
    runs: Runs

    def run(self, t, mesh):
        if len(self.runs) == 1:
            return t.narrow(self.dim, *self.runs[0]).contiguous()
        if not self.runs:
            return t.narrow(self.dim, 0, 0).contiguous()
        return torch.cat([t.narrow(self.dim, o, n) for o, n in self.runs], self.dim)


@dataclass(frozen=True)
class ToPartial:
    """Replicate -> Partial(op): a value whose reduction over the mesh dim is the replica."""

    op: str
    keep: bool  # this rank keeps the value; the others hold the op's identity

    def run(self, t, mesh):
        if self.keep or self.op in ("avg", "min", "max"):
            return t
        return torch.ones_like(t) if self.op == "product" else torch.zeros_like(t)


@dataclass(frozen=True)
class Restride:
    """Lay the local tensor out in the global tensor's dim order (collectives return
    C-contiguous tensors, but e.g. a transposed DTensor's local must stay transposed
    so that local views and kernels see what the global strides promise)."""

    order: tuple[int, ...]  # dims from outermost to innermost in memory
    inverse: tuple[int, ...]

    def run(self, t, mesh):
        if t.permute(self.order).is_contiguous():
            return t
        return t.permute(self.order).contiguous().permute(self.inverse)


Step = AllGather | AllToAll | AllReduce | ReduceScatter | Chunk | Take | ToPartial | Restride

# Plans by (source spec, target spec); specs hold their mesh, so freeing it clears these.
_PLANS: dict[tuple[DTensorSpec, DTensorSpec], tuple[Step, ...]] = caches.cache("redistribute.plans", 4096)


def plan(src: DTensorSpec, dst: DTensorSpec) -> tuple[Step, ...]:
    """The steps that turn this rank's local tensor of ``src`` into its local tensor of ``dst``."""
    key = (src, dst)
    steps = _PLANS.get(key)
    if steps is None:
        src.mesh._require_live()  # a freed mesh's specs miss every cache and stop here
        steps = _merge(_plan(src, dst))
        order = _memory_order(dst.shape, dst.stride)
        if order != tuple(range(len(order))) and any(not isinstance(s, ToPartial) for s in steps):
            steps = tuple(replace(s, contiguous=False) if isinstance(s, Chunk) else s for s in steps)
            steps += (Restride(order, tuple(order.index(d) for d in range(len(order)))),)
        _PLANS[key] = steps
    return steps


def _memory_order(shape, stride) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory, as torch orders a dense copy of the
    tensor (``clone``, ``empty_like``): size-1 and expanded (stride 0) dims, whose stride
    says nothing, keep their logical place."""
    order, _ = compute_elementwise_output_logical_to_physical_perm(
        torch.empty_strided(shape, stride, device="meta"))
    return tuple(order)


_MAKES_BUFFER = (AllGather, AllToAll, AllReduce, ReduceScatter)  # steps whose result is a new buffer

# Plans of one collective, by (source spec, target spec): the collective as prepared on the
# first plain tensor, so that a repeated redistribution is one dict lookup from MPI.
_PREPARED: dict[tuple[DTensorSpec, DTensorSpec], Prepared] = caches.cache("redistribute.prepared", 4096)


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's local tensor of ``dst`` from its local tensor ``local`` of ``src``."""
    prepared = _PREPARED.get((src, dst))
    if prepared is not None:  # it takes the general function for any other input
        return prepared(local)
    mesh = src.mesh
    if mesh._coord is None:  # a rank outside a sub-mesh holds an empty tensor and moves nothing (as torch)
        mesh._require_live()
        return local
    steps = plan(src, dst)
    if len(steps) == 1:  # the common case: one collective on the caller's tensor
        step = steps[0]
        if isinstance(step, _Collective) and type(local) is torch.Tensor:
            prepared = _PREPARED[src, dst] = step.prepared(local, mesh)
            return prepared(local)
        return step.run(local, mesh)
    made = False  # whether ``local`` is a buffer an earlier step made, seen by nobody else
    for step in steps:
        if made and type(step) is AllReduce:
            local = step.run(local, mesh, inplace=True)  # MPI_IN_PLACE on our own buffer
        else:
            local = step.run(local, mesh)
        made = isinstance(step, _MAKES_BUFFER) or (type(step) is Take and len(step.runs) > 1)
    return local


def _plan(src: DTensorSpec, dst: DTensorSpec) -> list[Step]:
    mesh, shape = src.mesh, src.shape
    sizes, coord = mesh.shape, mesh._coord
    target = dst.placements
    # A mesh dim of one rank: every placement holds the same local data, no step needed.
    cur: list[Placement] = [t if n == 1 else c for c, t, n in zip(src.placements, target, sizes)]
    steps: list[Step] = []

    def sharders(placements, dim, below):
        return [(m, placements[m]) for m in range(below) if shard_dim(placements[m]) == dim]

    def block(dim, upto):
        """Length along ``dim`` of the block being split by mesh dim ``upto``."""
        return local_span(shape[dim], dim, cur, sizes, coord, upto)[1]

    def may_shard_at(i, dim):
        """Sharding ``dim`` at mesh dim ``i`` now gives the target's nesting for ``dim``."""
        inner_free = all(shard_dim(cur[j]) != dim for j in range(i + 1, len(cur)))
        return inner_free and sharders(cur, dim, i) == sharders(target, dim, i)

    def scattered(i, t):
        """The piece sizes of target ``t`` at mesh dim ``i``, after listing its block in
        the order of its pieces (a step only for a _StridedShard)."""
        piece_sizes, order = split_order(t, block(t.dim, i), sizes[i])
        if order is not None:
            steps.append(Take(t.dim, runs_of(order)))
        return piece_sizes

    def gathered(c, order):
        """Put a gathered block of ``c``'s pieces back in the block's order."""
        if order is not None:
            steps.append(Take(c.dim, runs_of(inverse_order(order))))

    for i in reversed(range(len(cur))):
        c, t = cur[i], target[i]
        if shard_dim(c) is not None:
            stable = c == t and sharders(cur, c.dim, i) == sharders(target, c.dim, i)
            if stable:
                continue
            length = block(c.dim, i)
            piece_sizes, order = split_order(c, length, sizes[i])
            if shard_dim(t) not in (None, c.dim) and may_shard_at(i, t.dim):
                split_sizes = scattered(i, t)
                steps.append(AllToAll((i,), t.dim, c.dim, split_sizes, piece_sizes))
                gathered(c, order)
                cur[i] = t
            else:
                steps.append(AllGather((i,), c.dim, piece_sizes, length, (sizes[i],), type(c) is Shard))
                gathered(c, order)
                cur[i] = Replicate()
        elif isinstance(c, Partial) and c != t:
            if shard_dim(t) is not None and may_shard_at(i, t.dim):
                steps.append(ReduceScatter((i,), c.reduce_op, t.dim, scattered(i, t)))
                cur[i] = t
            else:
                steps.append(AllReduce((i,), c.reduce_op))
                cur[i] = Replicate()

    for i in range(len(cur)):
        c, t = cur[i], target[i]
        if c == t:
            continue
        if not isinstance(c, Replicate):
            raise AssertionError(f"redistribute planner left {c} at mesh dim {i} before {t}")
        if isinstance(t, Shard):
            offset, size = chunk_span(block(t.dim, i), sizes[i], coord[i])
            steps.append(Chunk(t.dim, offset, size))
        elif shard_dim(t) is not None:
            steps.append(Take(t.dim, split_runs(t, block(t.dim, i), sizes[i], coord[i])))
        else:
            steps.append(ToPartial(t.reduce_op, coord[i] == 0))
        cur[i] = t
    return steps


def _merge(steps: list[Step]) -> tuple[Step, ...]:
    """Fuse adjacent collectives over different mesh dims into one over their flattened comm."""
    out: list[Step] = []
    for step in steps:
        prev = out[-1] if out else None
        if isinstance(step, AllGather) and isinstance(prev, AllGather) and prev.dim == step.dim and prev.chunked:
            # `prev` gathered the inner mesh dims, torch.chunk's pieces of each of the
            # pieces `step` gathers over the next outer ones.
            sizes = tuple(n for piece in step.sizes for n in nested_sizes(piece, prev.parts))
            out[-1] = AllGather(step.mesh_dims + prev.mesh_dims, step.dim, sizes, step.block,
                                step.parts + prev.parts, step.chunked)
        elif isinstance(step, AllReduce) and isinstance(prev, AllReduce) and prev.op == step.op:
            out[-1] = AllReduce(tuple(sorted(step.mesh_dims + prev.mesh_dims)), step.op)
        else:
            out.append(step)
    return tuple(out)
