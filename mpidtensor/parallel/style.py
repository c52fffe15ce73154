"""``ParallelStyle`` and the matmul styles ``ColwiseParallel`` / ``RowwiseParallel`` for
``nn.Linear`` and ``nn.Embedding`` (the names and defaults of
``torch.distributed.tensor.parallel``).

A style shards a module's parameters and wraps its forward: a plain input is read as
the local shard of ``input_layouts``, redistributed to what the sharded module needs,
and the output is redistributed to ``output_layouts`` (handed on as a local tensor with
``use_local_output``). Every style first checks, without changing anything, that it
fits the module and the mesh (``_check``), so ``parallelize_module`` can validate a
whole plan before applying any of it. A plain ``nn.Linear``, and a plain ``nn.Embedding``
under ``RowwiseParallel``, get a forward that runs on their local blocks with Megatron's
collectives only (``fast.linear``, ``fast.embedding``, installed by a class swap:
``install``), falling back per call to that general path. ``PrepareModuleInput`` /
``PrepareModuleOutput`` / ``PrepareModuleInputOutput`` convert a module's inputs or outputs
to DTensors and redistribute them, leaving its parameters alone (torch keeps them in this
module too).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..tensor.api import distribute_module, distribute_tensor
from ..tensor.dtensor import DTensor
from ..tensor.layout import global_strides
from ..fast.embedding import LocalEmbeddingForward
from ..fast.gather import gather_shards
from ..fast.linear import LocalLinearForward
from ..mesh import DeviceMesh
from ..tensor.placements import Partial, Placement, Replicate, Shard, normalize_placements
from .install import install, own_forward


class ParallelStyle(ABC):
    """How to parallelize one module over a 1-D mesh (torch's contract: ``_apply``).

    ``src_data_rank`` (set by ``parallelize_module``) is the group rank whose values
    are distributed when parameters are sharded or replicated; ``None`` keeps each
    rank's own values and moves no data.
    """

    src_data_rank: int | None = 0
    #: True for styles that turn the module's parameters into DTensors (a module may
    #: take at most one of them).
    _owns_parameters: bool = False

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Raise ``TypeError``/``ValueError`` if this style cannot apply; change nothing.
        Decided from things every rank shares (module types, mesh shape)."""

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


# --- helpers shared by the styles ---------------------------------------------------------------


def require_1d_mesh(style: ParallelStyle, mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{type(style).__name__} needs a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__} needs a 1-D mesh, got {mesh}; slice a sub-mesh first, e.g. mesh['tp']"
        )


def require_plain_parameters(style: ParallelStyle, module: nn.Module) -> None:
    """A module whose parameters are already DTensors was parallelized before."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"{type(style).__name__}: parameter {name!r} of {type(module).__name__} is already a "
                f"DTensor (the module was parallelized before)"
            )


def one_placement(value: Any, what: str) -> Placement | None:
    """A layout argument given as a placement or a 1-tuple of one (or ``None``)."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if value is not None and not isinstance(value, Placement):
        raise TypeError(f"{what} must be a Placement (Shard, Replicate, Partial), got {value!r}")
    return value


def output_placement(value: Any, what: str) -> Placement | None:
    """A layout an output is redistributed to: ``Partial`` is not a redistribution target."""
    value = one_placement(value, what)
    if isinstance(value, Partial):
        raise ValueError(f"{what} cannot be a Partial ({value}): outputs are redistributed to Shard or Replicate")
    return value


def as_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, what: str,
               shape: Sequence[int] | None = None) -> DTensor:
    """``x`` itself if a DTensor, else the DTensor whose local shard on this rank it is.

    A plain ``x`` read as a ``Shard`` without its global ``shape`` costs one small
    all-gather of the local shapes (``from_local``'s exchange, which makes uneven
    local inputs correct); a caller that knows the global shape passes it."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor or DTensor, got {type(x).__name__}")
    stride = None if shape is None else global_strides(shape, x)
    return DTensor.from_local(x, mesh, (layout,), run_check=False, shape=shape, stride=stride)


def to_layout(x: DTensor, layout: Placement) -> DTensor:
    """``x`` redistributed to ``layout`` on its 1-D mesh (no-op when it already has it);
    ``Shard(d)`` -> ``Replicate`` by the local all-gather (``fast.gather``) where it applies
    (asked first: a replicated ``x`` has no route, and ``Placement.__eq__`` is a Python call)."""
    if isinstance(layout, Replicate):
        y = gather_shards(x)
        if y is not None:
            return y
    if x._spec.placements == (layout,):  # the common case, without normalizing
        return x
    target = normalize_placements((layout,), 1, x.ndim)
    return x if x.placements == target else x.redistribute(x.device_mesh, target)


def distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, layouts: Iterable[tuple[str, Placement]], src_data_rank: int | None
) -> None:
    """Replace ``module``'s named parameters by DTensors with the given placements."""
    for name, layout in layouts:
        param = module._parameters.get(name)
        if param is None:
            continue
        dist = distribute_tensor(param.data, mesh, [layout], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


# --- the matmul styles -----------------------------------------------------------------------


class _MatmulStyle(ParallelStyle):
    """Shared body of Colwise/Rowwise: parameters sharded per module type, one input
    prepared, the output redistributed."""

    _owns_parameters = True
    _supported = (nn.Linear, nn.Embedding)

    def __init__(self, input_layout: Placement, output_layout: Placement, use_local_output: bool) -> None:
        self.input_layouts = (input_layout,)
        self.output_layouts = (output_layout,)
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not isinstance(module, self._supported):
            raise TypeError(
                f"{type(self).__name__} supports nn.Linear and nn.Embedding, got {type(module).__name__} "
                f"(from {type(module).__module__})"  # a wrapper may share the name (peft's LoRA Linear)
            )
        require_1d_mesh(self, device_mesh)
        require_plain_parameters(self, module)

    @abstractmethod
    def _layouts(self, module: nn.Module) -> tuple[dict[str, Placement], Placement]:
        """(parameter placements, the input layout the sharded module computes on)."""

    def _input_shape(self, module: nn.Module, local: torch.Tensor) -> tuple[int, ...] | None:
        """The global shape of a plain input when the module determines it, else ``None``
        (then ``from_local`` gathers the local shapes)."""
        return None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        params, desired = self._layouts(module)
        given, wanted, local_out = self.input_layouts[0], self.output_layouts[0], self.use_local_output
        name = type(self).__name__

        def partition(_: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if sub is module:
                distribute_parameters(sub, mesh, params.items(), self.src_data_rank)

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            if not inputs:
                raise ValueError(f"{name} expects the module's input as its first positional argument")
            x = inputs[0]
            shape = self._input_shape(mod, x) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else None
            x = to_layout(as_dtensor(x, mesh, given, f"{name} input", shape), desired)
            return (x, *inputs[1:])

        def prepare_output(_: nn.Module, out: DTensor, mesh: DeviceMesh) -> Any:
            out = to_layout(out, wanted)
            return out.to_local() if local_out else out

        forward = own_forward(module)
        linear = isinstance(module, nn.Linear) and forward is nn.Linear.forward
        vocab = (isinstance(self, RowwiseParallel) and isinstance(module, nn.Embedding)
                 and forward is nn.Embedding.forward)
        if not (linear or vocab):
            return distribute_module(
                module, device_mesh, partition, prepare_input, prepare_output, src_data_rank=self.src_data_rank
            )
        # A plain Linear, or a vocabulary-parallel Embedding, runs on its local blocks with
        # Megatron's collectives (``fast``); its forward falls back to the hooks' work
        # (prepare_input, DTensor forward, prepare_output). Installed by a class swap.
        distribute_module(module, device_mesh, partition, src_data_rank=self.src_data_rank)
        if linear:
            forward = LocalLinearForward(device_mesh, isinstance(self, ColwiseParallel), given, wanted, local_out,
                                         prepare_input, prepare_output)
        else:
            forward = LocalEmbeddingForward(device_mesh, given, wanted, local_out, prepare_input, prepare_output)
        return install(module, forward)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class ColwiseParallel(_MatmulStyle):
    """Shard a Linear's output features (weight and bias ``Shard(0)``) or an Embedding's
    embedding dim (weight ``Shard(1)``). The input is read as ``input_layouts``
    (default ``Replicate()``) and replicated; the output, sharded on its last dim, is
    redistributed to ``output_layouts`` (default ``Shard(-1)``)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(
            one_placement(input_layouts, "input_layouts") or Replicate(),
            output_placement(output_layouts, "output_layouts") or Shard(-1),
            use_local_output,
        )
        self.desired_input_layouts = (Replicate(),)

    def _layouts(self, module: nn.Module) -> tuple[dict[str, Placement], Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(0), "bias": Shard(0)}, Replicate()
        return {"weight": Shard(1)}, Replicate()


class RowwiseParallel(_MatmulStyle):
    """Shard a Linear's input features (weight ``Shard(1)``, bias replicated; the input
    is made ``Shard(-1)``) or an Embedding's vocabulary (weight ``Shard(0)``; the indices
    are made replicated). The input is read as ``input_layouts`` (default ``Shard(-1)``,
    as in torch, for Embeddings too: pass ``Replicate()`` for replicated indices); the
    partial output is reduced to ``output_layouts`` (default ``Replicate()``: an
    all-reduce; ``Shard(d)``: a reduce-scatter).

    A plain input of a Linear read as ``Shard(-1)`` takes its global shape from the
    module (last dim ``in_features``), so no shapes are exchanged; other plain sharded
    inputs cost ``from_local``'s all-gather of the local shapes."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(
            one_placement(input_layouts, "input_layouts") or Shard(-1),
            output_placement(output_layouts, "output_layouts") or Replicate(),
            use_local_output,
        )

    def _layouts(self, module: nn.Module) -> tuple[dict[str, Placement], Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(1), "bias": Replicate()}, Shard(-1)
        return {"weight": Shard(0)}, Replicate()

    def _input_shape(self, module: nn.Module, local: torch.Tensor) -> tuple[int, ...] | None:
        given = self.input_layouts[0]
        if isinstance(module, nn.Linear) and local.ndim and given in (Shard(-1), Shard(local.ndim - 1)):
            return (*local.shape[:-1], module.in_features)
        return None


# --- inputs and outputs only ---------------------------------------------------------------------

Layouts = Placement | Sequence[Placement | None] | None


def _layout_tuple(value: Layouts, what: str, target: bool = False) -> tuple[Placement | None, ...] | None:
    """One placement, or one per input/output (``None`` for those left alone), as a tuple."""
    if value is None:
        return None
    items = (value,) if isinstance(value, Placement) else value
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"{what} must be a Placement or a tuple of Placement/None, got {value!r}")
    check = output_placement if target else one_placement
    return tuple(check(v, f"{what}[{i}]") if v is not None else None for i, v in enumerate(items))


def _kwarg_layouts(value: dict | None, what: str, target: bool = False) -> dict[str, Placement]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{what} must be a dict from keyword names to Placement, got {value!r}")
    check = output_placement if target else one_placement
    return {k: check(v, f"{what}[{k!r}]") for k, v in value.items()}


def _prepare(x: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None,
             local: bool, what: str) -> Any:
    """One input/output: read as ``given`` (left alone if ``None``), made ``desired``."""
    if given is None or x is None:
        return x
    dt = x if type(x) is DTensor else as_dtensor(x, mesh, given, what)  # (a DTensor as it is: a call fewer)
    if desired is not None:
        dt = to_layout(dt, desired)
    return dt.to_local() if local else dt


class _OnAnyModule(ParallelStyle):
    """A style that only wraps a module's inputs or outputs: any module type, a 1-D mesh."""

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        require_1d_mesh(self, device_mesh)


class PrepareModuleInput(_OnAnyModule):
    """Read positional inputs as ``input_layouts`` and redistribute them to
    ``desired_input_layouts`` (one entry per input, ``None`` for inputs left alone);
    likewise keyword inputs by name with ``input_kwarg_layouts`` /
    ``desired_input_kwarg_layouts``. DTensor inputs are taken as they are; ``None``
    values pass through. ``use_local_output`` (default False) hands the module local
    tensors."""

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _layout_tuple(input_layouts, "input_layouts")
        self.desired_input_layouts = _layout_tuple(desired_input_layouts, "desired_input_layouts", target=True)
        if self.input_layouts is not None:
            if self.desired_input_layouts is None or len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(
                    f"input_layouts {self.input_layouts} and desired_input_layouts "
                    f"{self.desired_input_layouts} need one entry each per input"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = _kwarg_layouts(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _kwarg_layouts(
            desired_input_kwarg_layouts, "desired_input_kwarg_layouts", target=True
        )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"input_kwarg_layouts and desired_input_kwarg_layouts must name the same keywords, got "
                f"{sorted(self.input_kwarg_layouts)} and {sorted(self.desired_input_kwarg_layouts)}"
            )
        self.use_local_output = use_local_output

    def _prepare_args(self, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if self.input_layouts is None:
            return inputs
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"PrepareModuleInput: the module got {len(inputs)} positional inputs but input_layouts "
                f"has {len(self.input_layouts)} entries"
            )
        return tuple([  # (a list comprehension: a generator is a Python call per item; None: left alone)
            x if given is None else
            _prepare(x, mesh, given, desired, self.use_local_output, f"PrepareModuleInput input {i}")
            for i, (x, given, desired) in enumerate(zip(inputs, self.input_layouts, self.desired_input_layouts))
        ])

    def _prepare_kwargs(self, kwargs: dict, mesh: DeviceMesh) -> dict:
        return {
            k: _prepare(v, mesh, self.input_kwarg_layouts.get(k), self.desired_input_kwarg_layouts.get(k),
                        self.use_local_output, f"PrepareModuleInput input {k!r}")
            for k, v in kwargs.items()
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda _, args, kwargs: (self._prepare_args(args, device_mesh),
                                         self._prepare_kwargs(kwargs, device_mesh)),
                with_kwargs=True,
            )
        else:
            module.register_forward_pre_hook(lambda _, args: self._prepare_args(args, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
            f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class PrepareModuleOutput(_OnAnyModule):
    """Read the module's outputs (one tensor or a tuple) as ``output_layouts`` and
    redistribute them to ``desired_output_layouts`` (``None`` entries: left alone).
    ``use_local_output`` (default True) hands on local tensors."""

    def __init__(
        self,
        *,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = _layout_tuple(output_layouts, "output_layouts")
        self.desired_output_layouts = _layout_tuple(desired_output_layouts, "desired_output_layouts", target=True)
        if (
            self.output_layouts is None
            or self.desired_output_layouts is None
            or len(self.output_layouts) != len(self.desired_output_layouts)
            or any(g is not None and d is None for g, d in zip(self.output_layouts, self.desired_output_layouts))
        ):
            raise ValueError(
                f"output_layouts {self.output_layouts} and desired_output_layouts {self.desired_output_layouts} "
                f"need one entry each per output (a desired layout for every output read as a DTensor)"
            )
        self.use_local_output = use_local_output

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        items = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(items) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: the module returned {len(items)} outputs but output_layouts "
                f"has {len(self.output_layouts)} entries"
            )
        out = tuple(
            _prepare(x, mesh, given, desired, self.use_local_output, f"PrepareModuleOutput output {i}")
            for i, (x, given, desired) in enumerate(zip(items, self.output_layouts, self.desired_output_layouts))
        )
        return out[0] if len(out) == 1 else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        module.register_forward_hook(lambda _, args, outputs: self._prepare_outputs(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
            f"{self.desired_output_layouts}, use_local_output={self.use_local_output})"
        )


class PrepareModuleInputOutput(_OnAnyModule):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module (``use_local_input``
    is the former's ``use_local_output``)."""

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        self.prepare_module_input._apply(module, device_mesh)
        return self.prepare_module_output._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"
