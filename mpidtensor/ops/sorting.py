"""Sharding rules of ops along one dim that need that dim whole: ``sort``, ``topk``,
``kthvalue`` (values and exact, global indices). A shard of the dim is moved to another
dim by an all-to-all when the cost model prefers it to an all-gather; every other dim
may stay sharded.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..tensor.placements import Shard
from .indexing import R, Option, choose, norm_dim, register_on_dim
from .registry import OpCall, Sharding

aten = torch.ops.aten


def _along_dim(call: OpCall, dim: int, result_dim: Callable[[int], int]) -> Sharding:
    """``dim`` must be whole; every other dim may stay sharded (``result_dim``: its place in the outputs)."""
    self = call.tensor_specs[0]
    n_out = len(call.out_metas())
    others = sorted((d for d in range(self.ndim) if d != dim), key=lambda d: -self.shape[d])

    def options(m: int) -> list[Option]:
        opts = [Option((R,), (R,) * n_out)]
        return opts + [Option((Shard(d),), (Shard(result_dim(d)),) * n_out) for d in others]

    inputs, outputs = choose(call, options)
    return Sharding(inputs, outputs)


def _dim_arg(call: OpCall, position: int, default: int = -1) -> int:
    args = call.args
    dim = args[position] if len(args) > position else call.kwargs.get("dim", default)
    return norm_dim(dim, call.tensor_specs[0].ndim)


@register_on_dim(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_topk(call: OpCall) -> Sharding:
    """Values and (exact, global) indices along ``dim``."""
    if call.func is aten.sort.stable:
        dim = norm_dim(call.kwargs.get("dim", -1), call.tensor_specs[0].ndim)
    else:
        dim = _dim_arg(call, 2 if call.func is aten.topk.default else 1)
    return _along_dim(call, dim, lambda d: d)


@register_on_dim(aten.kthvalue.default)
def kthvalue(call: OpCall) -> Sharding:
    dim = _dim_arg(call, 2)
    keepdim = call.args[3] if len(call.args) > 3 else call.kwargs.get("keepdim", False)
    return _along_dim(call, dim, lambda d: d if keepdim or d < dim else d - 1)
