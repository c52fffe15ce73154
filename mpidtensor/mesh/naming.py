"""Names of flattened dims, as torch's ``DeviceMesh._flatten`` gives them.

``mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")`` registers ``"dp_shard_cp"`` with the
mesh's root (the mesh it was sliced from, slices of slices followed up): ``root["dp_shard_cp"]``
then returns the flattened mesh, from the root or any mesh sharing it, and
``root["dp_replicate", "dp_shard_cp"]`` a 2-D mesh whose second dim is the flattened one
(accelerate's HSDP mesh). A flattened mesh is cached by its name and dims: the same dims
flattened under two names are two meshes with their own names (accelerate flattens
``("dp_shard", "cp")`` as ``"dp"`` and ``"dp_shard_cp"`` when there is no replication).
Every check here depends on names and dims alone, which every rank shares, so bad input
raises on every rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import grids
from ..runtime import watchdog

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh

__all__ = ["UnknownMeshDim", "flatten", "flattened_slice", "root_of"]


class UnknownMeshDim(KeyError, ValueError):
    """A mesh dim name no dim or ``_flatten`` has: a ``KeyError`` as torch's, and the
    ``ValueError`` mpidtensor raised before."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def root_of(mesh: "DeviceMesh") -> tuple["DeviceMesh", tuple[int, ...]]:
    """The mesh ``mesh`` was sliced from (followed up), and the root dims of ``mesh``'s."""
    dims = tuple(range(mesh.ndim))
    while mesh._parent is not None:
        dims = tuple(mesh._parent_dims[d] for d in dims)
        mesh = mesh._parent
    return mesh, dims


def flatten(mesh: "DeviceMesh", name: str | None) -> "DeviceMesh":
    """``mesh._flatten(name)`` (see the module docstring)."""
    mesh._require_live()
    if name is not None and not isinstance(name, str):
        raise TypeError(f"_flatten: mesh_dim_name must be a string, got {name!r}")
    name = name or "_".join(mesh.mesh_dim_names or ("flat",))
    if mesh.ndim == 1 and mesh.mesh_dim_names and name == mesh.mesh_dim_names[0]:
        return mesh  # torch: a 1-D mesh flattened into its own name is itself
    root, dims = root_of(mesh)
    if root.mesh_dim_names and name in root.mesh_dim_names:
        raise ValueError(f"_flatten: {name!r} already names a dim of {root} (dims {root.mesh_dim_names}); "
                         f"give the flattened mesh another name")
    known = root._flat_names.get(name)
    if known is not None and known[0] != dims:
        raise ValueError(f"_flatten: {name!r} already names the flattened root dims {_dim_names(root, known[0])} "
                         f"of {root}; flattening {_dim_names(root, dims)} needs another name")
    if known is not None and not known[1]._freed:
        return known[1]
    flat = mesh._submesh(tuple(range(mesh.ndim)), (name,), flatten=True)
    flat._flattened_from = mesh
    root._flat_names[name] = (dims, flat)
    return flat


def flattened_slice(mesh: "DeviceMesh", names: tuple[str, ...]) -> "DeviceMesh":
    """``mesh[names]`` where some name is a flattened one: that flattened mesh alone, or
    the root's dims regrouped (each flattened name one dim) when they keep the root's order."""
    root, own_dims = root_of(mesh)
    flats = root._flat_names
    own = mesh.mesh_dim_names or ()
    groups = []
    for n in names:
        if n in own:
            groups.append((own_dims[own.index(n)],))
        elif n in flats:
            groups.append(flats[n][0])
        else:
            raise UnknownMeshDim(f"mesh has no dimension named {n!r}: its dims are {tuple(own)}"
                                 f"{f', the flattened dims of its root {tuple(flats)}' if flats else ''}")
    if len(names) == 1:
        return flats[names[0]][1]
    order = [d for group in groups for d in group]
    if order != sorted(set(order)):
        raise ValueError(f"mesh[{names}]: the dims they cover, {tuple(groups)} of {root}, must be distinct "
                         f"and in the root's order")
    key = ("regrouped", names)
    found = root._submeshes.get(key)
    if found is None or found._freed:
        found = root._submeshes[key] = _regrouped(root, tuple(order), groups, names)
    return found


def _regrouped(root: "DeviceMesh", dims: tuple[int, ...], groups: list, names: tuple[str, ...]) -> "DeviceMesh":
    """The slice of ``root`` over ``dims`` with each group of dims merged into one."""
    sub = root if dims == tuple(range(root.ndim)) else root._submesh(dims, tuple(root.mesh_dim_names[d] for d in dims))
    sub._require_member()
    shape = [1] * len(groups)
    for i, group in enumerate(groups):
        for d in group:
            shape[i] *= root.shape[d]
    cart = watchdog.call("DeviceMesh._flatten: its communicator (Create_cart)", sub._cart, sub._cart.Create_cart,
                         shape, [False] * len(shape), False)  # row-major: same order
    grid = sub._grid.reshape(sub._grid.shape[0], *shape)
    return type(root)._from_cart(root.device_type, sub.mesh.reshape(shape), names, root._parent_comm, cart, grid)


def _dim_names(root: "DeviceMesh", dims: tuple[int, ...]) -> tuple:
    return tuple(root.mesh_dim_names[d] for d in dims) if root.mesh_dim_names else dims
