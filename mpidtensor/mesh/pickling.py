"""Pickling a ``DeviceMesh``: a description without MPI handles, rebuilt as the live mesh.

A mesh pickles as ``restore_mesh(DeviceMesh, description)``. The description holds only
what every rank shares: the device type, the world size, the layout of the root mesh
(shape, ranks, dim names: the mesh the program built with ``init_device_mesh`` or
``DeviceMesh(...)``) and the path from that root to this mesh (slices, flattens, unflattens,
as ``device_mesh.py`` records them). Which sub-mesh a rank gets follows from its place in
the root, as when the program sliced it.

Unpickling returns the live mesh: the root the program already built and its cached
sub-meshes, or else builds them. Roots are kept in a weak, bounded registry by layout,
numbered in the order the program built them (the same on every rank), so that of two
equal roots the pickled one comes back, or else the last one built that is still held (a
freed or collected root does not count). Building is collective over ``COMM_WORLD``: every
rank must unpickle the same structure in the same order, as torch requires of its own
``torch.load`` of DTensors. Whether a root is held is decided after a garbage collection,
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

from .cuda import bind_local_gpu
from .launch import check_launch_once
from ..runtime import watchdog

__all__ = ["describe", "layout_text", "live_roots", "reduce_mesh", "remember_root", "restore_mesh"]

VERSION = 1
_PRUNE_AT = 64  # roots of one layout kept before the collected and freed ones are dropped


class _Roots:
    """The roots of one layout, numbered in the order the program built them (the same on
    every rank), by weak reference."""

    __slots__ = ("built", "refs")

    def __init__(self) -> None:
        self.built = 0
        self.refs: dict[int, weakref.ref] = {}

    def add(self, mesh) -> None:
        self.refs[self.built] = weakref.ref(mesh)
        self.built += 1
        if len(self.refs) > _PRUNE_AT:  # dropping dead ones changes no other root's number
            self.refs = {n: ref for n, ref in self.refs.items() if _live(ref)}

    def number(self, mesh) -> int | None:
        return next((n for n, ref in self.refs.items() if ref() is mesh), None)

    def find(self, number: int):
        """Root ``number`` if the program still holds it, else the last-built root of the
        layout it holds, else None: the same answer on every rank, because liveness is
        decided after a garbage collection (a root kept only by garbage cycles would be
        collected at different moments on different ranks)."""
        if not any(_live(ref) for ref in self.refs.values()):
            return None
        gc.collect()
        if _live(self.refs.get(number)):
            return self.refs[number]()
        live = [n for n, ref in self.refs.items() if _live(ref)]
        return self.refs[max(live)]() if live else None


# Roots by (device type, world size, shape, ranks, names). Weak references: a mesh the
# program dropped can be collected. A registry, not a cache: `clear_cache()` must not forget
# the program's meshes (a load would then build a second mesh instead of returning the live
# one). One entry per layout the program built; each entry prunes its dead roots.
_ROOTS: dict[tuple, _Roots] = {}  # not cleared: the live roots (weak), pruned as they die


def live_roots() -> list:
    """The roots the program built and still holds on this rank (unfreed), oldest first."""
    found = [ref() for roots in _ROOTS.values() for ref in roots.refs.values()]
    return [mesh for mesh in found if mesh is not None and not mesh._freed]


def remember_root(mesh) -> None:
    """Register ``mesh``, built by the program (not derived), as a root unpickling may return."""
    key = _key_of(mesh)
    roots = _ROOTS.get(key)
    if roots is None:
        roots = _ROOTS[key] = _Roots()
    roots.add(mesh)


def reduce_mesh(mesh) -> tuple:
    """``mesh.__reduce__``: ``(restore_mesh, (type(mesh), description))``."""
    return restore_mesh, (type(mesh), describe(mesh))


def describe(mesh) -> tuple:
    """``(version, device type, world size, root number, root shape, root ranks, root names,
    path)``: plain tuples, ints and strings, so ``torch.load(weights_only=True)`` may read it.
    The root number is its place among the program's roots of that layout (None: a group)."""
    mesh._require_live()
    path = []
    while True:
        if mesh._parent is not None:
            path.append(("slice", tuple(mesh._parent_dims), mesh.mesh_dim_names))
            mesh = mesh._parent
        elif mesh._flattened_from is not None:
            path.append(("flatten", mesh.mesh_dim_names[0]))
            mesh = mesh._flattened_from
        elif mesh._unflattened_from is not None:
            source, dim, sizes, names = mesh._unflattened_from
            path.append(("unflatten", dim, sizes, names))
            mesh = source
        else:
            break
    roots = _ROOTS.get(_key_of(mesh))
    number = None if roots is None else roots.number(mesh)
    return (VERSION, mesh.device_type, mesh._parent_comm.size, number, tuple(mesh.mesh.shape),
            tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names, tuple(reversed(path)))


def restore_mesh(cls: type, description: tuple) -> Any:
    """The live mesh ``description`` names (see the module docstring); collective when it
    must be built."""
    version, device, world, number, shape, ranks, names, path = _checked(description)
    roots = _ROOTS.get((device, world, shape, ranks, names)) if number is not None else None
    root = None if roots is None else roots.find(number)
    if root is None:
        size = MPI.COMM_WORLD.size if MPI.Is_initialized() and not MPI.Is_finalized() else 0
        if size != world:
            raise ValueError(
                f"this DTensor or DeviceMesh was saved on {layout_text(description)} of {world} ranks; "
                f"this job has {size} rank{'' if size == 1 else 's'}: load it in a job of {world} ranks "
                f"(torch.load rebuilds the mesh there)")
        layout = torch.tensor(ranks, dtype=torch.int64).reshape(shape)
        root = _build_group(cls, device, layout, names) if number is None else cls(device, layout, mesh_dim_names=names)
    for step in path:
        root = _replay(root, step)
    return root


def layout_text(description: tuple) -> str:
    """``DeviceMesh('cpu', shape (2, 2), names ('dp', 'tp'))['tp']``: the saved layout in words."""
    _, device, _, number, shape, ranks, names, path = description
    text = f"DeviceMesh('{device}', shape {tuple(shape)}" + (f", names {tuple(names)}" if names else "")
    text += ")" if number is not None else f", ranks {list(ranks)})"
    for step in path:
        if step[0] == "slice":
            text += f"[{', '.join(map(repr, step[2]))}]" if step[2] else f"[dims {step[1]}]"
        elif step[0] == "flatten":
            text += f"._flatten({step[1]!r})"
        else:
            text += f"._unflatten({step[1]}, {step[2]}, {step[3]})"
    return text


# --- helpers ---------------------------------------------------------------------------------
def _key_of(mesh) -> tuple:
    return (mesh.device_type, mesh._parent_comm.size, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
            mesh.mesh_dim_names)


def _live(ref: weakref.ref | None) -> bool:
    mesh = None if ref is None else ref()
    return mesh is not None and not mesh._freed


def _replay(mesh, step: tuple):
    """The mesh ``step`` derives from ``mesh``: cached in ``mesh`` if the program made it."""
    if step[0] == "slice":
        dims = step[1]
        return mesh if dims == tuple(range(mesh.ndim)) else mesh._submesh(dims, step[2])
    if step[0] == "flatten":
        return mesh._flatten(step[1])
    return mesh._unflatten(step[1], step[2], step[3])


def _build_group(cls: type, device: str, ranks: torch.Tensor, names):
    """A mesh over ``ranks``, this rank's group of a partition of ``COMM_WORLD`` into
    meshes of one shape (each rank names its own). Collective over ``COMM_WORLD``."""
    check_launch_once()
    comm = MPI.COMM_WORLD
    flat = ranks.flatten().tolist()
    member = comm.rank in flat
    ordered = watchdog.call("a mesh over a partition of the world (Split)", comm, comm.Split,
                            min(flat) if member else MPI.UNDEFINED, flat.index(comm.rank) if member else 0)
    cart = None
    if member:
        cart = watchdog.call("a mesh over a partition of the world (Create_cart)", ordered, ordered.Create_cart,
                             list(ranks.shape), [False] * ranks.ndim, False)
        ordered.Free()
    mesh = cls._from_cart(device, ranks, names, comm, cart)
    if device == "cuda":
        bind_local_gpu(comm)
    return mesh


def _checked(description: Any) -> tuple:
    """``description`` if it is one this module wrote (a pickle is input: check before use)."""
    ok = isinstance(description, tuple) and len(description) == 8 and description[0] == VERSION
    if ok:
        _, device, world, number, shape, ranks, names, path = description
        ok = (isinstance(device, str) and isinstance(world, int) and world > 0
              and (number is None or (isinstance(number, int) and number >= 0))
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
    return (step[0] == "unflatten" and len(step) == 4 and isinstance(step[1], int) and _ints(step[2])
            and isinstance(step[3], tuple) and all(isinstance(n, str) for n in step[3]))
