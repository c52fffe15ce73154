"""Pickling a ``DeviceMesh``: a description without MPI handles, rebuilt as the live mesh.

A mesh pickles as ``restore_mesh(DeviceMesh, description)``. The description holds only
what every rank shares: the device type, the world size, the layout of the root mesh
(shape, ranks, dim names: the mesh the program built with ``init_device_mesh`` or
``DeviceMesh(...)``) and the path from that root to this mesh (slices, flattens, merges,
as ``device_mesh.py`` records them). Which sub-mesh a rank gets follows from its place in
the root, as when the program sliced it.

Unpickling returns the live mesh: the root the program already built (a weak, bounded
registry of roots by layout; a freed or collected root does not count) and its cached
sub-meshes, or else builds them. Building is collective over ``COMM_WORLD``: every rank
must unpickle the same structure in the same order, as torch requires of its own
``torch.load`` of DTensors. Whether a root is live is decided after a garbage collection,
so that a root kept only by garbage cycles (collected at different times on different
ranks) cannot be found on some ranks and rebuilt on others. A job of another world size
(a single process included) raises ``ValueError`` naming the saved layout and this job's,
on every rank: the world size and the pickle are what every rank shares.

A mesh derived in a way this module does not know (no root it can name) is described by
its own ranks as one group of a partition of the world, and rebuilt as a new mesh with
those ranks (equal to the program's, not the same object).
"""
from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from mpi4py import MPI

from ..runtime import caches
from .cuda import bind_local_gpu
from .launch import check_launch_once

__all__ = ["describe", "layout_text", "reduce_mesh", "remember_root", "restore_mesh"]

VERSION = 1
ROOT, GROUP = "root", "group"  # a registered root, or this rank's group of an unknown partition

# Roots by (device type, world size, shape, ranks, names): weak references, so a mesh the
# program dropped can be collected. Insertion order is the program's (the same on every
# rank), so dropping the oldest past the bound drops the same entries everywhere.
_ROOTS: dict[tuple, weakref.ref] = caches.cache("mesh.pickled_roots", 1024, holds_meshes=False)


def remember_root(mesh) -> None:
    """Register ``mesh``, built by the program (not derived), as a root unpickling may return."""
    _ROOTS[_root_key(mesh.device_type, mesh._parent_comm.size, mesh.mesh, mesh.mesh_dim_names)] = weakref.ref(mesh)


def reduce_mesh(mesh) -> tuple:
    """``mesh.__reduce__``: ``(restore_mesh, (type(mesh), description))``."""
    return restore_mesh, (type(mesh), describe(mesh))


def describe(mesh) -> tuple:
    """``(version, device type, world size, kind, root shape, root ranks, root names, path)``:
    plain tuples, ints and strings, so ``torch.load(weights_only=True)`` may read it."""
    mesh._require_live()
    path = []
    while not _is_root(mesh):
        if mesh._parent is not None:
            path.append(("slice", tuple(mesh._parent_dims), mesh.mesh_dim_names))
            mesh = mesh._parent
        elif mesh._flattened_from is not None:
            path.append(("flatten", mesh.mesh_dim_names[0]))
            mesh = mesh._flattened_from
        elif mesh._merged_from is not None:
            source = mesh._merged_from
            _, dims, name = next(k for k, sub in source._submeshes.items() if sub is mesh)
            path.append(("merge", dims, name))
            mesh = source
        else:
            return _description(mesh, GROUP, path)
    return _description(mesh, ROOT, path)


def restore_mesh(cls: type, description: tuple) -> Any:
    """The live mesh ``description`` names (see the module docstring); collective when it
    must be built."""
    version, device, world, kind, shape, ranks, names, path = _checked(description)
    root = _find_root(_root_key(device, world, torch.tensor(ranks).reshape(shape), names)) if kind == ROOT else None
    if root is None:
        size = MPI.COMM_WORLD.size if MPI.Is_initialized() and not MPI.Is_finalized() else 0
        if size != world:
            raise ValueError(
                f"this DTensor or DeviceMesh was saved on {layout_text(description)} of {world} ranks; "
                f"this job has {size} rank{'' if size == 1 else 's'}: load it in a job of {world} ranks "
                f"(torch.load rebuilds the mesh there)")
        layout = torch.tensor(ranks, dtype=torch.int64).reshape(shape)
        root = cls(device, layout, mesh_dim_names=names) if kind == ROOT else _build_group(cls, device, layout, names)
    for step in path:
        root = _replay(root, step)
    return root


def layout_text(description: tuple) -> str:
    """``DeviceMesh('cpu', shape (2, 2), names ('dp', 'tp'))['tp']``: the saved layout in words."""
    _, device, _, kind, shape, ranks, names, path = description
    text = f"DeviceMesh('{device}', shape {tuple(shape)}" + (f", names {tuple(names)}" if names else "")
    text += ")" if kind == ROOT else f", ranks {list(ranks)})"
    for step in path:
        if step[0] == "slice":
            text += f"[{', '.join(map(repr, step[2]))}]" if step[2] else f"[dims {step[1]}]"
        elif step[0] == "flatten":
            text += f"._flatten({step[1]!r})"
        else:
            text += f" with dims {step[1]} merged as {step[2]!r}"
    return text


# --- helpers ---------------------------------------------------------------------------------
def _root_key(device: str, world: int, ranks: torch.Tensor, names) -> tuple:
    return device, world, tuple(ranks.shape), tuple(ranks.flatten().tolist()), names


def _is_root(mesh) -> bool:
    ref = _ROOTS.get(_root_key(mesh.device_type, mesh._parent_comm.size, mesh.mesh, mesh.mesh_dim_names))
    return ref is not None and ref() is mesh


def _live(ref: weakref.ref | None) -> bool:
    mesh = None if ref is None else ref()
    return mesh is not None and not mesh._freed


def _find_root(key: tuple):
    """The registered root of ``key`` if the program still holds it, else None; the same
    answer on every rank (a root found is checked again after a garbage collection)."""
    ref = _ROOTS.get(key)
    if not _live(ref):
        return None
    gc.collect()
    return ref() if _live(ref) else None


def _description(mesh, kind: str, path: list) -> tuple:
    return (VERSION, mesh.device_type, mesh._parent_comm.size, kind, tuple(mesh.mesh.shape),
            tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names, tuple(reversed(path)))


def _replay(mesh, step: tuple):
    """The mesh ``step`` derives from ``mesh``: cached in ``mesh`` if the program made it."""
    if step[0] == "slice":
        dims = step[1]
        return mesh if dims == tuple(range(mesh.ndim)) else mesh._submesh(dims, step[2])
    if step[0] == "flatten":
        return mesh._flatten(step[1])
    return mesh._merged(step[1], step[2])


def _build_group(cls: type, device: str, ranks: torch.Tensor, names):
    """A mesh over ``ranks``, this rank's group of a partition of ``COMM_WORLD`` into
    meshes of one shape (each rank names its own). Collective over ``COMM_WORLD``."""
    check_launch_once()
    comm = MPI.COMM_WORLD
    flat = ranks.flatten().tolist()
    member = comm.rank in flat
    ordered = comm.Split(min(flat) if member else MPI.UNDEFINED, flat.index(comm.rank) if member else 0)
    cart = None
    if member:
        cart = ordered.Create_cart(list(ranks.shape), periods=[False] * ranks.ndim, reorder=False)
        ordered.Free()
    mesh = cls._from_cart(device, ranks, names, comm, cart)
    if device == "cuda":
        bind_local_gpu(comm)
    return mesh


def _checked(description: Any) -> tuple:
    """``description`` if it is one this module wrote (a pickle is input: check before use)."""
    ok = isinstance(description, tuple) and len(description) == 8 and description[0] == VERSION
    if ok:
        _, device, world, kind, shape, ranks, names, path = description
        ok = (isinstance(device, str) and isinstance(world, int) and world > 0 and kind in (ROOT, GROUP)
              and _ints(shape) and _ints(ranks) and torch.Size(shape).numel() == len(ranks)
              and (names is None or (isinstance(names, tuple) and all(isinstance(n, str) for n in names)))
              and isinstance(path, tuple) and all(_step_ok(step) for step in path))
    if not ok:
        raise ValueError(f"not a DeviceMesh description that mpidtensor wrote: {description!r:.300}")
    return description


def _ints(values: Any) -> bool:
    return isinstance(values, tuple) and all(isinstance(v, int) and v >= 0 for v in values)


def _step_ok(step: Any) -> bool:
    if not isinstance(step, tuple) or not step:
        return False
    if step[0] == "slice":
        return len(step) == 3 and _ints(step[1]) and (step[2] is None or isinstance(step[2], tuple))
    if step[0] == "flatten":
        return len(step) == 2 and isinstance(step[1], str)
    return step[0] == "merge" and len(step) == 3 and _ints(step[1]) and isinstance(step[2], str)
