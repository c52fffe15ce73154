"""DTensor factory functions (``torch.distributed.tensor.zeros`` ... ``randn``).

Each rank creates only its own block of the global tensor: no communication.
``rand``/``randn`` use the layout-invariant generator of :mod:`mpidtensor.ops.random`,
so under one seed they give the same global tensor for every mesh and placements
(and the same as ``uniform_()``/``normal_()`` on a DTensor of that shape).
``Partial`` placements put the value on coordinate 0 of that mesh dim and the
reduction's identity elsewhere, as ``distribute_tensor`` does.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .layout import contiguous_strides
from .dtensor import DTensor
from ..mesh import DeviceMesh
from ..mesh.foreign import require_mesh
from ..ops import random
from .placements import Partial, Placement, Replicate, normalize_placements
from .redistribute import ToPartial
from .spec import DTensorSpec

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]

# Builds the local tensor from the spec with Partial taken as Replicate, its local shape and device.
Init = Callable[[DTensorSpec, tuple, torch.device], torch.Tensor]


def zeros(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros of global ``size``."""
    return _create("zeros", size, lambda s, shape, dev: torch.zeros(shape, dtype=s.dtype, device=dev),
                   dtype, layout, requires_grad, device_mesh, placements)


def ones(*size, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones of global ``size``."""
    return _create("ones", size, lambda s, shape, dev: torch.ones(shape, dtype=s.dtype, device=dev),
                   dtype, layout, requires_grad, device_mesh, placements)


def empty(*size, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialised DTensor of global ``size``."""
    return _create("empty", size, lambda s, shape, dev: torch.empty(shape, dtype=s.dtype, device=dev),
                   dtype, layout, requires_grad, device_mesh, placements)


def full(size, fill_value, *, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of global ``size`` filled with ``fill_value`` (dtype inferred from it, as ``torch.full``)."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _create("full", (size,), lambda s, shape, dev: torch.full(shape, fill_value, dtype=s.dtype, device=dev),
                   dtype, layout, requires_grad, device_mesh, placements)


def rand(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """U[0, 1) of global ``size``; the same global values for every layout under one seed."""
    def init(spec, shape, device):
        return random.uniform(random.draw_seed(device), random.Block.of(spec), spec.dtype)

    return _create("rand", size, init, dtype, layout, requires_grad, device_mesh, placements, seeded=True)


def randn(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """N(0, 1) of global ``size``; the same global values for every layout under one seed."""
    def init(spec, shape, device):
        return random.normal(random.draw_seed(device), random.Block.of(spec), spec.dtype)

    return _create("randn", size, init, dtype, layout, requires_grad, device_mesh, placements, seeded=True)


def _create(name: str, size, init: Init, dtype, layout, requires_grad: bool, mesh: DeviceMesh | None,
            placements, seeded: bool = False) -> DTensor:
    mesh = require_mesh(mesh, name)
    if layout != torch.strided:
        raise NotImplementedError(f"{name}: only layout=torch.strided is supported, got {layout}")
    shape = _size(name, size)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if seeded and dtype not in random._FLOATS:
        raise ValueError(f"{name}: dtype must be a real floating dtype, got {dtype}")
    placements = [Replicate()] * mesh.ndim if placements is None else placements
    placements = normalize_placements(placements, mesh.ndim, len(shape))
    spec = DTensorSpec(mesh, placements, shape, contiguous_strides(shape), dtype)
    if mesh.get_coordinate() is None:  # as torch: a rank outside the mesh holds an empty tensor, no collective
        return DTensor(torch.empty(0, dtype=dtype, device=random._mesh_device(mesh)), spec, requires_grad=requires_grad)
    whole = spec.with_placements([Replicate() if isinstance(p, Partial) else p for p in placements])
    local_shape, _ = whole.local_shape_and_offset()
    device = random._mesh_device(mesh)
    if seeded:
        random.sync_default_generator(mesh, device)
    local = init(whole, tuple(local_shape), device)
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            local = ToPartial(p.reduce_op, mesh._coord[m] == 0).run(local, mesh)
    return DTensor(local, spec, requires_grad=requires_grad)


def _size(name: str, size) -> torch.Size:
    """``(2, 3)``, ``((2, 3),)``, ``([2, 3],)`` or ``(torch.Size([2, 3]),)`` -> ``torch.Size([2, 3])``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size):
        raise ValueError(f"{name}: size must be non-negative ints, got {tuple(size)}")
    return torch.Size(size)


# ``DTensor.zeros(...)`` ... ``DTensor.randn(...)``: the same functions as class attributes.
for _factory in (empty, full, ones, rand, randn, zeros):
    setattr(DTensor, _factory.__name__, staticmethod(_factory))
del _factory
