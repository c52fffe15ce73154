"""``parallelize_module``: apply parallel styles to a module or its submodules by name.

The plan is resolved and checked as a whole before anything changes: every key must
name at least one submodule, every style must fit its module and the mesh, and no
parameter may be claimed by two styles. The checks read only what every rank shares
(module structure and types, the mesh shape), so a bad plan raises the same error on
every rank and leaves the model untouched.
"""
from __future__ import annotations

import warnings
from fnmatch import fnmatchcase

from torch import nn

from ..tensor.api import check_src_data_rank
from ..mesh import DeviceMesh
from ..mesh.foreign import require_mesh
from .style import ParallelStyle


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Parallelize ``module`` over the 1-D ``device_mesh`` by ``parallelize_plan``: one
    style for ``module`` itself, or a dict from dotted submodule names to styles. Each
    name component is an ``fnmatch`` pattern over one level of children (``"layers.*.mlp"``;
    ``""`` is ``module`` itself). Parameters are distributed from ``src_data_rank``, a
    group rank of the mesh (``None``: each rank keeps its own values, no communication).
    Can be called again on the same model for other submodules (e.g. once per layer).
    """
    device_mesh = require_mesh(device_mesh, "parallelize_module")
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan and does nothing", stacklevel=2)
        return module
    check_src_data_rank(src_data_rank, device_mesh)
    targets = _resolve(module, parallelize_plan)
    _check(targets, device_mesh)
    for _, submodule, style in targets:
        style.src_data_rank = src_data_rank
        style._apply(submodule, device_mesh)
    return module


def _resolve(module: nn.Module, plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, submodule, style) for every submodule each plan entry names, in plan order."""
    if isinstance(plan, ParallelStyle):
        return [("", module, plan)]
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    targets = []
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"parallelize_plan keys must be module names (str), got {key!r}")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan[{key!r}] must be a ParallelStyle, got {type(style).__name__}")
        matched = matching_submodules(module, key)
        if not matched:
            raise ValueError(f"parallelize_plan key {key!r} names no submodule of {type(module).__name__}")
        targets += [(name, sub, style) for name, sub in matched]
    return targets


def matching_submodules(module: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` of the submodules whose dotted name matches the plan key ``key``
    component by component (``fnmatch`` patterns)."""
    found = [("", module)]
    for token in key.split(".") if key else ():
        found = [
            (f"{prefix}.{name}" if prefix else name, child)
            for prefix, parent in found
            for name, child in parent.named_children()
            if fnmatchcase(name, token)
        ]
    return found


def _check(targets: list[tuple[str, nn.Module, ParallelStyle]], mesh: DeviceMesh) -> None:
    """Every style fits its module; no parameter or buffer goes to two parameter-owning styles."""
    owner: dict[int, int] = {}
    for index, (name, submodule, style) in enumerate(targets):
        where = name or "the root module"
        try:
            style._check(submodule, mesh)
        except (TypeError, ValueError) as err:
            raise type(err)(f"parallelize_plan at {where!r}: {err}") from None
        if not style._owns_parameters:
            continue
        for tensor in (*submodule.parameters(), *submodule.buffers()):
            first = owner.setdefault(id(tensor), index)
            if first != index:
                raise ValueError(
                    f"parallelize_plan gives the parameters of {where!r} to two styles "
                    f"(also at {targets[first][0] or 'the root module'!r})"
                )
