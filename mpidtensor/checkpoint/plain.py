"""A checkpoint read or written whole by one process, without MPI: ``load_plain`` (both
format versions, with every block's CRC-32 checked) and ``save_plain``. A tensor
subclass stored opaquely (:mod:`.opaque`) is read back as itself when it is one block;
several blocks of one cannot be assembled (``CheckpointError``)."""
from __future__ import annotations

import os
from typing import Any

import torch

from . import format as fmt
from . import io, opaque


def read_tensor(reader: io.Reader, index: dict, meta: dict) -> torch.Tensor:
    """The whole saved tensor of ``meta`` (an index entry's ``tensor``), row-major."""
    dtype, shape = fmt.DTYPES[meta["dtype"]], tuple(meta["shape"])
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        raw = out.reshape(-1).view(torch.uint8).numpy()
        io.read_box(reader, fmt.chunks(index, meta), ((0,) * len(shape), shape), raw, dtype)
    return out


def check_blocks(key: str, tensor: torch.Tensor, meta: dict) -> None:
    """Compare each saved block's CRC-32 with ``tensor`` (the whole global tensor)."""
    for block in meta["blocks"]:
        box = tensor[io.relative((block["start"], block["shape"]), ((0,) * tensor.ndim, tensor.shape))]
        if fmt.crc32(box.contiguous().reshape(-1).view(torch.uint8).numpy()) != block["crc32"]:
            raise fmt.CheckpointError(f"checksum mismatch in tensor {key!r} (block at {block['start']})")


def load_plain(checkpoint_id: str | os.PathLike, verify: bool = True) -> Any:
    """The whole checkpoint as plain tensors and values in its nested structure; one
    process, no MPI. ``verify`` checks every block's CRC-32."""
    directory = os.fspath(checkpoint_id)
    index = fmt.read_index(directory)
    reader = io.Reader(directory)
    leaves = []
    try:
        for entry in index["entries"]:
            if entry.get("tensor", {}).get("encoding") == fmt.TORCH_SAVE:
                value = _read_opaque(reader, index, entry, verify)
            elif "tensor" in entry:
                value = read_tensor(reader, index, entry["tensor"])
                if verify:
                    check_blocks(entry["key"], value, entry["tensor"])
            else:
                value = fmt.decode_value(entry)
            leaves.append((fmt.decode_path(entry["path"]), value))
    finally:
        reader.close()
    return fmt.unflatten(leaves)


def _read_opaque(reader: io.Reader, index: dict, entry: dict, verify: bool) -> torch.Tensor:
    """The tensor subclass of ``entry``, which must be stored as one block."""
    key, meta = entry["key"], entry["tensor"]
    if len(meta["blocks"]) != 1:
        raise fmt.CheckpointError(
            f"{key!r} is a {meta['class']} saved as {len(meta['blocks'])} opaque torch.save blocks, which cannot "
            "be assembled in one process: load it with mpidtensor.checkpoint.load into the layout it was saved from")
    return opaque.read_block(reader, index, meta["blocks"][0], key, verify)


def save_plain(state: Any, checkpoint_id: str | os.PathLike) -> None:
    """Write ``state`` (tensors, opaque subclasses included, and values) as a checkpoint
    from one process: each tensor one block in one data file."""
    directory = os.fspath(checkpoint_id)
    os.makedirs(directory, exist_ok=True)
    leaves = list(fmt.flatten(state))
    tensors = {i: v.detach().cpu() for i, (_, v) in enumerate(leaves) if isinstance(v, torch.Tensor)}
    classes = {i: opaque.class_name(t) for i, t in tensors.items()}
    for t in tensors.values():
        fmt.dtype_name(t.dtype)  # refuse an unsupported dtype before writing
    raws = {i: opaque.to_bytes(t) if classes[i] else t.contiguous().reshape(-1).view(torch.uint8).numpy()
            for i, t in tensors.items() if t.numel()}
    offsets = fmt.layout([raw.nbytes for raw in raws.values()])
    data_files = [fmt.data_name(fmt.new_token(), 0)] if raws else []
    if raws:
        io.write_file(os.path.join(directory, data_files[0]), list(zip(offsets, raws.values())))
    blocks = {i: [{"start": [0] * tensors[i].ndim, "shape": list(tensors[i].shape), "file": 0, "offset": offset,
                   "crc32": fmt.crc32(raw), **({"nbytes": raw.nbytes} if classes[i] else {})}]
              for (i, raw), offset in zip(raws.items(), offsets)}
    entries = [fmt.make_entry(path, fmt.tensor_meta(tensors[i].shape, tensors[i].dtype, blocks.get(i, []), classes[i])
                              if i in tensors else None, value) for i, (path, value) in enumerate(leaves)]
    fmt.remove_files(directory, fmt.commit_index(directory, fmt.make_index(data_files, entries)))
