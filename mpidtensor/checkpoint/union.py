"""State dicts whose keys differ between ranks: one union that every rank saves.

The stages of a pipeline each hold their own part of a model (stage 0 the embedding and
the first blocks, ...), under the model's names, and save one checkpoint together, as
they do with torch's DCP. A save needs every rank to pass the same leaves in the same
order (:mod:`.shards`); :func:`complete` gives each rank the union of every rank's
leaves, in one order (rank 0's, then each further rank's new ones), in which a tensor
that this rank lacks is a meta tensor of its global shape and dtype (holding no part of
it: :func:`.shards.box` gives it no box, so its holders write it) and a value that
it lacks is the value of the lowest rank holding it. Costs one ``allgather`` of a hash
when every rank has the same keys (the common case), and one of the leaves' shapes and
values when they differ.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
from mpi4py import MPI

from . import tree
from ..runtime import watchdog

__all__ = ["complete"]


def complete(state_dict: Any, comm: MPI.Intracomm) -> Any:
    """``state_dict`` with the leaves the other ranks hold and this rank lacks (see the
    module docstring); ``state_dict`` itself when every rank holds the same leaves."""
    pairs = list(tree.flatten(state_dict))
    paths = [path for path, _ in pairs]
    digest = zlib.crc32(repr(paths).encode())
    digests = watchdog.call("checkpoint: every rank's state dict keys (allgather)", comm, comm.allgather, digest)
    if len(set(digests)) == 1:
        return state_dict
    described = watchdog.call("checkpoint: every rank's leaves (allgather)", comm, comm.allgather,
                               [(path, _describe(value)) for path, value in pairs])
    union: dict[tuple, Any] = {}
    for leaves in described:
        for path, description in leaves:
            union.setdefault(path, description)
    own = dict(pairs)
    return tree.unflatten([(path, own[path] if path in own else _placeholder(d)) for path, d in union.items()])


def _describe(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("value", value)


def _placeholder(description: tuple) -> Any:
    if description[0] == "tensor":
        return torch.empty(description[1], dtype=description[2], device="meta")
    return description[1]
