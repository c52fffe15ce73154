"""Placements: how a tensor is laid out along one mesh dimension.

They are pure descriptions; the communication that turns one placement into
another lives in :mod:`mpidtensor.tensor.redistribute`.
"""
from __future__ import annotations

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


class _PlacementType(type):
    """Makes ``Placement("shard", dim=0)`` build a ``Shard(0)``. A ``__new__`` on the base
    class could not do it: Python would then call ``Shard.__init__`` with the string too."""

    def __call__(cls, *args, **kwargs):
        if cls is Placement:
            return _spelled(*args, **kwargs)
        return type.__call__(cls, *args, **kwargs)


class Placement(metaclass=_PlacementType):
    """Base of ``Shard``, ``Replicate`` and ``Partial``.

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

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("S", self.dim))

    def __repr__(self) -> str:
        return f"S({self.dim})"


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
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
        self.reduce_op = reduce_op

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

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
            raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
        if isinstance(p, Shard):
            if not -tensor_ndim <= p.dim < tensor_ndim:
                raise ValueError(
                    f"Shard({p.dim}) is out of range for a {tensor_ndim}-D tensor "
                    f"(valid dims: {-tensor_ndim}..{tensor_ndim - 1})"
                )
            if p.dim < 0:
                p = Shard(p.dim + tensor_ndim)
        out.append(p)
    return tuple(out)
