"""``_enable_context_parallel_dispatcher`` / ``_disable_context_parallel_dispatcher``:
torch 2.13's switch that makes ``scaled_dot_product_attention`` on DTensors sharded
along the sequence run ring attention (torchtitan wraps q, k and v as ``Shard(seq)``
DTensors on the cp mesh and calls plain SDPA).

While enabled, the sharding rules of CPU flash attention and its backward (what SDPA
reaches on CPU) are replaced, as ``register_sharding`` replaces a rule: a call whose
query is ``Shard(2)`` (the sequence of ``[B, H, S, D]``) on a mesh dim of size > 1 runs
``ring_forward`` / ``ring_backward`` over that dim's communicator, in the layout the
buffers were sharded in (``_cp_options.enable_load_balance``, which
``_context_parallel_shard`` sets: head-tail order when a load balancer was given);
other mesh dims keep their batch, head or replicated placements. Every other call goes
to the rule enabling found. Enabling and disabling clear the dispatcher's plans; nothing
is added to any call while disabled. torch's CP fails on CPU here ("no sharding strategy
for _scaled_dot_product_flash_attention_for_cpu"); this is what it lacks.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...ops import registry
from ...runtime import caches
from ...tensor.placements import Replicate, Shard
from ...tensor.spec import DTensorSpec
from .api import _cp_options
from .ring import ring_backward, ring_forward

__all__ = ["_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher"]

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ = 2  # q/k/v are [batch, heads, sequence, head dim]
_replaced: dict = {}  # not cleared: op -> the rule it had before enabling, put back on disabling


def _enable_context_parallel_dispatcher() -> None:
    """Route sequence-sharded DTensor attention to ring attention (idempotent)."""
    if _replaced:
        return
    for op, make in ((_FORWARD, _forward_rule), (_BACKWARD, _backward_rule)):
        _replaced[op] = registry.rule_for(op)
        registry.register(op)(make(_replaced[op]))
    caches.clear_all()  # plans made before hold the previous rules' decisions


def _disable_context_parallel_dispatcher() -> None:
    """Give attention its previous rules back (idempotent)."""
    if not _replaced:
        return
    for op, rule in _replaced.items():
        registry.restore_rule(op, rule)
    _replaced.clear()
    caches.clear_all()


def _cp_dim(call: registry.OpCall, query: DTensorSpec) -> int | None:
    """The mesh dim that shards the query's sequence (None: not context parallel);
    NotImplementedError for layouts ring attention does not take."""
    dims = [m for m, p in enumerate(query.placements) if p == Shard(_SEQ) and call.mesh.shape[m] > 1]
    if not dims:
        return None
    if len(dims) > 1:
        raise NotImplementedError(f"context-parallel attention shards the sequence over one mesh dim, got {dims}")
    if call.bound().get("attn_mask") is not None:
        raise NotImplementedError("context-parallel attention (the DTensor dispatcher) takes no attn_mask: "
                                  "pass is_causal instead")
    return dims[0]


def _layout(query: DTensorSpec) -> tuple:
    """q/k/v placements: the query's, with a Partial or a shard of another dim replicated."""
    return tuple(p if p in (Shard(0), Shard(1), Shard(_SEQ)) or isinstance(p, Replicate) else Replicate()
                 for p in query.placements)


def _ring_rule(op: torch._ops.OpOverload, query_index: int, n_in: int, n_out: int, run) -> Callable:
    """A rule maker for ``op``: when the query (argument ``query_index``) is sharded on its
    sequence over one mesh dim, every q/k/v-shaped input and output takes the query's layout
    and the local kernel is ``run(bound arguments, comm, ring options)``; otherwise the
    rule it replaced decides."""
    def make(previous: registry.Rule | None) -> registry.Rule:
        def rule(call: registry.OpCall) -> registry.Sharding:
            query = call.tensor_specs[query_index]
            cp = _cp_dim(call, query)
            if cp is None:
                return _fallback(previous, call)
            qkv = _layout(query)
            comm = call.mesh.get_group(cp)

            def local(args, kwargs):
                bound = _bind(op, args, kwargs)
                _check_dropout(bound)
                return run(bound, comm=comm, is_causal=bool(bound["is_causal"]), scale=bound["scale"],
                           load_balanced=_cp_options.enable_load_balance, rotate_method=_cp_options.rotate_method)

            return registry.Sharding([qkv] * n_in, [qkv] * n_out, local)

        return rule

    return make


_forward_rule = _ring_rule(_FORWARD, 0, 3, 2, lambda b, **ring: ring_forward(b["query"], b["key"], b["value"], **ring))
_backward_rule = _ring_rule(
    _BACKWARD, 1, 6, 3,
    lambda b, **ring: ring_backward(b["grad_out"], b["query"], b["key"], b["value"], b["out"], b["logsumexp"], **ring))


def _fallback(previous: registry.Rule | None, call: registry.OpCall) -> registry.Sharding:
    if previous is None:
        raise NotImplementedError(f"no sharding rule for {call.func}")
    return previous(call)


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    schema = op._schema.arguments
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    return bound


def _check_dropout(bound: dict) -> None:
    if bound["dropout_p"]:
        raise ValueError(f"dropout_p={bound['dropout_p']}: dropout is not supported under context parallelism")

