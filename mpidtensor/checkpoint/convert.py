"""Conversion between checkpoints and ``torch.save`` files, in one process, as
``torch.distributed.checkpoint.format_utils`` does (that module path, with its command
line, is :mod:`.format_utils`).

``dcp_to_torch_save`` reads a native checkpoint (every block's CRC-32 checked) or a
torch DCP directory (``.metadata`` plus ``.distcp`` files); ``torch_save_to_dcp``
writes the native format. A tensor subclass saved as one chunk or block comes back as
itself; one saved in several cannot be assembled (``CheckpointError``). Each holds the
whole state in memory: run it on one rank.
``to_torch_save`` / ``from_torch_save`` are the older names of the two functions.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from mpi4py import MPI

from .api import no_checkpoint, reader_class
from .native import NativeReader
from .plain import load_plain, save_plain
from .torch_format import load_chunk


def _read_whole(directory: str) -> Any:
    """The whole state of the checkpoint ``directory`` as plain tensors and values."""
    reader = reader_class(directory)
    if reader is None:
        raise no_checkpoint(directory)
    return load_plain(directory) if reader is NativeReader else _read_torch_dcp(directory, reader)


def _read_torch_dcp(directory: str, reader: type) -> dict:
    """A torch DCP checkpoint whole: a tensor saved as one chunk is that chunk as
    ``torch.load`` gives it (a tensor subclass included); the others are targets made
    from the metadata (read with torch's own reader), filled flat by ``reader`` in this
    process; nested by the saved paths."""
    from torch.distributed.checkpoint import FileSystemReader as TorchReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = TorchReader(directory).read_metadata()
    whole = {fqn: load_chunk(directory, metadata, fqn, 0, meta.properties.dtype)
             for fqn, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata) and len(meta.chunks) == 1}
    flat = {fqn: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata) else None
            for fqn, meta in metadata.state_dict_metadata.items() if fqn not in whole}
    reader(directory).read(flat, MPI.COMM_SELF)
    flat = {fqn: whole[fqn] if fqn in whole else flat[fqn] for fqn in metadata.state_dict_metadata}
    nested: dict = {}
    for fqn, value in flat.items():
        _set_element(nested, tuple((metadata.planner_data or {}).get(fqn, (fqn,))), value)
    return nested


def _set_element(root: dict, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` (str: a dict key, int: a list index) under ``root``,
    making the dicts and lists on the way."""
    node = root
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        child = value if last else ([] if isinstance(path[depth + 1], int) else {})
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if last or node[key] is None:
                node[key] = child
        elif last or key not in node:
            node[key] = child
        node = node[key]


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike) -> None:
    """Write the checkpoint's whole state (plain tensors, nested as saved) with ``torch.save``."""
    torch.save(_read_whole(os.fspath(dcp_checkpoint_dir)), torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Make a native checkpoint of the state a ``torch.save`` file holds (plain tensors and
    values; loaded with ``weights_only=True``, so no arbitrary objects are unpickled)."""
    save_plain(torch.load(torch_save_path, map_location="cpu", weights_only=True), dcp_checkpoint_dir)


to_torch_save = dcp_to_torch_save
from_torch_save = torch_save_to_dcp
