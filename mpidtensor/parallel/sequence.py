"""``SequenceParallel``: run a norm or dropout on activations sharded over the sequence dim
(Megatron sequence parallelism, as ``torch.distributed.tensor.parallel.SequenceParallel``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..tensor.api import distribute_module
from ..tensor.dtensor import DTensor
from ..fast.norm import LocalNormForward
from ..mesh import DeviceMesh
from ..runtime.caches import cache
from ..tensor.placements import Replicate, Shard
from .install import install, own_forward
from .style import ParallelStyle, as_dtensor, require_1d_mesh, require_plain_parameters, to_layout

_PLACED: dict = cache("parallel.sequence.placed")  # (input spec, sequence dim) -> whether it is sharded so


def _supported(module: nn.Module) -> bool:
    """Modules that act on each position of the sequence on its own: LayerNorm, RMSNorm
    (``nn.RMSNorm`` or a Python implementation such as Llama's, named ``*RMSNorm`` /
    ``*LayerNorm``) and the dropouts."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.modules.dropout._DropoutNd)):
        return True
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _settle_partial_grad(grad: torch.Tensor) -> torch.Tensor:
    """A ``Partial`` gradient reduced to ``Replicate`` (one all-reduce per Partial mesh dim)."""
    if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
        return grad
    return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])


class SequenceParallel(ParallelStyle):
    """Replicate the module's parameters (from ``src_data_rank``) and compute on the input
    sharded on ``sequence_dim`` (default 1).

    A plain input is taken as this rank's sequence shard (its global shape found by
    ``from_local``'s all-gather of the local shapes: keep the residual stream a DTensor
    to avoid it); a DTensor input is redistributed to ``Shard(sequence_dim)`` if it is
    not already. The output stays sequence-sharded, a DTensor unless
    ``use_local_output`` (default False). Dropout masks come from mpidtensor's
    layout-invariant RNG, so they equal one process's.

    The replicated parameters get ``Partial`` gradients (a sum over the sequence
    shards); each is all-reduced once as it is produced, as Megatron does, so ``.grad``
    is ``Replicate`` and the optimizer step communicates nothing. ``nn.RMSNorm`` and
    ``nn.LayerNorm`` run on the local sequence block (``fast.norm``); other modules, and
    calls the local path does not fit, run on DTensors and a gradient hook settles the sum.
    """

    _owns_parameters = True

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
            raise TypeError(f"sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_module(module)
        require_1d_mesh(self, device_mesh)
        require_plain_parameters(self, module)

    def _check_module(self, module: nn.Module) -> None:
        if not _supported(module):
            raise TypeError(
                f"SequenceParallel supports nn.LayerNorm, RMSNorm and dropout modules, got {type(module).__name__}"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        sharding, local_out = self.sequence_sharding, self.use_local_output
        layout = sharding[0]

        def prepare_input(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            if not inputs:
                raise ValueError("SequenceParallel expects the module's input as its first positional argument")
            x = inputs[0]
            if type(x) is DTensor:  # already in place: what as_dtensor and to_layout give back (calls fewer)
                key = (x._spec, layout.dim)
                try:  # (by the interned spec: ``Placement.__eq__`` is a Python call)
                    placed = _PLACED[key]
                except KeyError:
                    placed = _PLACED[key] = x._spec.placements == sharding
                if placed:
                    return inputs
            x = to_layout(as_dtensor(x, mesh, layout, "SequenceParallel input"), layout)
            return (x, *inputs[1:])

        def prepare_output(_: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return out.to_local() if local_out and isinstance(out, DTensor) else out

        # A DTensor output is handed on as it is: no output conversion. A norm's forward
        # (``fast.norm``, installed by a class swap) converts its input and output itself: no hooks.
        finish = prepare_output if local_out else None
        local = own_forward(module) in (nn.RMSNorm.forward, nn.LayerNorm.forward)
        module = distribute_module(module, device_mesh, None, None if local else prepare_input,
                                   None if local else finish, src_data_rank=self.src_data_rank)
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(_settle_partial_grad)
        if local:
            install(module, LocalNormForward(device_mesh, own_forward(module), prepare_input, finish))
        return module

    def __repr__(self) -> str:
        dim = self.sequence_sharding[0].dim
        return f"SequenceParallel(sequence_dim={dim}, use_local_output={self.use_local_output})"
