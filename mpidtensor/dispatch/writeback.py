"""What an op writes, put where torch would put it: the in-place and out= write-back into
DTensor and plain arguments, and the view ops whose result cannot alias the caller's
tensor because an input was redistributed first (tagged, so a later write into it is
refused instead of lost, or ``self`` moved in place so that the view does alias it)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._mode_utils import no_dispatch

from ..tensor.dtensor import DTensor
from ..ops import registry
from ..tensor.placements import _StridedShard
from ..tensor.redistribute import redistribute_local
from .args import is_view_op, local_of, mutated_inputs, tensors

__all__ = ["make_inplace_wrap", "write_into", "list_writeback", "mark_broken_views", "rebase_viewed"]


def _is_inner_tensor(wrapper: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` is one of the inner tensors of the wrapper subclass ``wrapper``: an in-place op
    that a subclass ran on its own data (and returned that data) wrote into ``wrapper``."""
    flatten = getattr(wrapper, "__tensor_flatten__", None)
    return flatten is not None and any(getattr(wrapper, name) is t for name in flatten()[0])


def make_inplace_wrap(func, written, specs_of: Callable) -> Callable:
    """In-place and out= ops return the tensor they wrote into, each written back by
    :func:`write_into`; ``specs_of(out)`` gives the specs of what the op returned."""
    inplace_view = torch.Tag.inplace_view in func.tags

    def wrap(out, a, k):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        results = []
        for (kind, where), spec, local in zip(written, specs_of(out), outs):
            dst = a[where] if kind == "pos" else k[where]
            write_into(func, dst, spec, local, inplace_view, a, k, keep_placements=kind == "kw")
            results.append(dst)
        return type(out)(results) if isinstance(out, (tuple, list)) else results[0]

    return wrap


def write_into(func, dst, spec, local, inplace_view: bool = False, a=(), k=None,
               keep_placements: bool = False) -> None:
    """Make ``dst`` (an argument the op wrote into) hold ``local`` (what the op wrote, of
    spec ``spec``). A DTensor written through a redistributed copy takes the new local
    tensor and placements, unless it is a view of another DTensor: then the values are
    moved back into its own block, which its base shares. A plain tensor written through
    a moved copy, or given a Partial or sharded value, gets the whole result copied in.
    An in-place view op (``squeeze_``…, rerun on ``a``, ``k``) also changes the wrapper's
    own shape and strides. ``keep_placements`` (an ``out=`` DTensor, as torch's), and any
    ``dst`` with a ``_StridedShard``: the value is moved into ``dst``'s own placements and
    block instead. A strided DTensor is usually FSDP's sharded parameter, a view of its flat
    storage, and a rule that does not place ``_StridedShard`` computes on ``Replicate``
    (:func:`registry.strided_safe`): taking that layout would detach it silently."""
    if getattr(dst, "_not_a_view_of", None) is not None:
        raise RuntimeError(
            f"{func} writes into the result of {dst._not_a_view_of}, which mpidtensor computed on a "
            f"redistributed copy (no sharding rule), so the write would not reach the original tensor"
        )
    if local is None:  # a subclass's in-place op that returned nothing, run on a moved copy
        raise RuntimeError(f"{func} returned None for the tensor it wrote into, which mpidtensor "
                           f"had redistributed: the write cannot be placed back")
    rep = registry.replicated(spec.mesh.ndim)
    if isinstance(dst, DTensor):
        if inplace_view:
            with no_dispatch():
                func(*a, **(k or {}))
            dst._spec = spec
            dst._local_tensor = local
        elif dst._local_tensor is not local and not _is_inner_tensor(dst._local_tensor, local):
            if dst._is_view() or (_keeps(dst, keep_placements) and dst._spec.shape == spec.shape):
                # its block aliases a base, or out= keeps its placements: the values go into its block
                src = dst._spec.with_placements(spec.placements)
                dst._local_tensor.copy_(redistribute_local(local, src, dst._spec))
            else:
                dst._local_tensor = local
                dst._spec = dst._spec.with_placements(spec.placements)
        elif dst._spec.placements != spec.placements and not _keeps(dst, keep_placements):  # moved, no data step
            # (a one-rank mesh dim)
            dst._spec = dst._spec.with_placements(spec.placements)
    elif isinstance(dst, torch.Tensor) and (local is not dst or spec.placements != rep):
        # A plain tensor written through a moved copy (a DTensor operand chose the layout),
        # or in place with a value that is not whole yet (out= of a Partial result).
        dst.copy_(redistribute_local(local, spec, spec.with_placements(rep)))


def _keeps(dst: DTensor, keep_placements: bool) -> bool:
    """Whether a moved write goes back into ``dst``'s own placements: an ``out=``, or a
    ``_StridedShard`` DTensor (asked only when the write was moved: off the direct path)."""
    return keep_placements or any(type(p) is _StridedShard for p in dst._spec.placements)


def list_writeback(func, args, specs, targets) -> tuple[Callable, Callable] | None:
    """For an op that writes into tensor lists and returns nothing (``_foreach_*_``, the
    fused optimizer steps) where the rule moves some written tensor first (a Partial
    parameter reduced before a nonlinear update): the op writes into the moved copy (or,
    on a one-rank mesh dim, the same tensor under new placements), so (local, wrap) that
    run it and then :func:`write_into` each moved tensor; else None."""
    starts, at = [], 0  # each argument's first index in the flattened tensors
    for a in args:
        starts.append(at)
        at += len(tensors(a))
    moved = []
    for kind, i in mutated_inputs(func, args):
        if kind == "pos" and isinstance(args[i], (list, tuple)):
            for j in range(len(args[i])):
                n = starts[i] + j
                if targets[n] is not None and tuple(targets[n]) != specs[n].placements:
                    moved.append((i, j, specs[n].with_placements(targets[n])))
    if not moved:
        return None

    def run(a, k, op=func._op):
        op(*a, **k)
        return a

    def wrap(largs, a, k):
        for i, j, spec in moved:
            write_into(func, a[i][j], spec, largs[i][j])

    return run, wrap


def mark_broken_views(func, converters, wrap: Callable, rebased: list[bool] | None = None) -> Callable:
    """For a view op: tag the outputs that do not alias the caller's tensor, because an
    input was redistributed (a copy, unless ``rebased[0]`` says self was moved in place)
    or was itself such an output. An in-place op on a tagged tensor is refused
    (:func:`make_inplace_wrap`): its write would be lost."""
    if not is_view_op(func):
        return wrap
    others = converters[1:] if rebased is not None else converters
    copied = any(c not in (None, local_of) for c in others)

    def marking_wrap(out, a, k):
        out = wrap(out, a, k)
        source = func if copied or (rebased is not None and not rebased[0]) else next(
            (t._not_a_view_of for t in a if getattr(t, "_not_a_view_of", None) is not None), None
        )
        if source is not None:
            for t in tensors(out):
                t._not_a_view_of = source
        return out

    return marking_wrap


def rebase_viewed(func, found, specs, targets, converters) -> list[bool] | None:
    """A view op whose ``self`` must be redistributed first (``diagonal`` of a tensor
    sharded on a diagonal dim...) redistributes that DTensor *in place*: it takes the new
    placements and local block, and the view is taken on that block, so the view aliases
    the caller's tensor and writes through it reach it, as in torch. A ``self`` that is
    itself a view keeps its layout (moving it would cut it off from its own base); its
    view is then computed on a copy and tagged. Returns the per-call flag "rebased"
    that :func:`mark_broken_views` reads, or None when nothing is rebased."""
    if not (is_view_op(func) and found and isinstance(found[0], DTensor)):
        return None
    move = converters[0]
    if move in (None, local_of):
        return None
    target = specs[0].with_placements(targets[0])
    flag = [False]

    def rebase(x: DTensor) -> torch.Tensor:
        flag[0] = not (x._is_view() or getattr(x, "_not_a_view_of", None) is not None)
        if not flag[0]:
            return move(x)
        x._local_tensor = move(x)
        x._spec = target
        return x._local_tensor

    converters[0] = rebase
    return flag
