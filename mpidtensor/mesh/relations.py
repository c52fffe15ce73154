"""Meshes related by their rank grids: the joint mesh of a data-parallel mesh and a
tensor-parallel one; this rank's copy of a mesh another rank names.

FSDP x TP keeps each parameter on one mesh whose dims are the data-parallel mesh's and the
tensor-parallel mesh's. torch finds it from the meshes' common root; torchtitan takes its
FSDP mesh from one ``_unflatten`` of the world mesh and its TP mesh from another, so the
two are related by the ranks each dim spans, not by which mesh object sliced them. Here
the relation is decided from the meshes' rank grids (``mesh.grids``), which every rank
holds alike: the answer is the same on every rank, with no communication.
"""
from __future__ import annotations

from typing import Iterable

from . import grids
from ..runtime import watchdog
from .device_mesh import DeviceMesh
from .pickling import live_roots


def joint_mesh(dp: DeviceMesh, tp: DeviceMesh) -> tuple[DeviceMesh, tuple[int, ...], tuple[int, ...]] | None:
    """The mesh of which ``dp`` and ``tp`` are complementary sub-meshes, with the dims each
    takes in it, or None if there is none.

    Two slices that together cover one mesh give that mesh (``mesh["dp"]`` and
    ``mesh["tp"]``); otherwise
    the joint mesh has ``dp``'s dims then ``tp``'s, and every copy of each is one of its
    slices: ``mesh["dp", "cp"]._flatten("dp_cp")`` beside ``mesh["tp"]``, or meshes from
    two unflattens of one world mesh (torchtitan's FSDP and TP meshes). Its ranks need not
    be all of the root's (pipeline stages stay apart). Decided from the rank grids alike on
    every rank; the first call builds the joint mesh's communicator, collectively over its
    ranks only (``MPI_Comm_create_group``), and caches it with ``dp``."""
    parent = tp._parent
    if parent is not None and dp._parent is parent:
        dp_dims, tp_dims = dp._parent_dims, tp._parent_dims
        if not set(dp_dims) & set(tp_dims) and len(dp_dims) + len(tp_dims) == parent.ndim:
            return parent, dp_dims, tp_dims
    if dp.device_type != tp.device_type or dp._parent_comm != tp._parent_comm:
        return None
    key = ("joint", tp._key)
    joint = dp._submeshes.get(key)
    if joint is None or joint._freed:
        grid = grids.joint_grid(dp._grid, tp._grid)
        if grid is None:
            return None
        dp._require_member()
        joint = _build(dp, tp, grid)
        dp._submeshes[key] = joint
    return joint, tuple(range(dp.ndim)), tuple(range(dp.ndim, joint.ndim))


def find_copy(key: tuple, first: Iterable[DeviceMesh] = ()) -> DeviceMesh | None:
    """This rank's live copy of the mesh whose :meth:`DeviceMesh._copies_key` is ``key``: one
    of ``first`` (e.g. the meshes of a module's parameters), else one the program built or
    derived (slices, flattens, unflattens, joint meshes of its roots), else None. Local: it
    looks only at meshes this rank holds."""
    seen: set[int] = set()
    todo = [*first, *live_roots()]
    while todo:
        mesh = todo.pop(0)
        if id(mesh) in seen or mesh._freed:
            continue
        seen.add(id(mesh))
        if mesh._coord is not None and mesh._copies_key() == key:
            return mesh
        todo.extend(mesh._submeshes.values())
    return None


def _build(dp: DeviceMesh, tp: DeviceMesh, grid) -> DeviceMesh:
    """The joint mesh through this rank over ``grid``'s copy that holds it."""
    comm = dp._parent_comm
    ranks = grids.copy_of(grid, comm.rank)
    world = comm.Get_group()
    group = world.Incl(ranks.flatten().tolist())
    world.Free()
    members = watchdog.call("the joint mesh's ranks (Create_group)", comm, comm.Create_group, group, _TAG)
    group.Free()
    cart = watchdog.call("the joint mesh's communicator (Create_cart)", members, members.Create_cart,
                         list(ranks.shape), [False] * ranks.ndim, False)
    members.Free()
    names = None
    if dp.mesh_dim_names is not None and tp.mesh_dim_names is not None:
        names = dp.mesh_dim_names + tp.mesh_dim_names
        if len(set(names)) != len(names):
            names = None
    return DeviceMesh._from_cart(dp.device_type, ranks, names, comm, cart, grid=grid)


_TAG = 0x6A6F  # MPI_Comm_create_group's tag for joint meshes (copies are disjoint: one tag serves all)

__all__ = ["find_copy", "joint_mesh"]
