"""``DTensorSpec``: everything that describes a DTensor except its local data."""
from __future__ import annotations

from typing import Sequence

import torch

from .layout import local_shape_and_offset
from ..mesh import DeviceMesh
from ..mesh.foreign import require_mesh
from .placements import Placement, normalize_placements
from ..runtime import caches


class DTensorSpec:
    """Mesh, placements and global shape/stride/dtype of a DTensor.

    Specs are interned: constructing one equal to an existing spec returns that
    object, so equality is identity and hashing is by address. Both run in C,
    which matters because specs are the keys of the dispatch caches.
    """

    __slots__ = ("mesh", "placements", "shape", "stride", "dtype")
    _interned: dict[tuple, "DTensorSpec"] = {}

    def __new__(
        cls,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        stride: Sequence[int],
        dtype: torch.dtype,
    ) -> "DTensorSpec":
        placements, shape, stride = tuple(placements), tuple(shape), tuple(stride)
        key = (id(mesh), placements, shape, stride, dtype)  # the spec keeps its mesh alive
        spec = cls._interned.get(key)
        if spec is None:
            spec = object.__new__(cls)
            spec.mesh = mesh
            spec.placements = placements
            spec.shape = torch.Size(shape)
            spec.stride = stride
            spec.dtype = dtype
            cls._interned[key] = spec
        return spec

    # Specs are immutable and interned, so a copy is the spec itself; pickling rebuilds it
    # through the constructor (interning again). Dynamo deep-copies a DTensor's spec to
    # guard on it and compares the copy with ``==``, which must stay identity.
    def __copy__(self) -> "DTensorSpec":
        return self

    def __deepcopy__(self, memo: dict) -> "DTensorSpec":
        return self

    def __reduce__(self):
        return DTensorSpec, (self.mesh, self.placements, tuple(self.shape), self.stride, self.dtype)

    def __repr__(self) -> str:
        return f"Spec({list(self.placements)}, shape={tuple(self.shape)}, {self.dtype})"

    def with_placements(self, placements: Sequence[Placement]) -> "DTensorSpec":
        return DTensorSpec(self.mesh, placements, self.shape, self.stride, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # torch's DTensorSpec attributes that frameworks and torch's tests read
    @property
    def tensor_meta(self):
        """torch's ``TensorMeta(shape, stride, dtype)`` of the global tensor (torch's class, so
        ``isinstance`` checks against torch's ``_dtensor_spec.TensorMeta`` hold)."""
        from torch.distributed.tensor._dtensor_spec import TensorMeta  # torch's DTensor package: on first use only
        return TensorMeta(self.shape, self.stride, self.dtype)

    @property
    def dim_map(self) -> list[int]:
        """torch's: per tensor dim, the mesh dim that shards it, -1 where none does (a dim
        sharded by two mesh dims raises ``ValueError``, as torch's)."""
        out = [-1] * self.ndim
        for i, p in enumerate(self.placements):
            d = getattr(p, "dim", None)
            if d is None:
                continue
            if out[d] > -1:
                raise ValueError(f"Tensor dim {d} is already sharded on mesh dim {out[d]}, DTensor operator "
                                 "implementation does not support things like hybrid sharding strategies yet "
                                 "(i.e. [Shard(0), Shard(0)])")
            out[d] = i
        return out

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's local shape and its offset in the global tensor."""
        return local_shape_and_offset(self.shape, self.placements, self.mesh.shape, self.mesh._coord)


def from_torch_spec(spec) -> DTensorSpec:
    """mpidtensor's spec for torch's ``DTensorSpec(mesh, placements, tensor_meta=TensorMeta(
    shape, stride, dtype))`` built over mpidtensor's mesh and placements (torch's tests and
    frameworks construct ``DTensor(local, spec, requires_grad=...)`` with one)."""
    meta = getattr(spec, "tensor_meta", None)
    if meta is None:
        raise ValueError(f"DTensor(local, spec): the spec needs its tensor_meta (shape, stride, dtype), got {spec!r:.200}")
    mesh = require_mesh(spec.mesh, "DTensor(local, spec)")
    shape = tuple(meta.shape)
    return DTensorSpec(mesh, normalize_placements(spec.placements, mesh.ndim, len(shape)), shape,
                       tuple(meta.stride), meta.dtype)


def _forget_freed_meshes() -> None:
    """Drop the interned specs of freed meshes (which no new tensor may use), so that the
    meshes can be collected; the specs of live meshes stay interned (their identity is
    their equality)."""
    interned = DTensorSpec._interned
    for key in [key for key, spec in interned.items() if spec.mesh._freed]:
        del interned[key]


caches.on_clear("spec.interned_on_freed_meshes", _forget_freed_meshes)
