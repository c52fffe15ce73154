"""``DTensorSpec``: everything that describes a DTensor except its local data."""
from __future__ import annotations

from typing import Sequence

import torch

from ._layout import local_shape_and_offset
from .mesh import DeviceMesh
from .placements import Partial, Placement, Replicate, Shard


class DTensorSpec:
    """Mesh, placements and global shape/stride/dtype of a DTensor. Immutable and
    hashable (the hash is computed once: specs are keys of the dispatch caches)."""

    __slots__ = ("mesh", "placements", "shape", "stride", "dtype", "_hash")

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        stride: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        self.mesh = mesh
        self.placements = tuple(placements)
        self.shape = torch.Size(shape)
        self.stride = tuple(stride)
        self.dtype = dtype
        self._hash = hash((mesh, self.placements, self.shape, self.stride, dtype))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, DTensorSpec)
            and self._hash == other._hash
            and self.placements == other.placements
            and self.shape == other.shape
            and self.stride == other.stride
            and self.dtype == other.dtype
            and self.mesh == other.mesh
        )

    def __repr__(self) -> str:
        return f"Spec({list(self.placements)}, shape={tuple(self.shape)}, {self.dtype})"

    def with_placements(self, placements: Sequence[Placement]) -> "DTensorSpec":
        return DTensorSpec(self.mesh, placements, self.shape, self.stride, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's local shape and its offset in the global tensor."""
        return local_shape_and_offset(self.shape, self.placements, self.mesh.shape, self.mesh._coord)

    def sharders(self, tensor_dim: int) -> list[int]:
        """Mesh dims that shard ``tensor_dim``, outer first."""
        return [m for m, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == tensor_dim]

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)
