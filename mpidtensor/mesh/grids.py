"""Rank grids: where every copy of a mesh lies among the ranks, the same on every rank.

A mesh built by ``init_device_mesh`` or ``DeviceMesh(...)`` is one copy of itself; a slice
``mesh["tp"]`` of a 2x2 mesh has two copies (one per "dp" coordinate), each rank a member of
one. A mesh's *grid* is an int64 tensor of shape ``(copies, *mesh.shape)`` listing the ranks
(of the communicator the root mesh was built over) of every copy. Slices, flattens and
unflattens compute their grid from their source's, from global metadata alone, so every
rank holds the same grids and whatever is decided from them (two meshes compose, or not)
is decided alike on every rank without communication. Relating meshes by these grids,
rather than by which object made which, lets meshes from different unflattens of one mesh
compose as torch's do (``mesh.relations.joint_mesh``).
"""
from __future__ import annotations

import torch


def root_grid(ranks: torch.Tensor) -> torch.Tensor:
    """The grid of a mesh that is its own only copy."""
    return ranks.reshape(1, *ranks.shape)


def sub_grid(grid: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The grid of the slice over mesh ``dims`` (ascending): the other dims become copies."""
    ndim = grid.ndim - 1
    rest = [d + 1 for d in range(ndim) if d not in dims]
    kept = [d + 1 for d in dims]
    moved = grid.permute(0, *rest, *kept)
    return moved.reshape(-1, *(grid.shape[d] for d in kept))


def flat_grid(grid: torch.Tensor) -> torch.Tensor:
    """The grid of the 1-D mesh over all dims, row-major."""
    return grid.reshape(grid.shape[0], -1)


def unflatten_grid(grid: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """The grid with mesh dim ``dim`` split row-major into ``sizes``."""
    shape = list(grid.shape)
    return grid.reshape(*shape[:dim + 1], *sizes, *shape[dim + 2:])


def joint_grid(dp: torch.Tensor, tp: torch.Tensor) -> torch.Tensor | None:
    """The grid of the mesh whose dims are ``dp``'s then ``tp``'s, on which every copy of
    ``dp`` is a slice over its dims and every copy of ``tp`` one over its dims, or None if
    there is none (the two meshes cover different ranks, or their groups cross other than
    once each)."""
    dp_shape, tp_shape = tuple(dp.shape[1:]), tuple(tp.shape[1:])
    dp_flat, tp_flat = dp.reshape(dp.shape[0], -1), tp.reshape(tp.shape[0], -1)
    ranks = dp_flat.flatten()
    if set(ranks.tolist()) != set(tp_flat.flatten().tolist()):
        return None
    size = int(ranks.max()) + 1
    dp_copy = torch.full((size,), -1, dtype=torch.int64)
    dp_index = torch.full((size,), -1, dtype=torch.int64)
    tp_copy = torch.full((size,), -1, dtype=torch.int64)
    dp_copy[dp_flat] = torch.arange(dp_flat.shape[0]).unsqueeze(1).expand_as(dp_flat)
    dp_index[dp_flat] = torch.arange(dp_flat.shape[1]).expand_as(dp_flat)
    tp_copy[tp_flat] = torch.arange(tp_flat.shape[0]).unsqueeze(1).expand_as(tp_flat)
    # one joint copy per tp copy whose first rank opens its dp group: its columns are the
    # dp groups of that tp group's ranks
    starts = tp_flat[dp_index[tp_flat[:, 0]] == 0]
    joint = dp_flat[dp_copy[starts]].transpose(1, 2)  # (copies, dp ranks, tp ranks)
    if joint.numel() != ranks.numel() or joint.flatten().unique().numel() != ranks.numel():
        return None
    if not torch.equal(tp_flat[tp_copy[joint[:, :, 0]]], joint):  # every row one tp group
        return None
    return joint.reshape(joint.shape[0], *dp_shape, *tp_shape)


def copy_of(grid: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The copy (a ``mesh.shape`` tensor) that holds ``rank``, or None."""
    found = (grid.reshape(grid.shape[0], -1) == rank).any(dim=1).nonzero()
    return grid[int(found[0])] if found.numel() else None
