"""``histc``: with a fixed range (``min < max`` given) each rank counts its own shard and the
bins add up (the result is ``Partial(sum)``, no communication, as torch's rule); with the
range taken from the data (``min == max``) every rank needs the whole tensor's extremes, so
the input is gathered first."""
from __future__ import annotations

import torch

from ..tensor.placements import Partial, Replicate, shard_dim
from .registry import OpCall, Sharding, register, takes_strided

aten = torch.ops.aten


@register(aten.histc)
@takes_strided
def histc(call: OpCall) -> Sharding:
    spec = call.tensor_specs[0]
    args = call.bound()
    fixed_range = (args["min"] or 0) != (args["max"] or 0)
    inputs, outputs = [], []
    for p in spec.placements:
        if shard_dim(p) is not None and fixed_range:
            inputs.append(p)
            outputs.append(Partial("sum"))
        else:  # a Partial input is reduced first: histograms of its terms do not add up
            inputs.append(Replicate())
            outputs.append(Replicate())
    return Sharding([tuple(inputs)], [tuple(outputs)])
