"""What each rank holds of a state dict's tensors and which boxes it writes, agreed by
one ``allgather``: the first step of every save and load (:mod:`.transaction`); and the
dtypes a checkpoint holds, by name."""
from __future__ import annotations

from math import prod
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..tensor.dtensor import DTensor
from ..tensor.placements import Replicate
from . import opaque
from ..runtime.agreement import raise_listed
from ..runtime import watchdog
from .errors import CheckpointError

__all__ = ["DTYPES", "DTYPE_NAMES", "TensorMeta", "box", "box_writers", "boxes_to_write", "check_covered",
           "check_same_leaves", "dtype_name", "gather_metas", "leaf_meta", "local_bytes", "local_tensor", "reduced",
           "unloadable"]

DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: ``(global shape, dtype name, this rank's box (None: holds no part), class of its local block when it is
#: stored opaquely (:mod:`.opaque`) else None)`` of a tensor leaf; None for a value.
TensorMeta = tuple[tuple[int, ...], str, tuple[tuple[int, ...], tuple[int, ...]], "str | None"]


def dtype_name(dtype: torch.dtype) -> str:
    """The name a checkpoint gives ``dtype``; ``TypeError`` for one it cannot hold."""
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} cannot be checkpointed")
    return DTYPE_NAMES[dtype]


def box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(start, shape) of the part of ``t``'s global tensor that this rank holds; None for a
    meta tensor, which holds none (a leaf that other ranks hold: :mod:`.union`)."""
    if t.is_meta and not isinstance(t, DTensor):
        return None
    if isinstance(t, DTensor):
        shape, start = t._spec.local_shape_and_offset()
        return tuple(start), tuple(shape)
    return (0,) * t.ndim, tuple(t.shape)


def local_bytes(t: torch.Tensor) -> np.ndarray:
    """This rank's block of ``t`` as contiguous CPU bytes (no copy when it already is)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    local = local.detach().cpu().contiguous()
    return local.reshape(-1).view(torch.uint8).numpy()


def _same(meta: TensorMeta | None) -> tuple | None:
    """What every rank's meta of a leaf must agree on: all but the box."""
    return meta and (meta[0], meta[1], meta[3])


def check_same_leaves(gathered: list[list[tuple]]) -> None:
    """All ranks must pass state dicts with the same keys, global shapes, dtypes and
    local block classes (plain or the same opaque subclass)."""
    first = [(key, _same(meta)) for key, meta in gathered[0]]
    raise_listed([f"{key!r} has dtype {meta[1]}, which cannot be checkpointed"
                  for key, meta in gathered[0] if meta is not None and meta[1] not in DTYPES], TypeError)
    for rank, metas in enumerate(gathered[1:], 1):
        if [(key, _same(meta)) for key, meta in metas] != first:
            raise ValueError(f"the state dict on rank {rank} differs from rank 0's in keys, shapes, dtypes "
                             "or tensor subclasses")
    keys = [key for key, _ in gathered[0]]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"state dict has leaves with the same dotted name: {dup}")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's block of ``t`` (detached)."""
    return (t._local_tensor if isinstance(t, DTensor) else t).detach()


def leaf_meta(key: str, leaf: Any) -> tuple[str, TensorMeta | None]:
    """``(key, meta)`` of one leaf, as :func:`gather_metas` exchanges it."""
    if not isinstance(leaf, torch.Tensor):
        return key, None
    return key, (tuple(leaf.shape), DTYPE_NAMES.get(leaf.dtype, str(leaf.dtype)), box(leaf),
                 opaque.class_name(leaf))


def gather_metas(metas: list[tuple[str, TensorMeta | None]], comm: MPI.Intracomm) -> list[list[tuple]]:
    """Every rank's ``metas`` of the state dict to write (one ``allgather``), checked:
    every rank passed the same keys, shapes, dtypes (checkpointable ones) and classes."""
    all_metas = watchdog.call("checkpoint: every rank's leaf metadata (allgather)", comm, comm.allgather, metas)
    check_same_leaves(all_metas)
    return all_metas


def box_writers(all_metas: list[list[tuple]]) -> list[dict[tuple, int]]:
    """Per leaf, each distinct non-empty box and the rank that writes it ({} for a
    value): of the ranks holding the box, the one with the fewest bytes assigned so far
    (then the lowest), so that each box is written once and replicas spread over the
    ranks. Every rank computes the same from the gathered metadata."""
    assigned, writers = [0] * len(all_metas), []
    for i, (_, meta) in enumerate(all_metas[0]):
        writers.append({})
        if meta is None:
            continue
        holders: dict[tuple, list[int]] = {}
        for r, metas in enumerate(all_metas):
            if metas[i][1][2] is not None:
                holders.setdefault(metas[i][1][2], []).append(r)
        itemsize = DTYPES[meta[1]].itemsize
        for box_, ranks in holders.items():
            nbytes = prod(box_[1]) * itemsize
            if nbytes:
                writer = min(ranks, key=lambda r: (assigned[r], r))
                assigned[writer] += nbytes
                writers[i][box_] = writer
    return writers


def boxes_to_write(writers: list[dict[tuple, int]], rank: int) -> set[int]:
    """The tensor leaves whose box ``rank`` writes (``writers``: :func:`box_writers`)."""
    return {i for i, leaf_writers in enumerate(writers) if rank in leaf_writers.values()}


def check_covered(key: str, shape: tuple[int, ...], boxes: list[tuple]) -> None:
    """The saved boxes (distinct boxes of a layout) of the tensor ``key`` must hold all
    its elements: ``CheckpointError`` otherwise."""
    covered, numel = sum(prod(box_shape) for _, box_shape in boxes), prod(shape)
    if covered != numel:
        raise CheckpointError(f"the saved chunks of {key!r} cover {covered} of {numel} elements")


def reduced(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its ``Partial`` placements reduced (collective over its mesh)."""
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
    return t


def unloadable(key: str, t: Any) -> str | None:
    """Why ``t`` cannot be a load target: a DTensor holding ``Partial`` values."""
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        return f"cannot load into {key!r}: its placements {t.placements} hold Partial values"
    return None

