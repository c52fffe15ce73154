"""``Shard(d)`` -> ``Replicate`` of a DTensor on a 1-D mesh run on the local block, as Megatron's
sequence-parallel all-gather.

A sequence-parallel region (``PrepareModuleInput``'s input, a ``ColwiseParallel`` input
read as ``Shard(1)``) starts with this move. The public ``redistribute`` does it through
its entry checks, its autograd Function and the redistribution plan, and its backward
plans ``Partial`` -> ``Shard(d)`` alike. Here one autograd Function calls the all-gather
on the local block; its backward reduce-scatters the ``Partial`` gradient (the sum of
the column-parallel matmuls' input gradients), takes its own block of a replicated one,
and hands any other layout to the public path.

Taken when the redistribution planner makes the move one all-gather (facts every rank
shares: a 1-D mesh holding this rank, placements ``(Shard(d),)``, C-contiguous globally,
so its gradient has its spec), fast paths on (``fast.registry``), not under
``torch.compile``. Uneven blocks (``torch.chunk``'s, e.g. 3 ranks) are
all-gathered with their sizes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..tensor.layout import chunk_sizes, chunk_span, contiguous_strides
from ..tensor.dtensor import DTensor
from ..comm.collectives import prepare_all_gather, prepare_reduce_scatter
from ..tensor.placements import Partial, Replicate, Shard
from ..tensor.spec import DTensorSpec
from ..tensor.redistribute import AllGather, plan
from ..runtime.caches import cache
from .functions import compiler, direct_apply, dynamo_compiling
from .registry import register
from ..runtime.settings import settings

_PARTIAL_SUM = (Partial("sum"),)
GATHER = register(
    "tp.gather",
    shortcuts="Shard(d) -> Replicate of a DTensor on a 1-D mesh by the public redistribute (a style's input "
              "conversion) and its backward",
    decided_by="redistribute.plan: one AllGather on dim d (the route's collectives are that step's)",
)


def _whole(local: torch.Tensor) -> torch.Tensor:
    """A Route's gather on a mesh of one rank: the block is the whole."""
    return local


class Route:
    """How one input spec is all-gathered: the output spec, the communicator, the dim, this
    rank's (offset, size) along it, and the two collectives prepared for this rank's block
    (``comm.prepared``: checks and choices made once, later calls go to MPI). Read
    the other way, a partial whole reduce-scattered to the spec and its gradient gathered
    back (a sequence-parallel row Linear or embedding, :func:`shard_route`)."""

    __slots__ = ("in_spec", "out_spec", "partial_spec", "comm", "dim", "span", "gather", "reduce_scatter")

    def __init__(self, spec: DTensorSpec, dim: int) -> None:
        mesh, shape = spec.mesh, spec.shape
        self.in_spec, self.dim = spec, dim
        self.out_spec = DTensorSpec(mesh, (Replicate(),), shape, spec.stride, spec.dtype)
        # the column-parallel matmuls' gradient of the output (interned: ``block`` tests identity first)
        self.partial_spec = DTensorSpec(mesh, _PARTIAL_SUM, shape, spec.stride, spec.dtype)
        comm = self.comm = mesh.comm_for((0,))
        sizes = chunk_sizes(shape[dim], comm.size)
        self.span = chunk_span(shape[dim], comm.size, comm.rank)
        block = (*shape[:dim], self.span[1], *shape[dim + 1:])
        # ``gather(local)``: the whole from this rank's block, the prepared all-gather itself (no
        # method frame around it); on one rank the block is the whole
        self.gather = prepare_all_gather(block, spec.dtype, comm, dim=dim, sizes=sizes) if comm.size > 1 else _whole
        # MPI splits memory in order: the reduce-scatter takes the gradient with ``dim`` leading
        leading = (shape[dim], *shape[:dim], *shape[dim + 1:])
        self.reduce_scatter = prepare_reduce_scatter(leading, spec.dtype, comm, "sum", dim=0, sizes=sizes)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's block of the sum of every rank's ``partial`` (of the gathered shape)."""
        if self.comm.size == 1:
            return partial.contiguous()
        if not self.dim:
            return self.reduce_scatter(partial)
        # (the copy with ``dim`` leading made here: the prepared call's ``stage`` takes more calls)
        return self.reduce_scatter(partial.movedim(self.dim, 0).contiguous()).movedim(0, self.dim).contiguous()

    def block(self, grad: Any) -> torch.Tensor:
        """This rank's block of the gradient of the gathered output, in the input's layout."""
        if isinstance(grad, DTensor):
            placements = grad._spec.placements
            if grad._spec is self.partial_spec or placements == _PARTIAL_SUM:  # (``is``: no Placement.__eq__ call)
                return self.reduce(grad._local_tensor)
            if placements != self.out_spec.placements:  # another layout: the public path
                spec = self.in_spec
                return grad.redistribute(spec.mesh, spec.placements)._local_tensor.contiguous()
            grad = grad._local_tensor
        # a replicated gradient (a plain one is the output's local tensor, as from_local's backward reads it)
        return grad.narrow(self.dim, *self.span).contiguous()


_ROUTES: dict[DTensorSpec, Route | None] = cache("fast.gather.routes")  # input spec -> route, or None: public path


def shard_route(spec: DTensorSpec) -> Route | None:
    """The ``Route`` between ``spec`` and its replicated whole, with its collectives prepared,
    where ``spec`` is C-contiguous on a 1-D mesh holding this rank and the redistribution
    planner turns it into ``Replicate`` by one all-gather (``Shard(d)``; on one rank, by
    nothing); None for any other spec. A row-parallel Linear's reduce-scatter is its ``reduce``, the gradient's
    all-gather its ``gather``."""
    try:  # (a subscript: ``dict.get`` is a call)
        return _ROUTES[spec]
    except KeyError:
        route = None
        mesh = spec.mesh
        if mesh.ndim == 1 and mesh.get_coordinate() is not None and spec.stride == contiguous_strides(spec.shape):
            steps = plan(spec, spec.with_placements((Replicate(),)))
            if len(steps) == 1 and isinstance(steps[0], AllGather):
                route = Route(spec, steps[0].dim)
            elif not steps and isinstance(spec.placements[0], Shard):  # one rank: the block is the whole
                route = Route(spec, spec.placements[0].dim)
        _ROUTES[spec] = route
    return route


class _GatherShards(torch.autograd.Function):
    """The all-gather of ``route`` forward; this rank's block of the gradient backward."""

    @staticmethod
    def forward(ctx, x: DTensor, route: Route) -> DTensor:
        ctx.route = route
        return DTensor(route.gather(x._local_tensor), route.out_spec)

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        return DTensor(route.block(grad), route.in_spec), None


_gather_shards = direct_apply(_GatherShards, compiling_checked=True)  # (``gather_shards`` asks)


def gather_shards(x: DTensor) -> DTensor | None:
    """``x`` (sharded on one dim over a 1-D mesh) replicated by the local path, as
    ``x.redistribute(x.device_mesh, [Replicate()])`` gives it; None where that path does
    not apply or fast paths are off (the caller takes the public one)."""
    # the Route (``gather`` the local block, ``reduce`` a partial gradient back to it)
    compiling = dynamo_compiling() or compiler._is_compiling_flag
    route = shard_route(x._spec) if settings.fast_paths and not compiling else None
    if route is None:
        return None
    GATHER.hits += 1
    if torch.is_grad_enabled() and x.requires_grad:
        return _gather_shards(x, route)
    return DTensor(route.gather(x._local_tensor), route.out_spec)
