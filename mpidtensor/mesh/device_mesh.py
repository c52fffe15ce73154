"""``DeviceMesh`` on MPI Cartesian communicators.

A mesh is one Cartesian communicator whose coordinates are the mesh
coordinates. Each dimension's communicator is a ``Cart_sub`` of it, made with the mesh.
One over several dims (not all) is made on first use, collectively over its own ranks
only (``MPI_Comm_create_group``, then ``Create_cart``: ``Cart_sub`` would need every rank
of the mesh, so a pipeline stage slicing ``mesh["dp", "tp"]`` while the next stage waits
for it hung both), and cached. A slice (``mesh["tp"]``, ``mesh["dp", "tp"]``) holds no
communicator of its own: its mesh communicator and its dims' are its parent's over the
same dims, the former asked for when first used, so slicing runs no collective, as torch's
does not (transformers slices meshes from several weight-loading threads at once; ranks
that slice several groups of dims in different orders would otherwise wait for each
other). ``free()`` releases them all and marks the mesh freed: every
later use of it raises the same error on every rank (the mark is set by the collective
``free()`` on all of them), and the caches that may hold its communicators are emptied.
The first mesh built installs mpidtensor's process-wide effects
(:mod:`mpidtensor.runtime.effects`).
"""
from __future__ import annotations

import threading
from math import prod
from typing import Iterable, Sequence

import torch
from mpi4py import MPI

from ..runtime import caches, effects, watchdog
from . import grids
from .cuda import bind_local_gpu
from .launch import check_launch_once
from . import naming, pickling

DEVICE_TYPES = ("cpu", "cuda")
_BUILD = "DeviceMesh construction (every rank of the communicator must build the mesh, members or not)"
_SUB_TAG = 0x4D00  # MPI_Comm_create_group tags of communicators over several dims: this plus a bit per dim
_CURRENT: list["DeviceMesh"] = []  # the meshes entered with `with mesh:`, innermost last


def current_mesh() -> "DeviceMesh | None":
    """The innermost mesh of ``with mesh:`` blocks, or None."""
    return _CURRENT[-1] if _CURRENT else None


class _Count(int):
    """An int that may also be called, so that ``comm.size`` (mpi4py) and ``group.size()``
    (torch's ``ProcessGroup``) both read it."""

    def __call__(self) -> int:
        return int(self)


class ProcessGroup(MPI.Cartcomm):
    """A mesh communicator as ``DeviceMesh.get_group`` hands it out: the same MPI handle as a
    ``Cartcomm`` (every mpi4py call works on it), whose ``size`` and ``rank`` may also be
    called as torch code calls a ``ProcessGroup``'s (torchao's NF4 weight asks
    ``mesh.get_group().size()`` in its FSDP all-gather hook). It does not own the handle:
    the mesh frees it."""

    @property
    def size(self) -> _Count:
        return _Count(self.Get_size())

    @property
    def rank(self) -> _Count:
        return _Count(self.Get_rank())


class DeviceMesh:
    """An n-D arrangement of MPI ranks; mirrors ``torch.distributed.device_mesh.DeviceMesh``.

    ``mesh`` holds ranks of ``comm`` (``COMM_WORLD`` by default) in any layout; each
    must appear once. Collective over ``comm``: every rank of it must construct the
    mesh, including ranks that the mesh leaves out (they get ``get_coordinate() is None``).
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        comm: MPI.Intracomm | None = None,
    ) -> None:
        check_launch_once()  # N single-rank jobs instead of one N-rank job: stop here
        comm = MPI.COMM_WORLD if comm is None else comm
        ranks = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        _check_device_type(device_type)
        names = _check_names(mesh_dim_names, ranks.ndim)
        flat = ranks.flatten().tolist()
        if ranks.ndim == 0 or len(set(flat)) != len(flat) or not all(0 <= r < comm.size for r in flat):
            raise ValueError(
                f"mesh must list distinct ranks of a communicator of size {comm.size}, got {ranks.tolist()}"
            )
        member = comm.rank in flat
        # every rank of ``comm`` must build the mesh (torch's rule too): one that does not
        # leaves the others here, where the watchdog names the mesh construction
        ordered = watchdog.call(_BUILD, comm, comm.Split, 0 if member else MPI.UNDEFINED,
                                flat.index(comm.rank) if member else 0, details=ranks.tolist())
        cart = None
        if member:
            cart = watchdog.call("DeviceMesh: its Cartesian communicator (Create_cart)", ordered, ordered.Create_cart,
                                 list(ranks.shape), [False] * ranks.ndim, False)
            ordered.Free()
        self._setup(device_type, ranks, names, comm, cart)
        pickling.remember_root(self)
        if device_type == "cuda":
            bind_local_gpu(comm)

    @classmethod
    def _from_cart(cls, device_type, ranks, names, parent_comm, cart, grid=None, parent=None) -> "DeviceMesh":
        """A mesh over ``cart``; ``parent``: ``(mesh, dims)`` when it is that mesh's slice over
        ``dims`` (``cart`` is then the parent's communicator over them, borrowed)."""
        mesh = cls.__new__(cls)
        mesh._setup(device_type, ranks, names, parent_comm, cart, grid, parent)
        return mesh

    def _setup(self, device_type, ranks, names, parent_comm, cart, grid=None, parent=None) -> None:
        self.device_type = device_type
        self.mesh = ranks
        self.mesh_dim_names = names
        # every copy of this mesh among the ranks, alike on all ranks (mesh.grids)
        self._grid = grids.root_grid(ranks) if grid is None else grid
        self._copies: tuple | None = None  # _copies_key(), made on first use
        self._parent_comm = parent_comm
        # the mesh this one was sliced from (FSDP x TP) and its dims in that mesh: a slice's
        # communicators are the parent's (``comm_for``), which frees them
        self._parent, self._parent_dims = parent if parent is not None else (None, None)
        self._own_cart = cart  # a slice's: None until first asked for (``_cart``)
        if cart is not None:
            self._coord = tuple(cart.Get_coords(cart.rank))
        else:  # a slice's coordinates are its parent's in its dims (row-major rank order)
            self._coord = tuple(parent[0]._coord[d] for d in parent[1]) if parent is not None else None
        self._borrowed: set[tuple[int, ...]] = set()  # keys of ``_subcomms`` the parent owns
        self._flattened_from: DeviceMesh | None = None  # the mesh _flatten() made this one of
        self._unflattened_from: tuple | None = None  # (mesh, dim, sizes, names) of _unflatten()
        self._subcomms: dict[tuple[int, ...], MPI.Cartcomm] = {}
        self._creating: dict[tuple[int, ...], threading.Lock] = {}  # comm_for's lock per dims
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}  # get_group's views of _subcomms
        self._submeshes: dict[tuple, DeviceMesh] = {}  # slices, flattens, unflattens by their arguments
        self._flat_names: dict[str, tuple[tuple[int, ...], DeviceMesh]] = {}  # a root's _flatten names: dims, mesh
        self._key = (device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), names)
        self._hash = hash(self._key)
        self._freed = False
        self._synced_generators: set[int] = set()  # ids of generators ops.random made equal over it
        effects.first_mesh()  # hooks and patches the user opts into by building a mesh
        if self._coord is not None:
            for dim in range(ranks.ndim):
                self.comm_for((dim,))

    @property
    def _cart(self) -> MPI.Cartcomm | None:
        """The mesh's Cartesian communicator (None off the mesh or once freed); a slice's is
        its parent's over its dims, asked for here on first use (collective over the
        slice's ranks when several dims need a new one: ``comm_for``)."""
        cart = self._own_cart
        if cart is None and self._parent is not None and not self._freed:
            cart = self._own_cart = self._parent.comm_for(self._parent_dims)
        return cart

    # --- torch.distributed DeviceMesh API -------------------------------------------------
    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return self.mesh.numel() if mesh_dim is None else self.mesh.shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        """This process's rank in the communicator the mesh was built over."""
        return self._parent_comm.rank

    def get_coordinate(self) -> list[int] | None:
        return None if self._coord is None else list(self._coord)

    def _is_current_rank_part_of_mesh(self) -> bool:
        """Whether this rank is one of the mesh's (torch's name; its ``_utils`` call it)."""
        return self._coord is not None

    def _sym_get_coordinate(self, index: int) -> int:
        """This rank's coordinate on mesh dim ``index`` (torch's name); a member's only."""
        self._require_member()
        return self._coord[index]

    def __enter__(self) -> "DeviceMesh":
        """``with mesh:`` makes it the current mesh (:func:`current_mesh`), as torch's does:
        ``from_local`` and ``distribute_tensor`` given no mesh use it."""
        _CURRENT.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _CURRENT.pop()

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("get_local_rank() needs a mesh_dim on a mesh of more than one dimension")
            mesh_dim = 0
        self._require_member()
        return self._coord[self._dim_index(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> "ProcessGroup":
        """The MPI communicator of one mesh dimension (of the whole mesh if 1-D and no dim
        given), as a :class:`ProcessGroup`: mpi4py's ``Cartcomm`` that also answers torch's
        ``group.size()`` / ``group.rank()``."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("get_group() needs a mesh_dim on a mesh of more than one dimension")
            mesh_dim = 0
        return self._group((self._dim_index(mesh_dim),))

    def get_all_groups(self) -> list["ProcessGroup"]:
        return [self._group((d,)) for d in range(self.ndim)]

    def _group(self, dims: tuple[int, ...]) -> "ProcessGroup":
        group = self._groups.get(dims)
        if group is None:
            group = self._groups[dims] = ProcessGroup(self.comm_for(dims))
        return group

    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        """The sub-mesh over the named dimensions that contains this rank. A name given by
        ``_flatten`` is found from the root mesh and from every mesh sharing that root
        (torch's ``root["dp_shard_cp"]``), alone or beside dim names (``root["dp_replicate",
        "dp_shard_cp"]``, when the dims keep the root's order)."""
        self._require_live()
        names = (names,) if isinstance(names, str) else tuple(names)
        own = self.mesh_dim_names or ()
        if not all(n in own for n in names):
            return naming.flattened_slice(self, names)
        dims = tuple(self._dim_index(n) for n in names)
        if list(dims) != sorted(set(dims)):
            raise ValueError(f"slice mesh dims in the mesh's order without repeats, got {names}")
        if dims == tuple(range(self.ndim)):
            return self
        return self._submesh(dims, tuple(self.mesh_dim_names[d] for d in dims))

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: object = None) -> "DeviceMesh":
        """A 1-D mesh over all dims of this mesh, named ``mesh_dim_name`` (default: the dim
        names joined by "_"), as torch's: the name is then found from the root mesh
        (``root[name]``); the same dims flattened under two names are two meshes; a name
        already given to other dims, or a dim's name, is a ``ValueError`` (every rank: the
        names and dims are global). Collective over this mesh on first use."""
        return naming.flatten(self, mesh_dim_name)

    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: dict | Sequence | None = None) -> "DeviceMesh":
        """This mesh with dim ``dim`` split row-major into dims of ``mesh_sizes`` named
        ``mesh_dim_names`` (torch 2.13's ``DeviceMesh._unflatten``): a 1-D world mesh
        unflattened to ``(2, 2)`` is ``[[0, 1], [2, 3]]``. Its slices relate to those of any
        other unflatten, flatten or slice of the same ranks by the ranks each dim spans
        (``mesh.relations``), as torch's relate through their root. ``backend_override``
        (torch: a process-group backend per new dim, e.g. ``"fake"`` for a dim of size 1)
        is checked and ignored: MPI is the one backend. Collective over this mesh; every
        check depends only on the arguments and the mesh's shape, so bad input raises
        ``ValueError`` on every rank."""
        self._require_live()
        index = self._dim_index(dim)
        sizes, names = tuple(mesh_sizes), tuple(mesh_dim_names)
        if not sizes or not all(isinstance(n, int) and n > 0 for n in sizes) or prod(sizes) != self.shape[index]:
            raise ValueError(f"_unflatten: mesh_sizes {sizes} must be positive ints whose product is the size "
                             f"{self.shape[index]} of dim {dim!r}")
        if len(names) != len(sizes):
            raise ValueError(f"_unflatten: mesh_dim_names {names} must name each of the {len(sizes)} new dims")
        if self.mesh_dim_names is None and self.ndim > 1:
            raise ValueError("_unflatten of a mesh of more than one dimension needs its mesh_dim_names")
        _check_backend_override(backend_override, names)
        kept = self.mesh_dim_names or ("",)
        all_names = _check_names(kept[:index] + names + kept[index + 1:], self.ndim - 1 + len(sizes))
        key = ("unflatten", index, sizes, names)
        unflat = self._submeshes.get(key)
        if unflat is None or unflat._freed:  # made once per arguments, as slices are: one communicator
            shape = self.shape[:index] + sizes + self.shape[index + 1:]
            ranks = self.mesh.reshape(shape)
            cart = None
            if self._coord is not None:  # rank order is row-major in the coordinates, so a reshape keeps it
                cart = watchdog.call("DeviceMesh._unflatten: its communicator (Create_cart)", self._cart,
                                     self._cart.Create_cart, list(shape), [False] * len(shape), False)
            unflat = DeviceMesh._from_cart(self.device_type, ranks, all_names, self._parent_comm, cart,
                                           grids.unflatten_grid(self._grid, index, sizes))
            unflat._unflattened_from = (self, index, sizes, names)
            self._submeshes[key] = unflat
        return unflat

    # --- communicators ---------------------------------------------------------------------
    def comm_for(self, dims: Iterable[int]) -> MPI.Cartcomm:
        """The communicator over mesh dims ``dims`` (ascending) through this rank, rank order
        row-major in their coordinates. Collective over the mesh on first use; a slice's is
        its parent's over the same dims (made with the parent for a single dim)."""
        dims = tuple(dims)
        comm = self._subcomms.get(dims)
        if comm is not None:
            return comm
        self._require_member()
        if self._parent is not None:  # a slice: the parent's communicator over the same dims
            comm = self._subcomms[dims] = self._parent.comm_for(tuple(self._parent_dims[d] for d in dims))
            self._borrowed.add(dims)
            return comm
        # one creation per dims on this rank however many threads ask at once (setdefault is
        # atomic), so that each rank makes one collective call per dims: loading threads
        # slicing one sub-mesh together (different groups of dims made from several threads
        # at once, in another order on each rank, still hang in MPICH's Create_group)
        with self._creating.setdefault(dims, threading.Lock()):
            comm = self._subcomms.get(dims)
            if comm is None:
                if len(dims) == 1 or len(dims) == self.ndim:  # (with the mesh: every rank of it is here)
                    comm = watchdog.call("DeviceMesh: a communicator over some of its dims (Cart_sub)", self._cart,
                                         self._cart.Sub, [d in dims for d in range(self.ndim)])
                else:
                    comm = self._members_cart(dims)
                self._subcomms[dims] = comm
        return comm

    def _members_cart(self, dims: tuple[int, ...]) -> MPI.Cartcomm:
        """The Cartesian communicator over mesh dims ``dims`` through this rank, made
        collectively over its own ranks only (``MPI_Comm_create_group``; ``Cart_sub`` would
        need every rank of the mesh): a pipeline stage slices ``mesh["dp", "tp"]`` while
        the next stage waits for it. Rank order row-major in the dims' coordinates, as
        ``Cart_sub``'s."""
        cart = self._cart
        index = tuple(slice(None) if d in dims else self._coord[d] for d in range(self.ndim))
        ranks = torch.arange(cart.size).reshape(self.shape)[index]  # a Cartesian rank is its coordinates' row-major index
        whole = cart.Get_group()
        group = whole.Incl(ranks.flatten().tolist())
        whole.Free()
        tag = _SUB_TAG + sum(1 << d for d in dims)  # one per group of dims: concurrent creations do not match across
        members = watchdog.call("DeviceMesh: a communicator over some of its dims (Create_group)", cart,
                                cart.Create_group, group, tag)
        group.Free()
        sub = watchdog.call("DeviceMesh: a communicator over some of its dims (Create_cart)", members,
                            members.Create_cart, list(ranks.shape), [False] * ranks.ndim, False)
        members.Free()
        return sub

    @property
    def comm(self) -> MPI.Cartcomm:
        """The Cartesian communicator of the whole mesh."""
        self._require_member()
        return self._cart

    def free(self) -> None:
        """Free every communicator this mesh (and its sub-meshes) created. Collective.

        The mesh is unusable afterwards: redistributing, distributing or wrapping tensors
        on it, its communicators and its sub-meshes raise ``RuntimeError`` on every rank.
        Cached plans that may hold its communicators are dropped. A second call does nothing."""
        if self._freed:
            return
        self._release()
        caches.mesh_freed()

    def _release(self) -> None:
        for sub in self._submeshes.values():
            if not sub._freed:
                sub._release()
        for key, comm in self._subcomms.items():
            if key not in self._borrowed:
                comm.Free()
        self._subcomms.clear()
        self._groups.clear()
        self._submeshes.clear()
        cart = self._own_cart
        if cart is not None and cart != MPI.COMM_NULL and self._parent is None:  # (a slice's is lent)
            cart.Free()
        self._own_cart = None
        self._freed = True
        self._key = (*self._key, "freed", id(self))  # equal to no other mesh (the hash stays)

    # --- helpers ---------------------------------------------------------------------------
    def _copies_key(self) -> tuple:
        """``(device type, dim names, grid shape, grid ranks)``: the same on every rank for
        every copy of this mesh (``mesh.grids``), so a rank finds its own copy of a mesh
        another rank names (a DTensor crossing pipeline stages)."""
        if self._copies is None:  # made once: a pipeline stage compares it at every send
            self._copies = (self.device_type, self.mesh_dim_names, tuple(self._grid.shape),
                            tuple(self._grid.flatten().tolist()))
        return self._copies

    def _submesh(self, dims: tuple[int, ...], names, flatten: bool = False) -> "DeviceMesh":
        key = ("flatten", dims, names) if flatten else dims
        sub = self._submeshes.get(key)
        if sub is None or sub._freed:  # a sub-mesh freed on its own is made anew
            self._require_member()
            index = tuple(slice(None) if d in dims else self._coord[d] for d in range(self.ndim))
            ranks = self.mesh[index]
            if flatten:  # a mesh of its own (collective)
                ranks = ranks.flatten()
                comm = _flat_cart(watchdog.call("DeviceMesh._flatten: its dims' communicator (Cart_sub)", self._cart,
                                                self._cart.Sub, [d in dims for d in range(self.ndim)]))
                sub = DeviceMesh._from_cart(self.device_type, ranks, names, self._parent_comm, comm,
                                            grids.flat_grid(self._grid))
            else:  # a slice: this mesh's communicators, asked for when used (no collective here)
                sub = DeviceMesh._from_cart(self.device_type, ranks, names, self._parent_comm, None,
                                            grids.sub_grid(self._grid, dims), parent=(self, dims))
            made = self._submeshes.get(key)
            if made is not None and not made._freed:  # another thread sliced it meanwhile: one object
                return made
            self._submeshes[key] = sub
        return sub

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise naming.UnknownMeshDim(f"mesh has no dimension named {mesh_dim!r} (names: {self.mesh_dim_names})")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _require_live(self) -> None:
        """Raise on every rank if the mesh was freed (``free()`` marks it on all of them)."""
        if self._freed:
            raise RuntimeError(f"{self!r} was freed (DeviceMesh.free()); build a new mesh to use its ranks")

    def _require_member(self) -> None:
        self._require_live()
        if self._coord is None:
            raise ValueError(f"rank {self.get_rank()} is not part of this mesh {self.mesh.tolist()}")

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        """Pickled as its layout and its path from the root mesh, without MPI handles;
        unpickled as the live mesh (:mod:`mpidtensor.mesh.pickling`)."""
        return pickling.reduce_mesh(self)

    def __copy__(self) -> "DeviceMesh":  # a mesh owns communicators: a copy is the mesh itself
        return self

    def __deepcopy__(self, memo: dict) -> "DeviceMesh":
        return self

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    comm: MPI.Intracomm | None = None,
) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over the ranks of ``comm`` (``COMM_WORLD``), row-major.

    Collective. A shape of fewer ranks than the communicator's takes ranks ``0..n-1`` (as
    torch's does; the others get ``get_coordinate() is None``). Raises ``ValueError`` (on
    every rank) if the shape holds more ranks than the communicator or the names are not
    one distinct name per dimension.
    """
    check_launch_once()
    comm = MPI.COMM_WORLD if comm is None else comm
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or not all(isinstance(n, int) and n > 0 for n in mesh_shape):
        raise ValueError(f"mesh_shape must be positive ints, got {mesh_shape}")
    total = prod(mesh_shape)
    if total > comm.size:
        raise ValueError(
            f"mesh_shape {mesh_shape} holds {total} ranks but the communicator has {comm.size}"
        )
    _check_device_type(device_type)
    names = _check_names(mesh_dim_names, len(mesh_shape))
    if total < comm.size:  # as torch: ranks 0..total-1 in a mesh every rank builds, the others outside it
        return DeviceMesh(device_type, torch.arange(total).reshape(mesh_shape), mesh_dim_names=names, comm=comm)
    ranks = torch.arange(comm.size).reshape(mesh_shape)
    cart = watchdog.call(_BUILD, comm, comm.Create_cart, list(mesh_shape), [False] * len(mesh_shape), False,
                         details=ranks.tolist())
    mesh = DeviceMesh._from_cart(device_type, ranks, names, comm, cart)
    pickling.remember_root(mesh)
    if device_type == "cuda":
        bind_local_gpu(comm)
    return mesh


def _flat_cart(comm: MPI.Cartcomm) -> MPI.Cartcomm:
    """A 1-D Cartesian communicator with the same ranks in the same order."""
    flat = watchdog.call("a mesh's flat communicator (Create_cart)", comm, comm.Create_cart, [comm.size], [False], False)
    comm.Free()
    return flat


def _check_device_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")


def _check_backend_override(override: dict | Sequence | None, names: tuple[str, ...]) -> None:
    """torch's ``backend_override``: None, a dict keyed by new dim names (or indices), or
    one entry per new dim."""
    if override is None:
        return
    if isinstance(override, dict):
        unknown = [k for k in override if k not in names and not (isinstance(k, int) and 0 <= k < len(names))]
        if unknown:
            raise ValueError(f"_unflatten: backend_override names {unknown}, not among the new dims {names}")
    elif len(override) != len(names):
        raise ValueError(f"_unflatten: backend_override needs one entry per new dim {names}, got {override!r}")


def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} must name each of the {ndim} mesh dimensions")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be distinct, got {names}")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"mesh_dim_names must be strings, got {names}")
    return names
