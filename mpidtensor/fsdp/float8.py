"""torchao's float8 training weights under ``fully_shard``: each shard cast with the whole
weight's scale.

With ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` a weight's
``fsdp_pre_all_gather`` casts this rank's shard to float8 and the gathered bytes are read
with one scale. torchao takes that scale from the amax of the whole weight: all-reduced
through ``torch.distributed`` when it is initialised, or set ahead by
``precompute_float8_dynamic_scale_for_fsdp``, which looks for torch's DTensors. In an MPI
job neither holds, and each rank would cast its shard with its own amax while the gathered
weight is read with one rank's scale: wrong values, silently. :func:`whole_weight_scales`
gives every such weight of a group without a precomputed scale the whole weight's scale for
the hook calls: torchao's ``amax_to_scale`` of the amax, all-reduced over the shard
communicator in one call for the whole group (torchao makes one per weight).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch
from mpi4py import MPI

from ..comm import collectives


def _weight_type() -> type | None:
    """torchao's ``WeightWithDynamicFloat8CastTensor`` if torchao's float8 is loaded (a
    model cannot hold one otherwise)."""
    return getattr(sys.modules.get("torchao.float8.fsdp_utils"), "WeightWithDynamicFloat8CastTensor", None)


@contextmanager
def whole_weight_scales(shards: list[torch.Tensor], comm: MPI.Intracomm) -> Iterator[None]:
    """Within the block, the float8 weights among ``shards`` (local tensors, the same kinds on
    every rank of ``comm``) that have no precomputed scale carry the scale of their whole
    weight; afterwards none again, so the next all-gather takes the weight's new amax."""
    cls = _weight_type()
    weights = [t for t in shards if cls is not None and type(t) is cls and t._precomputed_scale is None]
    if not weights:
        yield
        return
    from torchao.float8.float8_utils import amax_to_scale

    with torch.no_grad():
        amax = torch.stack([w._tensor.abs().max().float() for w in weights])  # exact for any float dtype
        amax = collectives.all_reduce(amax, comm, "max", inplace=True)
    try:
        for w, a in zip(weights, amax):
            w._precomputed_scale = amax_to_scale(a, w._dtype)
        yield
    finally:
        for w in weights:
            w._precomputed_scale = None
