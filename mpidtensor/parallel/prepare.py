"""``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``: convert a
module's inputs or outputs to DTensors and redistribute them, leaving its parameters alone
(as ``torch.distributed.tensor.parallel``)."""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..mesh import DeviceMesh
from ..placements import Placement
from .style import ParallelStyle, as_dtensor, one_placement, output_placement, require_1d_mesh, to_layout

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
    dt = as_dtensor(x, mesh, given, what)
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
        return tuple(
            _prepare(x, mesh, given, desired, self.use_local_output, f"PrepareModuleInput input {i}")
            for i, (x, given, desired) in enumerate(zip(inputs, self.input_layouts, self.desired_input_layouts))
        )

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
