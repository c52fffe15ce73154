"""``loss_parallel``: cross entropy on logits sharded over the class dim, without gathering
them (as ``torch.distributed.tensor.parallel.loss_parallel``).

Inside the context ``F.cross_entropy`` on class-sharded DTensor logits runs a fused
vocab-parallel cross entropy (Megatron's): the forward all-reduces the row max, then one
stacked sum of the row statistics (sum of exp, the target logit and, with label
smoothing, the weighted row sum of the logits): two all-reduces of row-sized tensors
over the class-sharding mesh dim. The backward is local: the gradient w.r.t. the logits
is ``softmax - one_hot`` (smoothed and weighted), computed on each class shard. The
per-row losses are a DTensor replicated over the class mesh dim, reduced by DTensor ops
(local unless another mesh dim shards the batch). Where every row is on every rank (a
plain target, no other mesh dim sharding the logits, the class dim last, C-contiguous
logits) and the loss is reduced, the one Function takes the logits DTensor and returns
the reduced loss DTensor itself: no ``to_local`` / ``from_local`` nodes, no dispatched
sum and division forward or backward. Outside the context nothing changes.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..tensor.layout import contiguous_strides, global_strides
from ..tensor.dtensor import DTensor
from ..comm import collectives
from ..tensor.placements import Partial, Placement, Replicate, Shard
from ..tensor.spec import DTensorSpec
from ..fast.functions import compiler, direct_apply, dynamo_compiling
from ..fast.linear import local_grad
from ..fast.registry import register
from ..runtime.settings import settings
from ..fast.rules import keeps_layout
from ..runtime.caches import cache

FUSED = register(
    "loss.cross_entropy",
    shortcuts="loss_parallel's reduced cross entropy: to_local / from_local of the logits and per-row losses, "
              "the dispatched sum (and division) of the rows forward and backward",
    decided_by="ops.reductions' rule for aten.sum of the per-row losses keeps them in place and gives a "
               "replicated total (every row on every rank), C-contiguous logits (the gradient takes their spec)",
)
_FUSED: dict = cache("parallel.loss.fused", maxsize=256)  # (mesh, placements, ndim, class mesh dim) -> verdict
_LAYOUTS: dict = cache("parallel.loss.layouts", maxsize=256)  # logits spec -> _logits_layout's tuple


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block, ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` take DTensor logits
    sharded on the class dim (dim 1, or dim 0 for one sample) over exactly one mesh dim;
    the other mesh dims may shard other dims or replicate. Targets are class indices (a
    plain tensor is read as replicated; a DTensor as laid out); ``weight``,
    ``ignore_index``, ``label_smoothing`` and every ``reduction`` work, means over the
    global count. The loss is replicated over the class-sharding mesh dim (a sum over a
    batch-sharding mesh dim stays ``Partial``). Backward may run inside or outside.
    Anything else raises ``TypeError``/``ValueError`` on every rank.
    """
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    """Routes ``F.cross_entropy`` through the layout checks; every other call runs as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def _class_mesh_dim(logits: DTensor) -> int:
    """The one mesh dim that shards the class dim; the others shard or replicate."""
    class_dim = 1 if logits.ndim >= 2 else 0
    placements = logits.placements
    dims = [m for m, p in enumerate(placements) if p == Shard(class_dim)]
    if len(dims) != 1:
        raise ValueError(
            f"loss_parallel needs logits sharded on the class dim {class_dim} over exactly one mesh dim, "
            f"got placements {placements}"
        )
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"loss_parallel needs logits without Partial placements, got {placements}")
    return dims[0]


def _row_placements(placements: Sequence[Placement], class_dim: int, mesh_dim: int) -> list[Placement]:
    """The per-row losses' layout: replicated over the class mesh dim, the logits' batch
    shards renumbered without the class dim."""
    rows = []
    for m, p in enumerate(placements):
        if m == mesh_dim or not isinstance(p, Shard):
            rows.append(Replicate())
        else:
            rows.append(Shard(p.dim - (p.dim > class_dim)))
    return rows


_ALL_REDUCES = cache("parallel.loss.all_reduces")  # (id(group), op) -> in-place all-reduces by signature


def _all_reduce(local: torch.Tensor, group, op: str) -> torch.Tensor:
    """``local`` (row statistics this call made) reduced by ``op`` over ``group``, the
    class-sharding mesh dim's communicator: one in-place all-reduce, the collective a
    ``Partial`` to ``Replicate`` there is; the other mesh dims shard or replicate the rows,
    nothing moves there. Prepared once per signature (the general function checks, stages
    and lays out each call: ~20 Python calls against ~10); the prepared collective holds
    ``group``, so its id keys no other communicator while the entry lives."""
    if group.size == 1:
        return local
    key = (id(group), op)
    reduce = _ALL_REDUCES.get(key)
    if reduce is None:
        reduce = _ALL_REDUCES[key] = collectives.BySignature(collectives.prepare_all_reduce, group, op=op,
                                                             inplace=True)
    return reduce(local)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of local class-sharded logits ``x`` (class dim last, classes
    ``[offset, offset + width)`` of ``n_classes``) with the matching local ``target``
    rows: the statistics all-reduced in forward over ``group``, the gradient local. The
    forward keeps the softmax it computed (the backward recomputes no exponentials).

    With ``out_spec`` (the fused path), ``x`` is the logits DTensor whose local tensor
    holds every row, and the output is their sum (``mean``: over the weight of the
    non-ignored targets), the DTensor of ``out_spec``; the logits' gradient is a DTensor
    of their spec."""

    @staticmethod
    def forward(ctx, x, target, offset, n_classes, weight, ignore_index, smoothing, group, mean=False,
                out_spec=None):
        ctx.x_spec = x._spec if out_spec is not None else None
        if out_spec is not None:
            x = x._local_tensor
        width = x.shape[-1]
        row_max = x.amax(-1) if width else x.new_full(x.shape[:-1], float("-inf"))
        shifted = x - _all_reduce(row_max, group, "max").unsqueeze(-1)  # a new tensor: this call's own
        rel = target - offset
        mine = (rel >= 0) & (rel < width)
        idx = rel.clamp(0, max(width - 1, 0)).unsqueeze(-1)
        picked = shifted.gather(-1, idx).squeeze(-1) if width else shifted.new_zeros(target.shape)
        w_local = None if weight is None else weight[offset:offset + width]
        smooth = (shifted if w_local is None else shifted * w_local).sum(-1) if smoothing else None
        probs = shifted.exp_()  # (in place: ``shifted`` is not read again)
        stats = [probs.sum(-1), torch.where(mine, picked, 0.0)]
        if smoothing:
            stats.append(smooth)
        stats = _all_reduce(torch.stack(stats), group, "sum")
        total = stats[0]
        probs.div_(total.unsqueeze(-1))  # the softmax, kept for the backward (not recomputed there)
        lse = total.log()  # log-sum-exp of the shifted logits, per row
        valid = target != ignore_index
        if weight is None:  # (== where(valid, 1, 0): one op)
            w_target = valid.to(lse.dtype)
        else:
            w_target = torch.where(valid, weight[target.clamp(0, n_classes - 1)], 0.0)
        # (1 - smoothing) * w_target: the product by 1.0 is exact, skipped without smoothing
        loss = ((1 - smoothing) * w_target if smoothing else w_target) * (lse - stats[1])
        w_sum = float(n_classes) if weight is None else weight.sum().item()
        if smoothing:  # torch's smoothing term: sum_c w_c * (lse - x_c) / n_classes
            loss = loss + torch.where(valid, w_sum * lse - stats[2], 0.0) * (smoothing / n_classes)
        ctx.to_save = (probs, rel, mine, valid, w_target)
        ctx.w_local, ctx.w_sum, ctx.smoothing, ctx.n_classes = w_local, w_sum, smoothing, n_classes
        ctx.out_spec, ctx.divisor = out_spec, None
        if out_spec is None:
            return loss
        loss = loss.sum()
        if mean:  # the total weight as _mean_divisor takes it: summed in float64, a Python float
            ctx.divisor = w_target.sum(dtype=torch.float64).item()
            loss = loss / ctx.divisor
        return DTensor(loss, out_spec)

    @staticmethod
    def backward(ctx, grad):
        probs, rel, mine, valid, w_target = ctx.saved_tensors
        if ctx.out_spec is not None:  # the reduced loss's gradient, one number, to every row
            grad = local_grad(grad, ctx.out_spec)
            grad = (grad if ctx.divisor is None else grad / ctx.divisor).expand(w_target.shape)
        smoothing, n_classes, width = ctx.smoothing, ctx.n_classes, probs.shape[-1]
        g = grad * w_target  # d loss / d x = g * (softmax - one_hot) + smoothing
        if smoothing:
            g = g * (1 - smoothing)
        out = probs * g.unsqueeze(-1)
        if width:
            idx = rel.clamp(0, width - 1).unsqueeze(-1)
            out.scatter_add_(-1, idx, -torch.where(mine, g, 0.0).unsqueeze(-1))
        if smoothing:
            gs = (torch.where(valid, grad, 0.0) * (smoothing / n_classes)).unsqueeze(-1)
            w_local = 1.0 if ctx.w_local is None else ctx.w_local
            out += gs * (ctx.w_sum * probs - w_local)
        if ctx.x_spec is not None:
            out = DTensor(out, ctx.x_spec)
        return out, None, None, None, None, None, None, None, None, None


_vocab_parallel_cross_entropy = direct_apply(_VocabParallelCrossEntropy)


def _cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DTensor:
    if not isinstance(input, DTensor):
        raise TypeError(
            f"loss_parallel needs DTensor logits sharded on the class dim, got a {type(input).__name__} "
            f"(keep the output projection's output a DTensor: use_local_output=False)"
        )
    spec = input._spec
    layout = _LAYOUTS.get(spec)
    if layout is None:
        layout = _LAYOUTS[spec] = _logits_layout(input)
    mesh_dim, rows, offset, group, fusable, out_spec = layout
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise ValueError("loss_parallel supports class-index targets only (an integer tensor), not probabilities")
    if size_average is not None or reduce is not None:
        raise ValueError("loss_parallel does not support the deprecated size_average / reduce arguments")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    class_dim = 1 if input.ndim >= 2 else 0
    mesh = spec.mesh
    row_shape = input.shape[:class_dim] + input.shape[class_dim + 1:]
    if tuple(target.shape) != tuple(row_shape):
        raise ValueError(f"loss_parallel: target shape {tuple(target.shape)} does not match the logits' "
                         f"{tuple(input.shape)} without the class dim")
    plain_target = not isinstance(target, DTensor)
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    n_classes = input.shape[class_dim]
    if (reduction != "none" and plain_target and fusable and settings.fast_paths
            and not (dynamo_compiling() or compiler._is_compiling_flag)):
        FUSED.hits += 1
        return _vocab_parallel_cross_entropy(input, target, offset, n_classes, weight, ignore_index,
                                             float(label_smoothing), group, reduction == "mean", out_spec)
    if plain_target:
        target_dt = DTensor.from_local(target, mesh, [Replicate()] * mesh.ndim, run_check=False,
                                       shape=target.shape, stride=global_strides(target.shape, target))
    else:
        target_dt = target
    local_target = target_dt.redistribute(mesh, rows).to_local() if target_dt.placements != rows \
        else target_dt.to_local()
    x = input.to_local().movedim(class_dim, -1)
    local = _vocab_parallel_cross_entropy(x, local_target, offset, n_classes, weight, ignore_index,
                                          float(label_smoothing), group)
    per_row = DTensor.from_local(local, mesh, rows, run_check=False, shape=row_shape,
                                 stride=global_strides(row_shape, local))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "sum":
        return total
    return total / _mean_divisor(target if plain_target else local_target, weight, ignore_index, n_classes,
                                 None if plain_target else (mesh, rows))


def _logits_layout(logits: DTensor) -> tuple:
    """What a loss reads of its logits' spec, cached by that (interned) spec: the class mesh
    dim (or the ValueError of a layout loss_parallel cannot take), the per-row losses'
    placements, this rank's first class, the class dim's communicator, whether the fused
    path may take the logits (the class dim last, laid out C-contiguously: the gradient
    takes their spec, and :func:`_rows_whole`), and its loss spec.
    (Worked out per call, the placement checks and the span arithmetic were ~40 Python calls.)"""
    spec, mesh = logits._spec, logits._spec.mesh
    mesh_dim = _class_mesh_dim(logits)
    class_dim = 1 if len(spec.shape) >= 2 else 0
    rows = tuple(_row_placements(spec.placements, class_dim, mesh_dim))
    offset = spec.local_shape_and_offset()[1][class_dim]
    fusable = (class_dim == len(spec.shape) - 1 and spec.stride == contiguous_strides(spec.shape)
               and _rows_whole(spec, mesh_dim, rows))
    out_spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, (), (), spec.dtype)
    return mesh_dim, rows, offset, mesh.comm_for((mesh_dim,)), fusable, out_spec


def _rows_whole(spec: DTensorSpec, mesh_dim: int, rows: Sequence[Placement]) -> bool:
    """Whether the logits' local tensor holds every row: the rule for ``aten.sum`` of the per-row
    losses (``rows``) sums them where they lie to a replicated total. The rule is asked once
    per layout, for rows of the mesh's size (its verdict depends on placements, not sizes)."""
    key = (spec.mesh, spec.placements, len(spec.shape), mesh_dim)
    whole = _FUSED.get(key)
    if whole is None:
        shape = (spec.mesh.size(),) * (len(spec.shape) - 1)
        per_row = DTensorSpec(spec.mesh, tuple(rows), shape, contiguous_strides(shape), spec.dtype)
        whole = _FUSED[key] = keeps_layout(torch.ops.aten.sum.default, (per_row,), spec.mesh,
                                           [(Replicate(),) * spec.mesh.ndim])
    return whole


def _mean_divisor(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, n_classes: int,
                  rows_on: tuple | None) -> float:
    """The mean's divisor, the total weight of the non-ignored targets: local from a whole
    (plain) target; from a DTensor target's local rows, summed over the batch shards
    (``rows_on``: the mesh and the rows' placements)."""
    valid = target != ignore_index
    w = valid.to(torch.float64) if weight is None else torch.where(
        valid, weight[target.clamp(0, n_classes - 1)].to(torch.float64), 0.0)
    total = w.sum()
    if rows_on is not None and any(isinstance(p, Shard) for p in rows_on[1]):
        mesh, rows = rows_on
        partial = [Partial() if isinstance(p, Shard) else Replicate() for p in rows]
        total = DTensor.from_local(total, mesh, partial, run_check=False, shape=(), stride=()).full_tensor()
    return total.item()
