"""``parallelize_module``: apply parallel styles to a module's submodules by name."""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from ..mesh import DeviceMesh
from .style import ParallelStyle


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle],
) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module``: one style for the module itself, or a dict
    from submodule names (fnmatch patterns such as ``"layers.*.mlp.fc1"``) to styles."""
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan._apply(module, device_mesh)
    for pattern, style in parallelize_plan.items():
        matched = [sub for name, sub in module.named_modules() if name and fnmatch(name, pattern)]
        if not matched:
            raise ValueError(f"parallelize_plan names {pattern!r}, which matches no submodule")
        for sub in matched:
            style._apply(sub, device_mesh)
    return module
