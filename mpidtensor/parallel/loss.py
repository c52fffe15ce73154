"""``loss_parallel``: cross entropy on logits sharded over the class dim, without gathering
them (as ``torch.distributed.tensor.parallel.loss_parallel``).

The arithmetic needs no special op handlers here: mpidtensor's sharding rules already
keep a split class dim split through ``log_softmax`` (row max and row sum combined by
two all-reduces of row-sized statistics) and ``nll_loss`` (each rank picks the targets
that fall in its classes; a partial sum), forward and backward. The context manager
checks the logits' layout, so logits that are not class-sharded raise instead of being
gathered quietly, and hands the loss back replicated over the class-sharding mesh dim.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..dtensor import DTensor
from ..placements import Partial, Replicate, Shard


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
    mesh_dim = _class_mesh_dim(input)
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise ValueError("loss_parallel supports class-index targets only (an integer tensor), not probabilities")
    loss = F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    placements = list(loss.placements)
    if isinstance(placements[mesh_dim], Partial):
        placements[mesh_dim] = Replicate()
        loss = loss.redistribute(loss.device_mesh, placements)
    return loss
