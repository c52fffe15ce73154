"""Placements: how a tensor is laid out along one mesh dimension.

They are pure descriptions; the communication that turns one placement into
another lives in :mod:`mpidtensor.tensor.redistribute`.
"""
from __future__ import annotations

import torch

from ..mesh.foreign import foreign_message
from . import chunks

REDUCE_OPS = ("sum", "avg", "min", "max", "product")
_SPELLINGS = {"prod": "product"}  # other names of REDUCE_OPS (torch's tests write Partial("prod"))


class _PlacementType(type):
    """Makes ``Placement("shard", dim=0)`` build a ``Shard(0)``. A ``__new__`` on the base
    class could not do it: Python would then call ``Shard.__init__`` with the string too."""

    def __call__(cls, *args, **kwargs):
        if cls is Placement:
            return _spelled(*args, **kwargs)
        return type.__call__(cls, *args, **kwargs)


class Placement(metaclass=_PlacementType):
    """Base of ``Shard``, ``_StridedShard``, ``Replicate`` and ``Partial``.

    Called itself, it builds one of them from a name: ``Placement("shard", dim=0)``,
    ``Placement("replicate")``, ``Placement("partial", reduce_op="sum")``.
    """

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


class Shard(Placement):
    """The tensor is split along ``dim`` over the mesh dimension, as ``torch.chunk`` splits it."""

    __slots__ = ("dim",)

    def __init__(self, dim: int = 0) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard dim must be an int, got {dim!r}")
        self.dim = dim

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    # torch's helpers, by torch's names and signatures (frameworks and torch's tests call them)
    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """The size and offset of chunk ``rank`` of ``num_chunks`` of a dim of size
        ``curr_local_size``, as ``torch.chunk`` cuts it (torch >= 2.10's static method)."""
        return chunks.shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """torch's method of the same name: :meth:`local_shard_size_and_offset`."""
        return chunks.shard_size_and_offset(curr_local_size, num_chunks, rank)

    @staticmethod
    def _local_shard_size_on_dim(size_on_dim: int, num_chunks: int, rank: int,
                                 return_offset: bool = False) -> tuple[int, int]:
        """torch <= 2.7's name: ``(size, offset)``, the offset -1 unless ``return_offset``."""
        return chunks.shard_size_on_dim(size_on_dim, num_chunks, rank, return_offset)

    def _split_tensor(self, tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list, list[int]]:
        """torch's: ``tensor`` chunked on this dim into ``num_chunks`` (empty ones added),
        padded at the end to the first chunk's size when ``with_padding``; and the pads."""
        return chunks.split_tensor(tensor, self.dim, num_chunks, with_padding, contiguous)

    def _select_split_tensor(self, tensor, num_chunks: int, index: int, *, with_padding: bool = True,
                             contiguous: bool = True, clone: bool = True):
        """torch's: chunk ``index`` of :meth:`_split_tensor` (cloned unless ``clone=False``)."""
        piece = chunks.split_tensor(tensor, self.dim, num_chunks, with_padding, False)[0][index]
        return piece.clone() if clone else piece.contiguous() if contiguous else piece

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim: int, current_logical_shape) -> "torch.Tensor":
        """torch's: the whole tensor (of ``current_logical_shape``) from this rank's shard,
        gathered over ``mesh_dim`` (a collective of that dim's ranks)."""
        from ..compat.torch_utils import to_replicate_tensor  # above this module: the redistribute path
        return to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape)

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("S", self.dim))

    def __repr__(self) -> str:
        return f"S({self.dim})"


class _StridedShard(Placement):
    """torch's placement for a tensor dim sharded twice in the order opposite to the mesh's
    (FSDP over a dim tensor parallelism already sharded; packed TP weights): the block
    is split into ``split_factor`` pieces as ``torch.chunk`` splits it, each piece is
    chunked over the mesh dim, and rank ``r`` holds the ``r``-th chunk of every piece,
    concatenated. ``(_StridedShard(0, split_factor=tp), Shard(0))`` on a (dp, tp) mesh is
    the layout FSDP gives a weight that TP sharded on dim 0 first.

    As in torch it is not a ``Shard`` (``is_shard()`` is False, and it never equals one);
    ``split_factor=1`` lays data out as ``Shard`` does."""

    __slots__ = ("dim", "split_factor")

    def __init__(self, dim: int, *, split_factor: int = 1, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard received both split_factor and sf")
            split_factor = sf
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"_StridedShard dim must be an int, got {dim!r}")
        if not isinstance(split_factor, int) or isinstance(split_factor, bool) or split_factor < 1:
            raise ValueError(f"_StridedShard split_factor must be a positive int, got {split_factor!r}")
        self.dim = dim
        self.split_factor = split_factor

    def _split_tensor(self, tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list, list[int]]:
        """torch's: ``num_chunks`` shards of ``tensor`` as this placement lays them out (shard
        ``r`` is the ``r``-th chunk of each of the ``split_factor`` pieces, concatenated) and,
        when ``with_padding``, each shard's shortfall from the largest (not padded, as torch's)."""
        pieces = chunks.split_tensor(tensor, self.dim, self.split_factor, False, False)[0]
        split = [chunks.split_tensor(p, self.dim, num_chunks, False, False)[0] for p in pieces]
        shards = [torch.cat([s[i] for s in split], self.dim) for i in range(num_chunks)]
        shards = [s.contiguous() for s in shards] if contiguous else shards
        longest = max(s.size(self.dim) for s in shards)
        return shards, [longest - s.size(self.dim) for s in shards] if with_padding else []

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim: int, current_logical_shape) -> "torch.Tensor":
        """torch's: as :meth:`Shard._to_replicate_tensor`, undoing the strided layout."""
        from ..compat.torch_utils import to_replicate_tensor  # above this module: the redistribute path
        return to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape)

    def __eq__(self, other: object) -> bool:
        return type(other) is _StridedShard and other.dim == self.dim and other.split_factor == self.split_factor

    def __hash__(self) -> int:
        return hash((self.dim, self.split_factor))

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


def shard_dim(p: Placement) -> int | None:
    """The tensor dim a ``Shard`` or ``_StridedShard`` splits; None for other placements."""
    return p.dim if type(p) is Shard or type(p) is _StridedShard else None


class Replicate(Placement):
    """Every rank of the mesh dimension holds the whole tensor."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return hash("R")

    def __repr__(self) -> str:
        return "R"


class Partial(Placement):
    """Every rank holds a partial value; the tensor is their reduction by ``reduce_op``."""

    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum") -> None:
        reduce_op = _SPELLINGS.get(reduce_op, reduce_op) if isinstance(reduce_op, str) else reduce_op
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
        self.reduce_op = reduce_op

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or _SPELLINGS.get(reduce_op, reduce_op) == self.reduce_op

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash(("P", self.reduce_op))

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


def _spelled(kind: str, *args, **kwargs) -> Placement:
    """``Placement(kind, ...)``: the placement class named ``kind``, built from the rest."""
    cls = _BY_NAME.get(kind.lower()) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"Placement kind must be one of {sorted(_BY_NAME)}, got {kind!r}")
    return cls(*args, **kwargs)


_BY_NAME = {"shard": Shard, "replicate": Replicate, "partial": Partial}


def normalize_placements(placements, mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    """Check ``placements`` against a mesh and a tensor rank; make shard dims non-negative."""
    if isinstance(placements, Placement):
        raise TypeError("placements must be a sequence of Placement, one per mesh dimension")
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {list(placements)} for a {mesh_ndim}-D mesh; "
            f"give one placement per mesh dimension"
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(foreign_message(p, "placements", "placement") if type(p).__module__.startswith("torch")
                            else f"placements must be Shard, _StridedShard, Replicate or Partial, got {p!r}")
        if isinstance(p, (Shard, _StridedShard)):
            if not -tensor_ndim <= p.dim < tensor_ndim:
                named = f"Shard({p.dim})" if isinstance(p, Shard) else repr(p)
                raise ValueError(
                    f"{named} is out of range for a {tensor_ndim}-D tensor "
                    f"(valid dims: {-tensor_ndim}..{tensor_ndim - 1})"
                )
            if p.dim < 0:
                p = Shard(p.dim + tensor_ndim) if isinstance(p, Shard) else _StridedShard(
                    p.dim + tensor_ndim, split_factor=p.split_factor)
        out.append(p)
    return tuple(out)
