"""Splitting a batch into micro-batches and merging the last stage's outputs.

Tensors are split along their chunk spec's dim (dim 0 by default) into equal parts: the
shapes between stages are fixed after the first step, so a batch that does not divide
evenly is refused. A DTensor is split as torch 2.13 splits it: each rank's local rows into
``n`` parts, each wrapped with the DTensor's mesh and placements (a global ``chunk`` of a
row-sharded batch would move the shard to another dim, which models that check their
inputs' placements, as torchtitan's under ``full_dtensor``, refuse). Arguments that are
not tensors (or whose spec is ``None``) go to every micro-batch whole. Any object with a
``split_dim`` attribute is a chunk spec, so torch's ``TensorChunkSpec`` works as well as
this one.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..tensor.dtensor import DTensor
from ..tensor.layout import global_strides
from ..tensor.placements import shard_dim


class TensorChunkSpec:
    """Split a tensor argument along ``split_dim`` (torch's name and meaning)."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(dims: tuple[int, ...]) -> tuple["TensorChunkSpec", ...]:
        return tuple(TensorChunkSpec(d) for d in dims)

    @staticmethod
    def from_dict(dims: dict[str, int]) -> dict[str, "TensorChunkSpec"]:
        return {k: TensorChunkSpec(d) for k, d in dims.items()}


def split_tensor(tensor: torch.Tensor, dim: int, n: int, what: str = "batch") -> list[torch.Tensor]:
    """``tensor`` in ``n`` equal parts along ``dim``; ``ValueError`` when it does not divide."""
    if isinstance(tensor, DTensor):
        return _split_dtensor(tensor, dim, n, what)
    size = tensor.size(dim)
    if size % n:
        raise ValueError(f"the {what} has {size} rows along dim {dim}, which do not split into "
                         f"{n} equal micro-batches")
    return list(torch.chunk(tensor, n, dim))


def _split_dtensor(tensor: DTensor, dim: int, n: int, what: str) -> list[DTensor]:
    """Each rank's local rows in ``n`` parts, rewrapped with ``tensor``'s mesh and placements.
    Decided from the global shape: the dim must split evenly over its shards and then
    into ``n``, so every rank's local part is alike."""
    dim = dim % tensor.dim()
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    shards = math.prod(mesh.size(i) for i, p in enumerate(placements) if shard_dim(p) == dim)
    size = tensor.size(dim)
    if size % (shards * n):
        raise ValueError(f"the {what} (a DTensor split {shards} ways along dim {dim}) has {size} rows along dim "
                         f"{dim}, which do not split into {n} equal micro-batches of every rank's rows")
    shape = list(tensor.shape)
    shape[dim] = size // n
    return [DTensor.from_local(part, mesh, placements, shape=shape, stride=global_strides(shape, part))
            for part in torch.chunk(tensor.to_local(), n, dim)]


def _split_value(value: Any, spec: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, torch.Tensor) and (spec is None or hasattr(spec, "split_dim")):
        dim = 0 if spec is None else spec.split_dim
        return split_tensor(value, dim, n, what)
    return [value] * n


def split_args_kwargs(args: tuple, kwargs: dict, n: int, args_spec: tuple | None = None,
                      kwargs_spec: dict | None = None) -> tuple[list[tuple], list[dict]]:
    """``n`` micro-batches of positional and keyword arguments."""
    if args_spec is not None and len(args_spec) != len(args):
        raise ValueError(f"args_chunk_spec has {len(args_spec)} entries for {len(args)} arguments")
    columns = [_split_value(a, args_spec[i] if args_spec else None, n, f"argument {i}") for i, a in enumerate(args)]
    kw_columns = {k: _split_value(v, (kwargs_spec or {}).get(k), n, f"argument {k!r}") for k, v in kwargs.items()}
    # by zip, not a comprehension per micro-batch (each a Python call)
    arg_mbs = list(zip(*columns)) if columns else [()] * n
    kwarg_mbs = [dict(zip(kw_columns, values)) for values in zip(*kw_columns.values())] if kw_columns \
        else [{} for _ in range(n)]
    return arg_mbs, kwarg_mbs


def merge_chunks(chunks: list[Any], spec: Any = None) -> Any:
    """The micro-batches' outputs as one batch: tensors concatenated along dim 0 (or the
    ``split_dim`` of the matching leaf of ``spec``), DTensors by their local tensors (the
    inverse of the split), other values from the first."""
    if spec is None and all([type(c) is torch.Tensor and c.dim() > 0 for c in chunks]):
        return torch.cat(chunks)  # one tensor per micro-batch (the common case): no pytree work
    leaves = [pytree.tree_flatten(c)[0] for c in chunks]
    _, treedef = pytree.tree_flatten(chunks[0])
    specs = pytree.tree_flatten(spec)[0] if spec is not None else [None] * len(leaves[0])
    merged = []
    for i, first in enumerate(leaves[0]):
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            dim = getattr(specs[i], "split_dim", 0) if i < len(specs) else 0
            merged.append(_cat([leaf[i] for leaf in leaves], dim))
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, treedef)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` concatenated along ``dim``; DTensors as :func:`_split_dtensor` split them,
    so a merged output's rows are in the batch's order."""
    if not isinstance(parts[0], DTensor):
        return torch.cat(parts, dim=dim)
    first = parts[0]
    dim = dim % first.dim()
    local = torch.cat([p.to_local() for p in parts], dim=dim)
    shape = list(first.shape)
    shape[dim] = sum(p.size(dim) for p in parts)
    return DTensor.from_local(local, first.device_mesh, first.placements, shape=shape,
                              stride=global_strides(shape, local))
