"""torch's flattening of a state dict and the ``Metadata`` that ``save`` returns.

``torch.distributed.checkpoint.save`` returns a
``torch.distributed.checkpoint.metadata.Metadata`` describing what it wrote, and so do
mpidtensor's storage writers, whatever their format: ``state_dict_metadata`` gives each
flat key (torch's flattening, :func:`torch_leaves`) a ``TensorStorageMetadata``
(properties, global size, the saved chunks as (offsets, sizes) boxes, each element in
exactly one chunk, in the order of the ranks that wrote them, as torch lists them) or
a ``BytesStorageMetadata`` for any other value; ``planner_data`` maps each flat key to
its path of keys (torch's ``DefaultSavePlanner``); ``storage_data`` is what the format
says about where each chunk went (see each writer). Every rank returns the same
content without an extra collective: the native and safetensors writers build it on
every rank from the facts all ranks share (which rank wrote each box, and so where),
the torch-format writer on rank 0 from what every rank wrote (its ``torch.save`` byte
ranges) and hands it on with the commit's broadcast. torch's metadata classes are
re-exported here, as ``torch.distributed.checkpoint.metadata`` has them.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from . import shards

__all__ = ["BytesStorageMetadata", "ChunkStorageMetadata", "Leaf", "Metadata", "MetadataIndex", "StorageMeta",
           "TensorProperties", "TensorStorageMetadata", "describe", "gc_paused", "torch_leaves"]

#: A saved box of a tensor, ``(start, shape)``, with what the format says about its storage.
SavedChunk = tuple[tuple[tuple[int, ...], tuple[int, ...]], Any]


class Leaf(NamedTuple):
    """One leaf of a state dict flattened torch's way."""

    keys: tuple  # the original keys and list indices from the root (to put values back)
    path: tuple  # torch's ``planner_data`` path: ``str`` dict keys, ``int`` list indices
    fqn: str  # the flat key: the path joined by dots
    value: Any


def torch_leaves(state_dict: dict) -> list[Leaf]:
    """The leaves of ``state_dict`` in order, flattened as torch DCP flattens it
    (``_traverse.traverse_state_dict``): dict keys become ``str(key)`` joined by dots; a
    list is descended into only when it holds a tensor, a dict or such a list; any other
    list, every tuple and every other object is one value; empty dicts vanish."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"a torch DCP state dict is a dict, got {type(state_dict).__name__}")
    leaves: list[Leaf] = []

    def visit(keys: tuple, path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(keys + (k,), path + (str(k),), v)
        elif isinstance(value, list) and not _is_terminal(value):
            for i, v in enumerate(value):
                visit(keys + (i,), path + (i,), v)
        else:
            leaves.append(Leaf(keys, path, ".".join(map(str, path)), value))

    for key, value in state_dict.items():
        visit((key,), (str(key),), value)
    flat = [leaf.fqn for leaf in leaves]
    if len(set(flat)) != len(flat):
        dup = sorted({k for k in flat if flat.count(k) > 1})
        raise ValueError(f"state dict has leaves with the same dotted name: {dup}")
    return leaves


def _is_terminal(values: list) -> bool:
    """A list is one value unless it holds a tensor, a dict or a list that is not one."""
    return not any(isinstance(v, (torch.Tensor, dict)) or (isinstance(v, list) and not _is_terminal(v))
                   for v in values)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as a ``with`` block or a decorator):
    a ``Metadata`` is tens of thousands of small acyclic objects, whose allocation
    otherwise sets off collections over the whole heap (a native save of 1000 tensors
    in 2 chunks at 2 ranks on 2 loaded cores: 484 ms to build it with them, generation-2
    ones included, 90 ms without)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _properties(value: torch.Tensor) -> TensorProperties:
    """torch's ``TensorProperties.create_from_tensor`` of a saved tensor (its local
    block's pinning: a DTensor wrapper has no storage to ask)."""
    return TensorProperties(dtype=value.dtype, layout=value.layout, requires_grad=value.requires_grad,
                            memory_format=torch.contiguous_format,
                            pin_memory=shards.local_tensor(value).is_pinned())


def describe(leaves: list[Leaf], chunks: dict[str, list[SavedChunk]], value_storage: dict[str, Any],
             storage_meta: StorageMeta, version: str | None = None) -> Metadata:
    """The ``Metadata`` of a save of ``leaves`` (torch's flattening of the state dict).

    ``chunks``: the saved boxes of each tensor leaf (distinct boxes of its layout), by
    flat key, in the order of the ranks that wrote them, each with its storage info;
    they must hold all its elements (``CheckpointError`` otherwise).
    ``value_storage``: the storage info of values that have one. ``storage_data`` maps
    ``MetadataIndex(fqn, chunk offsets, n)`` (``MetadataIndex(fqn)`` for a value) to them.
    """
    state_md: dict[str, Any] = {}
    planner_data: dict[str, tuple] = {}
    storage: dict[MetadataIndex, Any] = {}
    for _, path, fqn, value in leaves:
        planner_data[fqn] = path
        if not isinstance(value, torch.Tensor):
            state_md[fqn] = BytesStorageMetadata()
            if fqn in value_storage:
                storage[MetadataIndex(fqn)] = value_storage[fqn]
            continue
        saved = chunks.get(fqn, [])
        shards.check_covered(fqn, tuple(value.shape), [box for box, _ in saved])
        state_md[fqn] = TensorStorageMetadata(
            _properties(value), torch.Size(value.shape),
            [ChunkStorageMetadata(torch.Size(start), torch.Size(shape)) for (start, shape), _ in saved])
        for n, ((start, _), info) in enumerate(saved):
            storage[MetadataIndex(fqn, start, n)] = info
    return Metadata(state_md, planner_data=planner_data, storage_data=storage, storage_meta=storage_meta,
                    version=version)
