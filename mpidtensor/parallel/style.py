"""Tensor-parallel styles for ``nn.Linear`` and ``nn.Embedding`` (the names of
``torch.distributed.tensor.parallel``).

A style shards a module's parameters and wraps its forward: inputs arriving as
local tensors are read as ``input_layouts`` and redistributed to what the
sharded module needs; outputs are redistributed to ``output_layouts`` and, with
``use_local_output``, handed on as local tensors.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..api import distribute_tensor
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard, normalize_placements


class ParallelStyle:
    """Base of the styles: how to shard one module over a 1-D mesh."""

    def __init__(
        self,
        *,
        input_layouts: Placement,
        output_layouts: Placement,
        desired_input: Placement,
        use_local_output: bool,
    ) -> None:
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.desired_input = desired_input
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__} needs a 1-D mesh, got {mesh}")
        for name, placement in self._param_placements(module).items():
            param = getattr(module, name)
            if param is None:
                continue
            dist = distribute_tensor(param.data, mesh, [placement])
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(lambda mod, args: self._prepare_input(args, mesh))
        module.register_forward_hook(lambda mod, args, out: self._prepare_output(out, mesh))
        return module

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        raise NotImplementedError

    def _prepare_input(self, args: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = args
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layouts])
        if x.placements != normalize_placements([self.desired_input], 1, x.ndim):
            x = x.redistribute(mesh, [self.desired_input])
        return (x, *rest)

    def _prepare_output(self, out: Any, mesh: DeviceMesh) -> Any:
        if out.placements != normalize_placements([self.output_layouts], 1, out.ndim):
            out = out.redistribute(mesh, [self.output_layouts])
        return out.to_local() if self.use_local_output else out


class ColwiseParallel(ParallelStyle):
    """Shard a Linear's output features (weight ``Shard(0)``) or an Embedding's
    embedding dim (weight ``Shard(1)``); the input is replicated, the output sharded
    on its last dim."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts or Replicate(), output_layouts=output_layouts or Shard(-1),
                         desired_input=Replicate(), use_local_output=use_local_output)

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(0), "bias": Shard(0)}
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        raise TypeError(f"ColwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}")


class RowwiseParallel(ParallelStyle):
    """Shard a Linear's input features (weight ``Shard(1)``, bias replicated) or an
    Embedding's vocabulary (weight ``Shard(0)``); the partial output is reduced to
    ``output_layouts`` (``Replicate()`` by default: an all-reduce)."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts or Shard(-1), output_layouts=output_layouts or Replicate(),
                         desired_input=Shard(-1), use_local_output=use_local_output)

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(1), "bias": Replicate()}
        if isinstance(module, nn.Embedding):
            self.desired_input = Replicate()
            if self.input_layouts == Shard(-1):
                self.input_layouts = Replicate()
            return {"weight": Shard(0)}
        raise TypeError(f"RowwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}")
