"""torch's DTensor helpers that programs call directly (transformers' weight loading, torch's
tests), for mpidtensor's meshes and placements: the switch gives user code these in place of
torch's (:data:`.aliases.NAMES`)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..mesh import DeviceMesh
from ..tensor.layout import contiguous_strides, local_shape_and_offset
from ..tensor.placements import Placement, Replicate, Shard
from ..tensor.redistribute import redistribute_local
from ..tensor.spec import DTensorSpec

__all__ = ["_compute_local_shape_and_global_offset", "compute_global_tensor_shape", "shard_dim_alltoall",
           "compute_local_shape_and_global_offset", "to_replicate_tensor"]


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


def _compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh_shape: Sequence[int],
                                           my_coordinate: Sequence[int] | None,
                                           placements: Sequence[Placement]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's private form of the above, from a mesh shape and a coordinate (``((0,), ())``
    for no coordinate: a rank off the mesh)."""
    if my_coordinate is None:
        return (0,), ()
    return local_shape_and_offset(tuple(global_shape), tuple(placements), tuple(mesh_shape), tuple(my_coordinate))


def compute_global_tensor_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Size:
    """torch's ``_utils.compute_global_tensor_shape``: the global shape from every rank's
    local ``shape`` (one allgather of the shapes over a 1-D mesh; uneven shards allowed).
    Raises torch's errors, alike on every rank (each rank checks the same gathered shapes)."""
    if len(placements) != 1:
        raise NotImplementedError("compute_global_tensor_shape only supports 1 placement for now.")
    if len(placements) != mesh.ndim:
        raise RuntimeError(f"Expected one placement per mesh dim, but found {len(placements)} placements "
                           f"and {mesh.ndim} mesh dims.")
    placement = placements[0]
    if isinstance(placement, Replicate):
        return torch.Size(shape)
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"Placement type {type(placement)} not supported.")
    shapes = mesh.comm_for((0,)).allgather(tuple(shape))
    dim = placement.dim
    others = [tuple(s[d] for d in range(len(s)) if d != dim) for s in shapes]
    if any(o != others[0] or len(s) != len(shape) for o, s in zip(others, shapes)):
        raise RuntimeError("Non-sharded dimensions should have identical size across ranks.")
    full = list(shape)
    full[dim] = sum(s[dim] for s in shapes)
    return torch.Size(full)


def to_replicate_tensor(placement: Placement, local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                        logical_shape: Sequence[int]) -> torch.Tensor:
    """torch's ``Shard._to_replicate_tensor``/``_StridedShard._to_replicate_tensor``: the tensor of
    ``logical_shape`` whose shard ``local`` is over ``mesh_dim`` (gathered by mpidtensor's
    redistribute over that dim's ranks only: the other dims are taken as replicated)."""
    shape = tuple(logical_shape)
    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = placement
    src = DTensorSpec(mesh, placements, shape, contiguous_strides(shape), local.dtype)
    return redistribute_local(local, src, src.with_placements([Replicate()] * mesh.ndim))


def shard_dim_alltoall(input: torch.Tensor, gather_dim: int, shard_dim: int, mesh: DeviceMesh,
                       mesh_dim: int) -> torch.Tensor:
    """torch's ``_collective_utils.shard_dim_alltoall``: ``input``, this rank's shard of
    ``gather_dim`` over ``mesh_dim`` (equal shards), becomes its shard of ``shard_dim`` (one
    all-to-all over that mesh dim). A meta ``input`` gives the meta result, moving nothing."""
    shape = list(input.shape)
    shape[gather_dim] *= mesh.size(mesh_dim)
    src_placements = [Replicate()] * mesh.ndim
    src_placements[mesh_dim] = Shard(gather_dim)
    src = DTensorSpec(mesh, src_placements, shape, contiguous_strides(shape), input.dtype)
    dst_placements = list(src_placements)
    dst_placements[mesh_dim] = Shard(shard_dim)
    dst = src.with_placements(dst_placements)
    if input.is_meta:
        return torch.empty(dst.local_shape_and_offset()[0], dtype=input.dtype, device="meta")
    return redistribute_local(input.contiguous(), src, dst).contiguous()
