"""Checks of user input that involve several ranks.

Each check gathers a few facts from every rank of the mesh and derives one verdict
from the same list everywhere, so a bad input raises the same ``ValueError`` on
every rank instead of leaving some ranks waiting in a collective.
"""
from __future__ import annotations

import zlib
from itertools import product
from typing import Sequence

import torch

from .layout import local_shape_and_offset
from ..mesh import DeviceMesh
from .placements import Placement, Replicate, normalize_placements, shard_dim
from ..runtime.agreement import raise_listed, require_same
from ..runtime import watchdog


def check_same_tensor_meta(tensor: torch.Tensor, mesh: DeviceMesh, what: str) -> None:
    """All ranks of ``mesh`` pass tensors of one shape and dtype."""
    def message(facts: list) -> str:
        detail = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(facts))
        return f"{what} got tensors of different shapes or dtypes on different ranks ({detail})"

    require_same(mesh.comm, (tuple(tensor.shape), str(tensor.dtype)), message)


def global_shape_from_locals(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> torch.Size:
    """The global shape implied by every rank's local shape (one small all-gather when sharded).

    ``placements`` as the user gave them: a negative ``Shard`` dim is resolved against the
    tensor rank the ranks agree on, not against this rank's local tensor."""
    if isinstance(placements, Placement) or not any(shard_dim(p) is not None for p in placements):
        return local.shape  # nothing sharded: no rank's shape says more than another's
    shapes = watchdog.call("from_local: every rank's local shape (allgather)", mesh.comm, mesh.comm.allgather,
                           tuple(local.shape))
    raise_listed(_ndim_problems(shapes))
    placements = normalize_placements(placements, mesh.ndim, len(shapes[0]))
    raise_listed(_shape_problems(shapes, mesh, placements, None))
    return torch.Size(_implied_shape(shapes, mesh, placements))


def check_local_tensors(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None
) -> None:
    """``from_local(run_check=True)``: ``shape``, dtypes, ``requires_grad``, strides (of equal
    local shapes), local shapes (against ``shape`` if given) and replicas agree across the
    mesh, as torch checks them (one all-gather; the verdict is the same on every rank)."""
    data = local.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    given = None if shape is None else tuple(shape)
    facts = watchdog.call("from_local(run_check=True): every rank's local tensor (allgather)", mesh.comm,
                          mesh.comm.allgather, (tuple(local.shape), str(local.dtype), zlib.crc32(data), given,
                                                local.requires_grad, local.stride()))
    if len({f[3] for f in facts}) > 1:
        raise_listed(["ranks passed different shape= arguments: " + str([f[3] for f in facts])])
    shapes = [f[0] for f in facts]
    problems = _ndim_problems(shapes)
    if len({f[1] for f in facts}) > 1:
        problems.append("local tensors have different dtypes: " + str([f[1] for f in facts]))
    if len({f[4] for f in facts}) > 1:
        problems.append("local tensors differ in requires_grad: " + str([f[4] for f in facts]))
    strides: dict[tuple, set] = {}
    for f in facts:
        strides.setdefault(f[0], set()).add(f[5])
    if any(len(found) > 1 for found in strides.values()):
        problems.append("local tensors of the same shape have different strides: " + str([f[5] for f in facts]))
    raise_listed(problems)
    placements = normalize_placements(placements, mesh.ndim, len(given if given is not None else shapes[0]))
    problems = _shape_problems(shapes, mesh, placements, given)
    if not problems:
        for m, p in enumerate(placements):
            if isinstance(p, Replicate):
                for group in _groups_along(mesh.shape, m):
                    if len({facts[r][2] for r in group}) > 1:
                        problems.append(f"ranks {group} replicate mesh dim {m} but hold different values")
    raise_listed(problems)


def check_local_shape(local: torch.Tensor, spec) -> None:
    """The local tensor has the shape the layout gives this rank.

    A local check with no communication: a wrong shard raises on its own rank only,
    and the other ranks end at their next collective through the abort hook
    (:mod:`mpidtensor.runtime.abort`). Only ``from_local(run_check=True)`` can tell every rank."""
    expected = spec.local_shape_and_offset()[0]
    if tuple(local.shape) != expected:
        raise ValueError(
            f"local tensor of shape {tuple(local.shape)} does not match the shard {expected} that "
            f"{list(spec.placements)} gives this rank of a global tensor of shape {tuple(spec.shape)}"
        )


def _ndim_problems(shapes) -> list[str]:
    if len({len(s) for s in shapes}) > 1:
        return [f"local tensors have different numbers of dims: {shapes}"]
    return []


def _shape_problems(shapes, mesh: DeviceMesh, placements, shape: Sequence[int] | None) -> list[str]:
    """What is wrong with the ranks' local shapes for a global ``shape`` (default: the implied one)."""
    problems = _ndim_problems(shapes)
    if problems:
        return problems
    ndim = len(shapes[0])
    if shape is not None and len(shape) != ndim:
        return [f"local tensors have {ndim} dims, shape= {tuple(shape)} has {len(shape)}"]
    problems = []
    for d in range(ndim):
        if not any(shard_dim(p) == d for p in placements) and len({s[d] for s in shapes}) > 1:
            problems.append(f"local sizes of unsharded dim {d} differ across ranks: {[s[d] for s in shapes]}")
    if problems:
        return problems
    implied = _implied_shape(shapes, mesh, placements) if shape is None else list(shape)
    for rank, coord in enumerate(product(*map(range, mesh.shape))):
        expected = local_shape_and_offset(implied, placements, mesh.shape, coord)[0]
        if tuple(shapes[rank]) != expected:
            problems.append(
                f"local shapes {shapes} do not follow the torch.chunk layout of a global shape "
                f"{tuple(implied)} (rank at {coord} should hold {expected}); pass shape= or fix the shards"
            )
            break
    return problems


def _implied_shape(shapes, mesh: DeviceMesh, placements) -> list[int]:
    """Sum each sharded dim's local sizes over its sharding mesh dims (others at coordinate 0)."""
    coords = list(product(*map(range, mesh.shape)))
    out = list(shapes[0])
    for d in range(len(out)):
        sharders = [m for m, p in enumerate(placements) if shard_dim(p) == d]
        if sharders:
            out[d] = sum(
                shapes[r][d]
                for r, c in enumerate(coords)
                if all(c[m] == 0 for m in range(len(c)) if m not in sharders)
            )
    return out


def _groups_along(mesh_shape, mesh_dim: int) -> list[list[int]]:
    """Rank lists (row-major rank numbering) that differ only in coordinate ``mesh_dim``."""
    coords = list(product(*map(range, mesh_shape)))
    groups: dict[tuple, list[int]] = {}
    for rank, c in enumerate(coords):
        groups.setdefault(c[:mesh_dim] + c[mesh_dim + 1:], []).append(rank)
    return list(groups.values())

