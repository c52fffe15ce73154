"""Neural-network ops: softmax and log_softmax, layer_norm and fused rms_norm (what rms_norm
reaches on CUDA; on CPU it decomposes into pointwise ops and a mean), embedding and its
max_norm renorm, and CPU flash attention, forward and backward; and the layout helpers
that the loss rules (``losses.py``) share. gelu and silu are pointwise (``pointwise.py``).

What each keeps sharded without communication:

* softmax family: every shard, the softmax dim included (the local op then combines the
  row max and row sum with two all-reduces of row-sized statistics);
* norms: shards of the batch dims; a shard of a normalized dim, or a Partial input, moves
  to a free batch dim (all-to-all / reduce-scatter) or else is gathered; weight and bias
  gradients of a batch-sharded input are Partial(sum);
* embedding: weight sharded over the vocab (each rank looks up its own rows, output
  Partial(sum)) or over the embedding dim (output sharded on its last dim); indices
  sharded on any dim (output sharded alike); max_norm renorms the weight in place in
  its own layout;
* attention: q, k, v (and mask) sharded alike over batch or heads.

Ops that are linear in one operand (softmax backward in its gradient, ...) keep that
operand's Partial(sum/avg) where the other operands are replicated; a backward whose
forward operands are replicated follows a sharded gradient.
"""
from __future__ import annotations

from itertools import product
from typing import Callable

import torch

from ..tensor.layout import local_span
from ..comm import collectives
from ..tensor.placements import Partial, Placement, Replicate, Shard
from ..tensor.spec import DTensorSpec
from .registry import OpCall, Placements, Sharding, register, transition_cost

aten = torch.ops.aten

_R = Replicate()
LINEAR = ("sum", "avg")  # Partial ops that commute with a linear op


# --- helpers (the public ones shared with losses.py) -------------------------------------------


def schema_arg(call: OpCall, index: int, default=None):
    """Argument ``index`` of the op's schema, passed positionally or by name."""
    if index < len(call.args):
        return call.args[index]
    return call.kwargs.get(call.func._schema.arguments[index].name, default)


def inputs_by_name(call: OpCall, targets: dict[str, Placements | None]) -> list[Placements | None]:
    """Sharding.inputs from target placements keyed by schema argument name (absent: keep)."""
    names = [a.name for a in call.func._schema.arguments]
    keys = [names[i] for i, a in enumerate(call.args) if isinstance(a, DTensorSpec)]
    keys += [k for k, a in call.kwargs.items() if isinstance(a, DTensorSpec)]
    return [targets.get(k) for k in keys]


def _cost(spec: DTensorSpec, m: int, target: Placement) -> float:
    """Rough bytes moved to bring ``spec`` to ``target`` at mesh dim ``m`` alone."""
    return transition_cost(spec.placements[m], target) * _nbytes(spec)


def _nbytes(t: DTensorSpec | torch.Tensor) -> int:
    return max(t.shape.numel(), 1) * t.dtype.itemsize


def _localize(spec: DTensorSpec, keep_whole: set[int], avoid: set[int]) -> tuple[Placement, ...]:
    """Placements of ``spec`` in which no mesh dim shards a dim of ``keep_whole`` or is Partial;
    such mesh dims move as :func:`fill_free` says."""
    target = [
        None if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in keep_whole) else p
        for p in spec.placements
    ]
    return fill_free(spec, target, keep_whole | avoid)


def fill_free(spec: DTensorSpec, target: list[Placement | None], avoid: set[int]) -> tuple[Placement, ...]:
    """``target`` with each ``None`` replaced by a shard of the largest dim of ``spec`` not in
    ``avoid``, not sharded by another mesh dim and at least as long as the mesh dim (reached
    by one all-to-all or reduce-scatter), or by Replicate when there is none."""
    mesh_shape = spec.mesh.shape
    target = list(target)
    for m, p in enumerate(target):
        if p is not None:
            continue
        taken = {q.dim for q in target if isinstance(q, Shard)}
        free = [d for d in range(spec.ndim) if d not in avoid | taken and spec.shape[d] >= mesh_shape[m]]
        target[m] = Shard(max(free, key=lambda d: spec.shape[d])) if free else _R
    return tuple(target)


def follow_grad(target: Placements, grad: DTensorSpec, dims: range) -> tuple[Placement, ...]:
    """In a backward, where the forward operands are whole (Replicate) but the gradient is
    sharded over one of ``dims``, shard the operands alike: a local chunk instead of a
    gather of the gradient."""
    return tuple(
        pg if p == _R and isinstance(pg, Shard) and pg.dim in dims else p for p, pg in zip(target, grad.placements)
    )


def block_span(spec: DTensorSpec, placements: Placements, dim: int) -> tuple[int, int]:
    """(global offset, size) along ``dim`` of this rank's block under ``placements``."""
    mesh = spec.mesh
    return local_span(spec.shape[dim], dim, placements, mesh.shape, mesh._coord)


def split_by(mesh, placements: Placements, dim: int) -> list[int]:
    """The mesh dims of more than one rank that shard tensor dim ``dim``."""
    return [m for m, p in enumerate(placements) if p == Shard(dim) and mesh.shape[m] > 1]


def mesh_comm(mesh, mesh_dims: list[int]):
    return mesh.comm_for(tuple(sorted(mesh_dims)))


def _low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


# --- softmax, log_softmax ----------------------------------------------------------------------


def _softmax_placements(spec: DTensorSpec, dim: int) -> tuple[Placement, ...]:
    """Shards stay (the softmax dim too: the local op combines row statistics); Partial
    inputs are reduced onto a shard of another dim where possible."""
    return _localize(spec, set(), {dim})


@register(aten._softmax, aten._log_softmax, aten._safe_softmax)
def softmax(call: OpCall) -> Sharding:
    x = call.tensor_specs[0]
    dim = schema_arg(call, 1) % max(x.ndim, 1)
    target = _softmax_placements(x, dim)
    split = split_by(call.mesh, target, dim)
    local = None
    if split:
        name = call.func._schema.name
        local = _split_softmax(
            mesh_comm(call.mesh, split), dim, "log" in name, "safe" in name, call.out_metas()[0].dtype
        )
    return Sharding([target], [target], local)


def _split_softmax(comm, dim: int, log: bool, safe: bool, out_dtype: torch.dtype) -> Callable:
    """Softmax over a dim split across ``comm``: global row max, then global row sum."""

    def local(args, kwargs):
        x = args[0]
        if _low_precision(x.dtype):
            x = x.float()
        if x.shape[dim]:
            row_max = x.amax(dim, keepdim=True)
        else:
            shape = list(x.shape)
            shape[dim] = 1
            row_max = x.new_full(shape, float("-inf"))
        row_max = collectives.all_reduce(row_max, comm, "max")
        shifted = x - row_max
        total = collectives.all_reduce(shifted.exp().sum(dim, keepdim=True), comm, "sum")
        out = shifted - total.log() if log else shifted.exp() / total
        if safe:
            out = out.masked_fill(row_max == float("-inf"), 0.0)
        return out.to(out_dtype)

    return local


@register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward(call: OpCall) -> Sharding:
    """grad_input from (grad_output, output): linear in grad_output, so its Partial(sum/avg)
    stays where the output is replicated."""
    grad, y = call.tensor_specs[0], call.tensor_specs[1]
    dim = schema_arg(call, 2) % max(y.ndim, 1)
    y_target = follow_grad(_softmax_placements(y, dim), grad, range(y.ndim))
    g_target = tuple(
        pg if isinstance(py, Replicate) and isinstance(pg, Partial) and pg.reduce_op in LINEAR else py
        for pg, py in zip(grad.placements, y_target)
    )
    split = split_by(call.mesh, y_target, dim)
    local = None
    if split:
        log = "log" in call.func._schema.name
        local = _split_softmax_backward(mesh_comm(call.mesh, split), dim, log, call.out_metas()[0].dtype)
    return Sharding([g_target, y_target], [g_target], local)


def _split_softmax_backward(comm, dim: int, log: bool, out_dtype: torch.dtype) -> Callable:
    """softmax: y * (g - sum(g * y)); log_softmax: g - exp(y) * sum(g); sums over the split dim."""

    def local(args, kwargs):
        g, y = args[0], args[1]
        if _low_precision(g.dtype):
            g, y = g.float(), y.float()
        if log:
            total = collectives.all_reduce(g.sum(dim, keepdim=True), comm, "sum")
            out = g - y.exp() * total
        else:
            gy = g * y
            total = collectives.all_reduce(gy.sum(dim, keepdim=True), comm, "sum")
            out = gy - y * total
        return out.to(out_dtype)

    return local


# --- layer_norm, rms_norm ----------------------------------------------------------------------


def _norm_placements(x: DTensorSpec, normalized: int) -> tuple[Placement, ...]:
    """The normalized (trailing) dims local; batch dims may stay sharded."""
    dims = set(range(x.ndim - normalized, x.ndim))
    return _localize(x, dims, dims)


def _norm_rule(call: OpCall, params: tuple[str, ...]) -> Sharding:
    """Forward norms: input and its row statistics share the batch layout; params replicated."""
    x = call.tensor_specs[0]
    target = _norm_placements(x, len(schema_arg(call, 1)))
    targets = {"input": target, **{p: (_R,) * call.ndim for p in params}}
    return Sharding(inputs_by_name(call, targets), [target] * len(call.out_metas()))


def _norm_backward_rule(call: OpCall, stats: tuple[str, ...], params: tuple[str, ...], local=None) -> Sharding:
    """Backward norms: grad_input like the input; parameter gradients Partial(sum) over the
    mesh dims sharding the batch. A Partial grad_out stays (all outputs Partial) where the
    input is replicated: these gradients are linear in grad_out."""
    grad, x = schema_arg(call, 0), schema_arg(call, 1)
    normalized = len(schema_arg(call, 2))
    x_target = follow_grad(_norm_placements(x, normalized), grad, range(x.ndim - normalized))
    g_target, param_grad = [], []
    for pg, px in zip(grad.placements, x_target):
        if isinstance(px, Replicate) and isinstance(pg, Partial) and pg.reduce_op in LINEAR:
            g_target.append(pg)
            param_grad.append(pg)
        else:
            g_target.append(px)
            param_grad.append(Partial() if isinstance(px, Shard) else _R)
    g_target, param_grad = tuple(g_target), tuple(param_grad)
    targets = {"grad_out": g_target, "input": x_target, **{s: x_target for s in stats}}
    targets.update({p: (_R,) * call.ndim for p in params})
    outputs = [g_target] + [param_grad] * (len(call.out_meta) - 1)
    present = [o for o, meta in zip(outputs, call.out_meta) if meta is not None]  # output_mask
    return Sharding(inputs_by_name(call, targets), present, local)


@register(aten.native_layer_norm)
def layer_norm(call: OpCall) -> Sharding:
    return _norm_rule(call, ("weight", "bias"))


@register(aten.native_layer_norm_backward)
def layer_norm_backward(call: OpCall) -> Sharding:
    return _norm_backward_rule(call, ("mean", "rstd"), ("weight", "bias"))


@register(aten._fused_rms_norm)
def rms_norm(call: OpCall) -> Sharding:
    """Reached on CUDA (on CPU ``rms_norm`` decomposes into pointwise ops and a mean)."""
    return _norm_rule(call, ("weight",))


@register(aten._fused_rms_norm_backward)
def rms_norm_backward(call: OpCall) -> Sharding:
    return _norm_backward_rule(call, ("rstd",), ("weight",), _kernel(call.func, call.mesh.device_type))


def _kernel(func, device_type: str) -> Callable | None:
    """``None`` (run ``func``) where the device has a kernel for it, else its decomposition."""
    key = "CUDA" if device_type == "cuda" else "CPU"
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), k)
           for k in (key, "CompositeExplicitAutograd", "CompositeImplicitAutograd")):
        return None
    from torch._decomp import decomposition_table

    decomposed = decomposition_table[func]
    return lambda args, kwargs: decomposed(*args, **kwargs)


# --- embedding ---------------------------------------------------------------------------------


@register(aten.embedding)
def embedding(call: OpCall) -> Sharding:
    """Per mesh dim: weight over the vocab (dim 0) with replicated indices -> masked local
    lookups, output Partial(sum); weight over the embedding dim -> output sharded on its
    last dim; indices sharded -> output sharded alike (weight replicated). Where weight and
    indices are both sharded, the side that is cheaper to move is gathered."""
    w, ids = call.tensor_specs[0], call.tensor_specs[1]
    out = call.out_metas()[0]
    w_target, ids_target, out_target = [], [], []
    for pw, pi in zip(w.placements, ids.placements):
        if isinstance(pi, Partial):
            pi = _R
        if isinstance(pw, Partial) and pw.reduce_op not in LINEAR:
            pw = _R
        if isinstance(pi, Shard) and not isinstance(pw, Replicate):
            # Gathering the indices leaves a Partial output to reduce later, unless the
            # weight is split over the embedding dim.
            ids_cost = _nbytes(ids) + (0 if pw == Shard(1) else _nbytes(out))
            if ids_cost <= _nbytes(w) * (2 if isinstance(pw, Partial) else 1):
                pi = _R
            else:
                pw = _R
        w_target.append(pw)
        ids_target.append(pi)
        if isinstance(pi, Shard):
            out_target.append(pi)
        elif pw == Shard(1):
            out_target.append(Shard(out.ndim - 1))
        elif isinstance(pw, Shard):
            out_target.append(Partial())
        else:
            out_target.append(pw)
    w_target = tuple(w_target)
    local = None
    if split_by(call.mesh, w_target, 0):
        local = _vocab_lookup(call.func, *block_span(w, w_target, 0))
    return Sharding([w_target, tuple(ids_target)], [tuple(out_target)], local)


def _vocab_lookup(func, offset: int, size: int) -> Callable:
    """Look up the ids in rows [offset, offset + size) of the vocab; zeros for the others."""

    def local(args, kwargs):
        w, ids = args[0], args[1]
        if size == 0:
            return w.new_zeros((*ids.shape, w.shape[1]))
        outside = (ids < offset) | (ids >= offset + size)
        out = func(w, (ids - offset).masked_fill_(outside, 0), *args[2:], **kwargs)
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    return local


@register(aten.embedding_renorm_)
def embedding_renorm_(call: OpCall) -> Sharding:
    """``max_norm``: rescale, in place, the rows the ids use whose norm exceeds max_norm.

    The weight keeps its placements (it is written in place, through a detached alias):
    vocab shards renorm their own rows; shards of the embedding dim all-reduce partial
    norms; Partial weights all-reduce the rows to measure them, then scale their parts.
    The ids are gathered."""
    w = call.tensor_specs[0]
    norm_type = float(schema_arg(call, 3))
    by_op: dict[str, list[int]] = {}
    for m, p in enumerate(w.placements):
        if isinstance(p, Partial) and call.mesh.shape[m] > 1:
            by_op.setdefault(p.reduce_op, []).append(m)
    columns = split_by(call.mesh, w.placements, 1)
    if "product" in by_op or (columns and not norm_type > 0):
        raise NotImplementedError(
            f"embedding_renorm_ of a weight with placements {w.placements} and norm_type {norm_type}"
        )
    local = None  # the weight is whole on this rank: the kernel
    if by_op or columns or split_by(call.mesh, w.placements, 0):
        partial = [(op, mesh_comm(call.mesh, dims)) for op, dims in by_op.items()]
        offset, size = block_span(w, w.placements, 0)
        local = _renorm_rows(offset, size, partial, mesh_comm(call.mesh, columns) if columns else None, norm_type)
    return Sharding([None, (_R,) * call.ndim], [w.placements], local)


def _renorm_rows(offset: int, size: int, partial: list, column_comm, norm_type: float) -> Callable:
    """embedding_renorm_ on rows [offset, offset + size) of the vocab, as torch does it:
    scale max_norm / (norm + 1e-7) where the norm exceeds max_norm."""
    infinite = norm_type == float("inf")

    def local(args, kwargs):
        w, ids, max_norm = args[0], args[1], args[2]
        rows = ids[(ids >= offset) & (ids < offset + size)].unique() - offset
        part = w.index_select(0, rows)
        whole = part
        for op, comm in partial:
            whole = collectives.all_reduce(whole, comm, op)
        if column_comm is None:
            norm = torch.linalg.vector_norm(whole.double(), norm_type, dim=1)
        elif infinite:
            norm = collectives.all_reduce(whole.double().abs().amax(1) if whole.shape[1] else
                                          whole.new_zeros(len(rows), dtype=torch.double), column_comm, "max")
        else:
            powers = collectives.all_reduce(whole.double().abs().pow(norm_type).sum(1), column_comm, "sum")
            norm = powers.pow(1 / norm_type)
        scale = torch.where(norm > max_norm, max_norm / (norm + 1e-7), 1.0)
        w.index_copy_(0, rows, (part * scale.unsqueeze(1)).to(w.dtype))
        return w

    return local


@register(aten.embedding_dense_backward)
def embedding_backward(call: OpCall) -> Sharding:
    """grad_weight from (grad_output, indices): sharded on the embedding dim where grad_output
    is sharded on its last dim; Partial(sum) where both are sharded over the batch (or
    grad_output is Partial). ``scale_grad_by_freq`` counts ids globally, so it keeps the
    indices whole."""
    grad, ids = call.tensor_specs[0], call.tensor_specs[1]
    scale_by_freq = bool(schema_arg(call, 4))
    last = grad.ndim - 1
    g_target, ids_target, out_target = [], [], []
    for pg, pi in zip(grad.placements, ids.placements):
        if isinstance(pi, Shard) and not scale_by_freq and (pg == _R or pg == pi):
            choice = (pi, pi, Partial())
        elif pg == Shard(last):
            choice = (pg, _R, Shard(1))
        elif isinstance(pg, Shard) and not scale_by_freq:
            choice = (pg, pg, Partial())
        elif isinstance(pg, Partial) and pg.reduce_op in LINEAR:
            choice = (pg, _R, pg)
        else:
            choice = (_R, _R, _R)
        for lst, p in zip((g_target, ids_target, out_target), choice):
            lst.append(p)
    return Sharding([tuple(g_target), tuple(ids_target)], [tuple(out_target)])


# --- scaled dot product attention (CPU flash kernel) -------------------------------------------

_BATCH, _HEADS = 0, 1  # q/k/v dims [batch, heads, seq, embed]


def _mask_dim(mask: DTensorSpec, q: DTensorSpec, qdim: int) -> Placement:
    """The mask's placement when q is sharded over ``qdim``: sharded alike where the mask
    has that dim at full length, replicated where it broadcasts."""
    d = mask.ndim - (4 - qdim)
    return Shard(d) if d >= 0 and mask.shape[d] == q.shape[qdim] else _R


def _heads_aligned(q: DTensorSpec, kv: DTensorSpec, placements: Placements) -> bool:
    """Every rank's query heads are exactly the ones its key/value heads serve (grouped-query
    attention maps query head h to key head h // group)."""
    group = q.shape[_HEADS] // max(kv.shape[_HEADS], 1)
    mesh = q.mesh
    for coord in product(*(range(n) for n in mesh.shape)):
        q_off, q_len = local_span(q.shape[_HEADS], _HEADS, placements, mesh.shape, coord)
        k_off, k_len = local_span(kv.shape[_HEADS], _HEADS, placements, mesh.shape, coord)
        if (q_off, q_len) != (k_off * group, k_len * group):
            return False
    return True


def _attention_layout(q, k, v, mask, like_q=(), grad=None) -> tuple[list, list]:
    """Per mesh dim, the cheapest of: batch-sharded, head-sharded, replicated; in a backward
    whose ``grad`` is Partial(sum/avg) there, "replicated" keeps that Partial.
    Returns (placement per mesh dim for q-like tensors, mask placements)."""
    layout, mask_layout = [], []
    for m in range(q.mesh.ndim):
        best = None
        for placement, qdim in ((Shard(_BATCH), _BATCH), (Shard(_HEADS), _HEADS), (_R, None)):
            mask_p = _R if mask is None or qdim is None else _mask_dim(mask, q, qdim)
            cost = sum(_cost(s, m, placement) for s in (q, k, v, *like_q))
            cost += 0 if mask is None else _cost(mask, m, mask_p)
            if grad is not None:
                pg = grad.placements[m]
                if qdim is None and isinstance(pg, Partial) and pg.reduce_op in LINEAR:
                    placement = pg
                else:
                    cost += _cost(grad, m, placement)
            if best is None or cost < best[0]:
                best = (cost, placement, mask_p)
        layout.append(best[1])
        mask_layout.append(best[2])
    if Shard(_HEADS) in layout and not _heads_aligned(q, k, _placements(layout, False)):
        for m, p in enumerate(layout):
            if p == Shard(_HEADS):
                layout[m], mask_layout[m] = _R, _R
    return layout, mask_layout


def _placements(layout: list, partial_ok: bool) -> tuple[Placement, ...]:
    return tuple(p if partial_ok or not isinstance(p, Partial) else _R for p in layout)


@register(aten._scaled_dot_product_flash_attention_for_cpu)
def flash_attention(call: OpCall) -> Sharding:
    """q, k, v (and the mask) sharded alike over batch or heads: every rank attends its own
    (batch, head) pairs, no communication; output and logsumexp sharded the same."""
    q, k, v = call.tensor_specs[:3]
    mask = call.kwargs.get("attn_mask")
    layout, mask_layout = _attention_layout(q, k, v, mask)
    qkv = _placements(layout, False)
    targets = {"query": qkv, "key": qkv, "value": qkv, "attn_mask": tuple(mask_layout)}
    return Sharding(inputs_by_name(call, targets), [qkv, qkv], _skip_empty(call.func, call.out_metas()[1].dtype))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def flash_attention_backward(call: OpCall) -> Sharding:
    """Layout as in the forward; the gradients are linear in grad_out, whose Partial(sum/avg)
    stays (gradients Partial) where q, k and v are replicated."""
    grad, q, k, v, out, lse = call.tensor_specs[:6]
    mask = call.kwargs.get("attn_mask")
    layout, mask_layout = _attention_layout(q, k, v, mask, (out, lse), grad)
    qkv = _placements(layout, False)
    targets = {
        "grad_out": _placements(layout, True), "query": qkv, "key": qkv, "value": qkv, "out": qkv,
        "logsumexp": qkv, "attn_mask": tuple(mask_layout),
    }
    grads = _placements(layout, True)
    return Sharding(inputs_by_name(call, targets), [grads] * 3, _skip_empty(call.func, None))


def _skip_empty(func, lse_dtype: torch.dtype | None) -> Callable:
    """Run ``func``, except on an empty shard (the CPU kernel fails on zero heads): then
    return the outputs for the local shapes. ``lse_dtype``: forward; ``None``: backward."""

    def local(args, kwargs):
        q, k, v = args[:3] if lse_dtype is not None else args[1:4]
        if q.numel():
            return func(*args, **kwargs)
        if lse_dtype is None:  # no query: gradients of zero
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=lse_dtype)

    return local
