"""Packed tensor-parallel styles: transformers' ``packed_colwise``, ``packed_rowwise`` and
``moe_tp_experts``, whose weights hold several projections side by side (a fused
``gate_up_proj`` ``[2I, H]``, or ``[E, 2I, H]`` stacked per expert).

A plain column shard of such a weight would give rank 0 the whole gate and the last
rank the whole up projection; the packed styles shard each part instead, which is a
``_StridedShard(dim, split_factor=parts)``: rank ``r`` holds the ``r``-th chunk of
every part, concatenated, so the module's own ``chunk(parts)`` of its local output
splits it into this rank's slice of each part. The modules then run their own forward
on their local blocks, as transformers runs them:

* :class:`PackedColwiseParallel` (a module): the input replicated (its gradient summed
  over the mesh), the output this rank's slices of every part (``use_local_output``) or a
  DTensor ``_StridedShard(-1)`` of them;
* :class:`PackedRowwiseParallel` (a module): weights ``_StridedShard`` on their last dim,
  1-D parameters replicated; the forward is left to DTensor dispatch;
* :class:`ExpertTensorParallel` (``moe_tp_experts``, an experts module): every expert
  split over a tensor-parallel mesh whose ranks hold the same tokens; each parameter
  sharded by the transformers style its plan names (``packed_colwise``, ``colwise``,
  ``rowwise``, ``packed_rowwise``), the forward on local weights, its output summed over
  the mesh (and the tokens' and routing weights' gradients).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from ..mesh import DeviceMesh
from ..tensor.dtensor import DTensor
from ..tensor.placements import Placement, Replicate, Shard, _StridedShard
from .experts import _local_parameters, _require_same_tokens, _SumGradient, _SumOutput
from .install import install, own_forward
from .style import ParallelStyle, distribute_parameters, require_1d_mesh, require_plain_parameters

__all__ = ["ExpertTensorParallel", "PackedColwiseParallel", "PackedRowwiseParallel", "param_placement"]

PARAM_STYLES = ("packed_colwise", "packed_rowwise", "colwise", "rowwise")


def param_placement(style: str, name: str, ndim: int, split_factor: int = 2) -> Placement:
    """The placement transformers' ``style`` gives a parameter of ``ndim`` dims: a weight's
    output features are its dim ``ndim - 2`` (``[out, in]``, ``[E, out, in]``), a bias's its
    last. (transformers 5.24 shards a packed 1-D bias as a plain ``Shard``, which pairs a
    rank's gate rows with another part's bias; here it is strided like its weight.)"""
    bias = ndim == 1 or "bias" in name.rsplit(".", 1)[-1]
    out_dim = ndim - 1 if bias else ndim - 2
    if style == "packed_colwise":
        return _StridedShard(out_dim, split_factor=split_factor)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else _StridedShard(ndim - 1, split_factor=split_factor)
    if style == "colwise":
        return Shard(out_dim)
    if style == "rowwise":
        return Replicate() if bias else Shard(ndim - 1)
    raise ValueError(f"no parameter placement for the transformers style {style!r}; one of {PARAM_STYLES}")


def _shard_parameters(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh,
                      placement_of: Callable[[str, nn.Parameter], Placement]) -> None:
    """``module``'s own parameters as DTensors, each with ``placement_of(name, param)``."""
    layouts = [(name, placement_of(name, p)) for name, p in module.named_parameters(recurse=False)]
    distribute_parameters(module, mesh, layouts, style.src_data_rank)


class _PackedStyle(ParallelStyle):
    """What the packed styles share: they shard a module's own parameters (never already
    DTensors) over a 1-D mesh, in ``split_factor`` parts."""

    _owns_parameters = True

    def __init__(self, *, split_factor: int = 2) -> None:
        self.split_factor = split_factor

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        require_1d_mesh(self, device_mesh)
        require_plain_parameters(self, module)


class PackedColwiseParallel(_PackedStyle):
    """transformers' ``packed_colwise`` on a module (module docstring): its parameters
    ``_StridedShard`` over ``split_factor`` parts, its forward on local blocks."""

    def __init__(self, *, split_factor: int = 2, use_local_output: bool = True) -> None:
        super().__init__(split_factor=split_factor)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        _shard_parameters(self, module, device_mesh,
                          lambda name, p: param_placement("packed_colwise", name, p.ndim, self.split_factor))
        return install(module, _PackedColwiseForward(device_mesh, self.split_factor, self.use_local_output,
                                                     own_forward(module)))

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(split_factor={self.split_factor}, use_local_output={self.use_local_output})"


class _PackedColwiseForward:
    """The installed forward of :class:`PackedColwiseParallel` (no state of its own)."""

    def __init__(self, mesh: DeviceMesh, split_factor: int, use_local_output: bool, inner: Callable) -> None:
        self.mesh, self.split_factor, self.use_local_output, self.inner = mesh, split_factor, use_local_output, inner

    def __deepcopy__(self, memo: dict) -> "_PackedColwiseForward":
        return self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        x, *rest = args
        if isinstance(x, DTensor):
            x = x.redistribute(self.mesh, [Replicate()]).to_local()
        x = _SumGradient.apply(x, self.mesh.get_group())  # replicated: the ranks' input gradients add up
        with _local_parameters(module):
            out = self.inner(module, x, *rest, **kwargs)
        if self.use_local_output:
            return out
        return DTensor.from_local(out, self.mesh, [_StridedShard(out.ndim - 1, split_factor=self.split_factor)])


class PackedRowwiseParallel(_PackedStyle):
    """transformers' ``packed_rowwise`` on a module: weights ``_StridedShard`` on their last
    dim over ``split_factor`` parts, 1-D parameters replicated; the forward unchanged."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        _shard_parameters(self, module, device_mesh,
                          lambda name, p: param_placement("packed_rowwise", name, p.ndim, self.split_factor))
        return module

    def __repr__(self) -> str:
        return f"PackedRowwiseParallel(split_factor={self.split_factor})"


class ExpertTensorParallel(_PackedStyle):
    """transformers' ``moe_tp_experts`` (module docstring). ``params``: the module's own
    parameter names -> the transformers style of each (the plan's entries for them);
    a parameter the plan leaves out is replicated."""

    def __init__(self, params: Mapping[str, str], *, split_factor: int = 2) -> None:
        bad = sorted(f"{name}: {style}" for name, style in params.items() if style not in PARAM_STYLES)
        if bad:
            raise ValueError(f"ExpertTensorParallel: no parameter placement for {bad}; styles are {PARAM_STYLES}")
        super().__init__(split_factor=split_factor)
        self.params = dict(params)

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._check(module, device_mesh)
        own = dict(module.named_parameters(recurse=False))
        missing = sorted(set(self.params) - set(own))
        if missing:
            raise ValueError(f"ExpertTensorParallel: {type(module).__name__} has no parameters {missing}")
        # a replicated bias after a row split would be added once per rank before the sum
        added = sorted(n for n, s in self.params.items() if s == "rowwise" and isinstance(
            param_placement(s, n, own[n].ndim), Replicate))
        if added:
            raise ValueError(f"ExpertTensorParallel: rowwise biases {added} would be summed over the mesh")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)

        def placement_of(name: str, p: nn.Parameter) -> Placement:
            style = self.params.get(name)
            return Replicate() if style is None else param_placement(style, name, p.ndim, self.split_factor)

        _shard_parameters(self, module, device_mesh, placement_of)
        return install(module, _ExpertTensorForward(device_mesh, own_forward(module)))

    def __repr__(self) -> str:
        return f"ExpertTensorParallel({self.params!r}, split_factor={self.split_factor})"


class _ExpertTensorForward:
    """The installed forward of :class:`ExpertTensorParallel` (no state of its own)."""

    def __init__(self, mesh: DeviceMesh, inner: Callable) -> None:
        self.mesh, self.inner = mesh, inner

    def __deepcopy__(self, memo: dict) -> "_ExpertTensorForward":
        return self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        hidden, index, weights, *rest = (a.to_local() if isinstance(a, DTensor) else a for a in args)
        comm = self.mesh.get_group()
        _require_same_tokens(hidden, index, comm)
        hidden, weights = _SumGradient.apply(hidden, comm), _SumGradient.apply(weights, comm)
        with _local_parameters(module):
            out = self.inner(module, hidden, index, weights, *rest, **kwargs)
        return _SumOutput.apply(out, comm)
