"""Loss ops: nll_loss (cross_entropy's second half, after log_softmax in ``nn.py``) and
mse_loss, forward and backward.

What each keeps sharded without communication: the batch (and spatial) dims, unevenly
too; ``nll_loss`` also with the class dim sharded (vocab-parallel loss). Sums are
Partial(sum); means divide the local sum by the GLOBAL count (mse) or the GLOBAL total
weight (nll: one all-reduce of a scalar, as ignore_index and class weights make it data
dependent). Both are linear in their input (nll) or in grad_output (backward), whose
Partial(sum/avg) stays where the other operands are replicated.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import collectives
from ..tensor.placements import Partial, Placement, Replicate, Shard
from ..tensor.spec import DTensorSpec
from .nn import LINEAR, block_span, fill_free, follow_grad, inputs_by_name, mesh_comm, schema_arg, split_by
from .registry import OpCall, Sharding, register, replicate_all

aten = torch.ops.aten

_R = Replicate()
_NONE, _MEAN, _SUM = 0, 1, 2  # loss reductions (at::Reduction)


# --- nll_loss (cross_entropy = log_softmax + nll_loss) -----------------------------------------


def _nll_modes(x: DTensorSpec, target: DTensorSpec, values_used: bool = True) -> list[tuple]:
    """Per mesh dim ``(mode, input, target, weight)`` placements, mode one of

    * "class": the input's class dim is sharded: targets whole, class weights sharded alike;
    * "batch": a batch or spatial dim is sharded, the target alike (the other one follows a
      sharded side by a local chunk);
    * "partial": the input is Partial(sum/avg) (the loss is linear in it), the rest whole;
    * "whole": nothing sharded there.

    ``values_used=False`` (backward: only the input's shape matters) keeps any Partial input.
    """
    class_dim = 1 if x.ndim > 1 else 0

    def target_dim(d: int) -> int:
        return d if d == 0 else d - 1

    def input_dim(d: int) -> int:
        return d if d == 0 else d + 1

    modes = []
    for px, pt in zip(x.placements, target.placements):
        linear = isinstance(px, Partial) and (px.reduce_op in LINEAR or not values_used)
        if isinstance(px, Partial) and not linear:
            px = _R
        if px == Shard(class_dim):
            modes.append(("class", px, _R, Shard(0)))
        elif isinstance(px, Shard):
            modes.append(("batch", px, Shard(target_dim(px.dim)), _R))
        elif linear:
            modes.append(("partial", px, _R, _R))
        elif isinstance(pt, Shard):
            modes.append(("batch", Shard(input_dim(pt.dim)), pt, _R))
        else:
            modes.append(("whole", _R, _R, _R))
    return modes


def _class_local_target(offset: int, size: int, ignore_index: int) -> Callable:
    """Targets relative to this rank's classes [offset, offset + size); -1 (ignored) elsewhere."""

    def relabel(t: torch.Tensor) -> torch.Tensor:
        keep = (t >= offset) & (t < offset + size) & (t != ignore_index)
        return torch.where(keep, t - offset, -1)

    return relabel


@register(aten.nll_loss_forward, aten.nll_loss2d_forward)
def nll_loss(call: OpCall) -> Sharding:
    x, target = schema_arg(call, 0), schema_arg(call, 1)
    reduction, ignore_index = schema_arg(call, 3), schema_arg(call, 4)
    modes = _nll_modes(x, target)
    x_target = tuple(m[1] for m in modes)
    split = [m for m, mode in enumerate(modes) if mode[0] in ("class", "batch") and call.mesh.shape[m] > 1]
    out, total = [], []
    for mode, px, pt, _ in modes:
        if mode == "partial":
            out.append(px)
        elif mode == "class" or (mode == "batch" and reduction != _NONE):
            out.append(Partial())
        else:
            out.append(pt)
        total.append(Partial() if mode in ("class", "batch") and reduction == _SUM else _R)
    targets = {"self": x_target, "target": tuple(m[2] for m in modes), "weight": tuple(m[3] for m in modes)}
    class_dim = 1 if x.ndim > 1 else 0
    relabel = None
    if split_by(call.mesh, x_target, class_dim):
        relabel = _class_local_target(*block_span(x, x_target, class_dim), ignore_index)
    # unweighted, the mean's divisor counts the non-ignored targets, which every rank of a
    # class-sharding mesh dim holds whole: counted locally, all-reduced over the batch only
    count = reduction == _MEAN and schema_arg(call, 2) is None and any(modes[m][0] == "class" for m in split)
    mean_split = [m for m in split if not (count and modes[m][0] == "class")] if reduction == _MEAN else []
    local = None
    if relabel is not None or mean_split:
        local = _nll_local(call.func, relabel, mesh_comm(call.mesh, mean_split) if mean_split else None, count)
    return Sharding(inputs_by_name(call, targets), [tuple(out), tuple(total)], local)


def _nll_local(func, relabel: Callable | None, mean_comm, count: bool = False) -> Callable:
    """The local nll_loss: class-sharded targets relabelled; with ``count``, the mean's
    divisor is the local count of non-ignored (whole) targets; with ``mean_comm``, the
    local sum divided by the total weight all-reduced over the ranks splitting the batch/classes."""

    def local(args, kwargs):
        x, t, w, reduction, ignore_index = args
        counted = (t != ignore_index).sum() if count else None
        if relabel is not None:
            t, ignore_index = relabel(t), -1
        if mean_comm is None and counted is None:
            return func(x, t, w, reduction, ignore_index)
        loss, total = func(x, t, w, _SUM, ignore_index)
        if counted is not None:
            total = counted.to(total.dtype)
        if mean_comm is not None:
            total = collectives.all_reduce(total, mean_comm, "sum")
        return loss / total, total

    return local


@register(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_loss_backward(call: OpCall) -> Sharding:
    """grad_input is linear in grad_output and does not read the input's values; a mean
    divides by the forward's (global, replicated) total weight."""
    grad, x, target = schema_arg(call, 0), schema_arg(call, 1), schema_arg(call, 2)
    reduction, ignore_index = schema_arg(call, 4), schema_arg(call, 5)
    modes = _nll_modes(x, target, values_used=False)
    g_target, out = [], []
    for (mode, px, pt, _), pg in zip(modes, grad.placements):
        if mode == "class" or (mode == "batch" and reduction != _NONE):
            g_target.append(_R)
            out.append(px)
        elif mode == "batch":
            g_target.append(pt)
            out.append(px)
        elif isinstance(pg, Partial) and pg.reduce_op in LINEAR:
            g_target.append(pg)
            out.append(pg)
        else:
            g_target.append(_R)
            out.append(_R)
    x_target = tuple(m[1] for m in modes)
    targets = {
        "grad_output": tuple(g_target), "self": x_target, "target": tuple(m[2] for m in modes),
        "weight": tuple(m[3] for m in modes), "total_weight": (_R,) * call.ndim if reduction == _MEAN else None,
    }
    local = None
    class_dim = 1 if x.ndim > 1 else 0
    if split_by(call.mesh, x_target, class_dim):
        local = _nll_backward_local(call.func, _class_local_target(*block_span(x, x_target, class_dim), ignore_index))
    return Sharding(inputs_by_name(call, targets), [tuple(out)], local)


def _nll_backward_local(func, relabel: Callable) -> Callable:
    """The local nll_loss_backward on a class-sharded block: targets relabelled to the
    block, the ones outside it ignored (-1)."""

    def local(args, kwargs):
        g, x_, t, w, red, _, total = args
        return func(g, x_, relabel(t), w, red, -1, total)

    return local


# --- mse_loss ----------------------------------------------------------------------------------


def _common_placements(*specs: DTensorSpec) -> tuple[Placement, ...]:
    """One layout for same-shape operands of an elementwise loss: per mesh dim the first
    operand's shard holds (the others follow by a local chunk, an all-to-all or a
    reduce-scatter); Partial operands are reduced, onto a free dim where possible."""
    target = []
    for column in zip(*(s.placements for s in specs)):
        shards = [p for p in column if isinstance(p, Shard)]
        if shards:
            target.append(shards[0])
        else:
            target.append(None if any(isinstance(p, Partial) for p in column) else _R)
    return fill_free(specs[0], target, set())


@register(aten.mse_loss)
def mse_loss(call: OpCall) -> Sharding:
    """none: elementwise; sum: local sums, Partial(sum); mean: local sums over the GLOBAL count."""
    x, y = schema_arg(call, 0), schema_arg(call, 1)
    reduction = schema_arg(call, 2, _MEAN)
    if x.shape != y.shape:
        return replicate_all(call)
    target = _common_placements(x, y)
    if reduction == _NONE:
        return Sharding([target, target], [target])
    out = tuple(Partial() if isinstance(p, Shard) else _R for p in target)
    local = None
    if reduction == _MEAN and Partial() in out:
        local = _sum_over(call.func, x.shape.numel(), 2)
    return Sharding([target, target], [out], local)


def _sum_over(func, count: int, n_tensors: int) -> Callable:
    """``func`` with reduction sum on its ``n_tensors`` tensors, divided by the global
    element count: an exact mean over uneven shards."""

    def local(args, kwargs):
        return func(*args[:n_tensors], _SUM) / count

    return local


@register(aten.mse_loss_backward)
def mse_loss_backward(call: OpCall) -> Sharding:
    """2 (x - y) g [/ count]: linear in g, whose Partial(sum/avg) stays where x and y are whole."""
    grad, x, y = schema_arg(call, 0), schema_arg(call, 1), schema_arg(call, 2)
    reduction = schema_arg(call, 3)
    if x.shape != y.shape or (reduction == _NONE and grad.shape != x.shape):
        return replicate_all(call)
    target = _common_placements(x, y)
    if reduction == _NONE:
        target = follow_grad(target, grad, range(x.ndim))
    g_target = []
    for pg, p in zip(grad.placements, target):
        if isinstance(p, Replicate) and isinstance(pg, Partial) and pg.reduce_op in LINEAR:
            g_target.append(pg)
        else:
            g_target.append(p if reduction == _NONE else _R)
    out = tuple(pg if isinstance(pg, Partial) else p for pg, p in zip(g_target, target))
    local = None
    if reduction == _MEAN and any(isinstance(p, Shard) for p in target):
        local = _sum_over(call.func, x.shape.numel(), 3)
    return Sharding([tuple(g_target), target, target], [out], local)
