"""torch's DTensor helpers that programs call directly (transformers' weight loading, torch's
tests), for mpidtensor's meshes and placements: the switch gives user code these in place of
torch's (:data:`.aliases.NAMES`)."""
from __future__ import annotations

from typing import Sequence

from ..mesh import DeviceMesh
from ..tensor.layout import local_shape_and_offset
from ..tensor.placements import Placement

__all__ = ["compute_local_shape_and_global_offset"]


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                                          placements: Sequence[Placement],
                                          skip_offset: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's ``_utils.compute_local_shape_and_global_offset``: this rank's local shape and
    its offset in the global tensor (``((0,), ())`` off the mesh; ``()`` as the offset when
    ``skip_offset``)."""
    if not mesh._is_current_rank_part_of_mesh():
        return (0,), ()
    shape, offset = local_shape_and_offset(tuple(global_shape), tuple(placements), mesh.shape, mesh._coord)
    return shape, () if skip_offset else offset
