"""The argument checks of the MPI-backed ``ProcessGroup`` (``process_group``): each a
``RuntimeError`` as torch's gloo raises it for the same input, decided from what this
rank holds, before any data moves. Every rank of an SPMD program passes tensors of the
same shapes, so every rank raises; ranks that disagree with each other are what the
debug guard (``MPIDTENSOR_DEBUG=1``) and the splits' agreement catch.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

__all__ = ["bitwise_op", "coalesced_outputs", "devices", "flat", "root", "same_as_input", "same_dtype", "splits",
           "type_name"]

_BITWISE = ((dist.ReduceOp.BAND, "BAND", MPI.BAND, MPI.LAND), (dist.ReduceOp.BOR, "BOR", MPI.BOR, MPI.LOR),
            (dist.ReduceOp.BXOR, "BXOR", MPI.BXOR, MPI.LXOR))
_TYPE_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
               torch.uint8: "Byte", torch.bool: "Bool"}


def devices(call: str, args: tuple) -> None:
    """The tensors among ``args`` (and in their lists) are on a device the group serves:
    the host or CUDA (staged through the host when MPI is not CUDA-aware). A meta tensor
    is torch's ``NotImplementedError`` (it holds no data), as under gloo."""
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            for u in t if isinstance(t, (list, tuple)) else (t,):
                if isinstance(u, torch.Tensor) and not (u.is_cpu or u.is_cuda):
                    if u.is_meta:
                        raise NotImplementedError(f"ProcessGroupMPI::{call}: Cannot copy out of meta tensor; no data!")
                    raise RuntimeError(f"ProcessGroupMPI::{call}: unsupported device type {u.device.type}")


def type_name(dtype: torch.dtype) -> str:
    """torch's C++ name of ``dtype`` (in its error messages)."""
    return _TYPE_NAMES.get(dtype, str(dtype))


def bitwise_op(reduce_op: Any, dtype: torch.dtype) -> MPI.Op | None:
    """The MPI op of a bitwise ``ReduceOp`` on an integer or bool ``dtype`` (``None`` for
    the arithmetic ops); on any other dtype gloo's ``RuntimeError``."""
    for kind, name, integral, logical in _BITWISE:
        if reduce_op == kind:
            if dtype.is_floating_point or dtype.is_complex:
                raise RuntimeError(f"Cannot use ReduceOp.{name} with non-integral dtype")
            return logical if dtype == torch.bool else integral
    return None


def root(call: str, rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise RuntimeError(f"ProcessGroupMPI::{call}: invalid root rank: {rank}")


def same_as_input(call: str, tensors: list[torch.Tensor], like: torch.Tensor, size: int) -> None:
    """A list of one tensor per rank, each of ``like``'s shape and dtype (all_gather's
    outputs, reduce_scatter's inputs)."""
    if len(tensors) != size:
        raise RuntimeError(f"ProcessGroupMPI::{call}: invalid tensor list (expected length {size}, "
                           f"got {len(tensors)})")
    for k, t in enumerate(tensors):
        if t.dtype != like.dtype:
            raise RuntimeError(f"ProcessGroupMPI::{call}: invalid tensor type at index {k} (expected {like.dtype}, "
                               f"got {t.dtype})")
        if t.shape != like.shape:
            raise RuntimeError(f"ProcessGroupMPI::{call}: invalid tensor size at index {k} (expected "
                               f"{tuple(like.shape)}, got {tuple(t.shape)})")


def coalesced_outputs(outputs: list[torch.Tensor], inputs: list[torch.Tensor], size: int, lists: int) -> None:
    """all_gather_coalesced: one list per rank, each holding a tensor like each input."""
    if lists != size:
        raise RuntimeError(f"ProcessGroupMPI::allgather_coalesced: invalid output tensor list (expected {size} "
                           f"lists, got {lists})")
    if len(outputs) != len(inputs):
        raise RuntimeError(f"ProcessGroupMPI::allgather_coalesced: invalid output list size (expected "
                           f"{len(inputs)}, got {len(outputs)})")
    for k, (out, t) in enumerate(zip(outputs, inputs)):
        if out.shape != t.shape or out.dtype != t.dtype:
            raise RuntimeError(f"ProcessGroupMPI::allgather_coalesced: invalid size of output tensor at index {k} "
                               f"(expected {tuple(t.shape)} {t.dtype}, got {tuple(out.shape)} {out.dtype})")


def flat(call: str, whole: torch.Tensor, piece: torch.Tensor, size: int, *, gathered: bool) -> None:
    """all_gather_into_tensor / reduce_scatter_tensor: the whole tensor holds ``size``
    pieces (flat, or stacked on a new dim 0 as NCCL also takes), one dtype."""
    if whole.dtype != piece.dtype:
        raise RuntimeError(f"ProcessGroupMPI::{call}: invalid tensor type (expected {piece.dtype}, got "
                           f"{whole.dtype})")
    if whole.numel() != size * piece.numel():
        what = ("output", "input") if gathered else ("input", "output")
        raise RuntimeError(f"ProcessGroupMPI::{call}: the {what[0]} of {whole.numel()} elements is not "
                           f"{size} x the {what[1]}'s {piece.numel()}")


def splits(sizes: Sequence[int] | None, rows: int | None, size: int) -> list[int]:
    """all_to_all_single's split sizes of a tensor of ``rows`` rows (None: 0-d), even rows
    when none are given; torch's ``RuntimeError`` where they do not fit."""
    if not sizes:
        if rows is None or rows % size:
            raise RuntimeError(f"Tensor's dim 0 does not divide equally across group size {size}")
        return [rows // size] * size
    if len(sizes) != size or sum(sizes) != rows:
        raise RuntimeError("Split sizes doesn't match total dim 0 size")
    return list(sizes)


def same_dtype(call: str, tensors: list[torch.Tensor], size: int, inputs: int, outputs: int) -> None:
    """all_to_all's lists: one tensor per rank each, of one dtype."""
    if inputs != size or outputs != size:
        raise RuntimeError(f"ProcessGroupMPI::{call}: invalid tensor lists (expected length {size}, got "
                           f"{inputs} inputs and {outputs} outputs)")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise RuntimeError(f"ProcessGroupMPI::{call}: tensors of different dtypes {sorted(map(str, dtypes))}")
