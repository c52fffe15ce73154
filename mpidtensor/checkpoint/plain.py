"""Checkpoints read or written whole by one process, without communicating.

``load_plain`` reads a native checkpoint (both format versions, every block's CRC-32
checked). ``dcp_to_torch_save(dir, file)`` reads a native or a torch DCP checkpoint
(``.metadata`` plus ``.distcp`` files, through its reader over ``COMM_SELF``) and writes
it with ``torch.save``; ``torch_save_to_dcp(file, dir)`` saves the state a ``torch.save``
file holds (a dict, as torch's requires) in the native format, through the native
writer over ``COMM_SELF`` (torch's module path of both, with a command line, is
:mod:`.format_utils`). A tensor subclass stored opaquely (:mod:`.opaque`) is read back
as itself when it is one block or chunk; several of one cannot be assembled
(``CheckpointError``). Each holds the whole state in memory: run it on one rank.
``to_torch_save`` / ``from_torch_save`` are the older names of the two conversions.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from mpi4py import MPI

from . import io, shards, tree
from .api import no_checkpoint, reader_class
from .errors import CheckpointError
from .formats import native
from .formats.dcp import load_chunk


def read_tensor(reader: io.Reader, index: dict, meta: dict) -> torch.Tensor:
    """The whole saved tensor of ``meta`` (an index entry's ``tensor``), row-major."""
    dtype, shape = shards.DTYPES[meta["dtype"]], tuple(meta["shape"])
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        raw = out.reshape(-1).view(torch.uint8).numpy()
        io.read_box(reader, native.chunks(index, meta), ((0,) * len(shape), shape), raw, dtype)
    return out


def check_blocks(key: str, tensor: torch.Tensor, meta: dict) -> None:
    """Compare each saved block's CRC-32 with ``tensor`` (the whole global tensor)."""
    for block in meta["blocks"]:
        box = tensor[io.relative((block["start"], block["shape"]), ((0,) * tensor.ndim, tensor.shape))]
        if native.crc32(box.contiguous().reshape(-1).view(torch.uint8).numpy()) != block["crc32"]:
            raise CheckpointError(f"checksum mismatch in tensor {key!r} (block at {block['start']})")


def load_plain(checkpoint_id: str | os.PathLike, verify: bool = True) -> Any:
    """The whole checkpoint as plain tensors and values in its nested structure; one
    process, no MPI. ``verify`` checks every block's CRC-32."""
    directory = os.fspath(checkpoint_id)
    index = native.read_index(directory)
    reader = io.Reader(directory)
    leaves = []
    try:
        for entry in index["entries"]:
            if entry.get("tensor", {}).get("encoding") == native.TORCH_SAVE:
                value = _read_opaque(reader, index, entry, verify)
            elif "tensor" in entry:
                value = read_tensor(reader, index, entry["tensor"])
                if verify:
                    check_blocks(entry["key"], value, entry["tensor"])
            else:
                value = native.decode_value(entry)
            leaves.append((native.decode_path(entry["path"]), value))
    finally:
        reader.close()
    return tree.unflatten(leaves)


def _read_opaque(reader: io.Reader, index: dict, entry: dict, verify: bool) -> torch.Tensor:
    """The tensor subclass of ``entry``, which must be stored as one block."""
    key, meta = entry["key"], entry["tensor"]
    if len(meta["blocks"]) != 1:
        raise CheckpointError(
            f"{key!r} is a {meta['class']} saved as {len(meta['blocks'])} opaque torch.save blocks, which cannot "
            "be assembled in one process: load it with mpidtensor.checkpoint.load into the layout it was saved from")
    return native.read_block(reader, index, meta["blocks"][0], key, verify)


# --- conversion to and from torch.save files ---------------------------------------------------------
def read_whole(directory: str) -> Any:
    """The whole state of the checkpoint ``directory`` as plain tensors and values."""
    reader = reader_class(directory)
    if reader is None:
        raise no_checkpoint(directory)
    return load_plain(directory) if reader is native.NativeReader else _read_torch_dcp(directory, reader)


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
    torch.save(read_whole(os.fspath(dcp_checkpoint_dir)), torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Make a native checkpoint of the state a ``torch.save`` file holds (plain tensors and
    values; loaded with ``weights_only=True``, so no arbitrary objects are unpickled)."""
    state = torch.load(torch_save_path, map_location="cpu", weights_only=True)
    native.NativeWriter(dcp_checkpoint_dir).write(state, MPI.COMM_SELF)


to_torch_save = dcp_to_torch_save
from_torch_save = torch_save_to_dcp
