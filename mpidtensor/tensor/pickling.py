"""Pickling a ``DTensor``: its local tensor and its spec, rebuilt on the live mesh.

A DTensor pickles as ``rebuild_dtensor(DTensor, local, spec, requires_grad, state)``. The
local tensor goes through torch's own tensor pickling (storages shared within a file,
views kept, ``map_location`` applied); the spec pickles as its mesh (described by
:mod:`mpidtensor.mesh.pickling`, without MPI handles), placements, global shape, stride
and dtype; ``state`` is the tensor's ``__dict__`` (``nn.Parameter(dtensor)`` is a DTensor
marked ``_is_param`` there, as in torch, and stays a Parameter). ``torch.save`` of a
sharded state dict per rank and ``torch.load`` in a job of the same layout give DTensors
on the live mesh, bit-equal.

``torch.load(weights_only=True)`` refuses every global it was not told is safe. torch
registers its DTensor classes when ``torch.distributed.tensor`` is imported; mpidtensor
registers its own (:func:`safe_globals`) when the first mesh is built (a process-wide
effect, :mod:`mpidtensor.runtime.effects`). The placements registered are every subclass
of ``Placement`` defined by then, so a new placement class needs no change here.

Under the torch.distributed switch, ``torch.save`` writes torch's format instead (a file a
plain torch process loads; :mod:`.torch_format`), and ``torch.load`` reads both.
"""
from __future__ import annotations

from typing import Any

import torch

from ..mesh import DeviceMesh
from ..mesh.pickling import restore_mesh
from .placements import Placement
from . import torch_format
from .spec import DTensorSpec
from .validate import check_local_shape

__all__ = ["rebuild_dtensor", "reduce_dtensor", "safe_globals"]


def reduce_dtensor(tensor: torch.Tensor) -> tuple:
    """``DTensor.__reduce_ex__``: ``(rebuild_dtensor, (type, local, spec, requires_grad, state))``,
    or torch's DTensor's reduce tuple inside :func:`.torch_format.saving`."""
    if torch_format.saving_active():
        reduced = torch_format.reduce_as_torch(tensor)
        if reduced is not None:
            return reduced
    state = dict(tensor.__dict__)
    return rebuild_dtensor, (type(tensor), tensor._local_tensor, tensor._spec, tensor.requires_grad, state)


def rebuild_dtensor(cls: type, local: torch.Tensor, spec: DTensorSpec, requires_grad: bool,
                    state: dict[str, Any]) -> torch.Tensor:
    """The DTensor of ``local`` and ``spec`` (its mesh already the live one), with ``state``
    set on it. A local tensor that is not this rank's shard of the spec (a file of another
    rank) raises ``ValueError``."""
    if not isinstance(local, torch.Tensor) or type(spec) is not DTensorSpec or not isinstance(state, dict):
        raise ValueError(f"not a DTensor that mpidtensor pickled: {type(local).__name__}, {type(spec).__name__}")
    if local.dtype != spec.dtype:
        raise ValueError(f"local tensor of dtype {local.dtype} for a DTensor of dtype {spec.dtype}")
    check_local_shape(local, spec)
    tensor = cls(local, spec, requires_grad=requires_grad)
    for name, value in state.items():
        setattr(tensor, name, value)
    return tensor


def safe_globals(dtensor_cls: type) -> list:
    """What a pickled DTensor refers to: the classes and rebuild functions
    ``torch.load(weights_only=True)`` must be allowed to call."""
    placements, todo = [], [Placement]
    while todo:
        cls = todo.pop()
        placements.append(cls)
        todo.extend(cls.__subclasses__())
    return [dtensor_cls, rebuild_dtensor, DTensorSpec, DeviceMesh, restore_mesh, *placements]
