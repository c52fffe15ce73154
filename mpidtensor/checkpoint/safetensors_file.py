"""The safetensors file format: an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
offsets relative to the end of the header, padded with spaces to 8 bytes), then each
tensor's row-major little-endian bytes back to back. Built and parsed here so that
every rank can compute where its parts go and write them straight into the file.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from math import prod

import torch

from .format import CheckpointError
from .io import write_at

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
METADATA_KEY = "__metadata__"
_MAX_HEADER = 100 << 20  # the safetensors package's limit

if sys.byteorder != "little":  # pragma: no cover - the tensors' bytes are written as they are in memory
    raise ImportError("safetensors files hold little-endian data; this machine is big-endian")


def dtype_name(dtype: torch.dtype, key: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{key!r} has dtype {dtype}, which safetensors cannot hold")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its dtype, shape and where its bytes are
    (``offset``: from the start of the file)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def build_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, Entry]]:
    """The header bytes (length prefix included) of a file holding ``tensors``
    (``(name, dtype, shape)``, stored in this order) and where each one's bytes go."""
    fields: dict = {METADATA_KEY: dict(metadata or {"format": "pt"})}
    pos, spans = 0, {}
    for name, dtype, shape in tensors:
        nbytes = prod(shape) * dtype.itemsize
        fields[name] = {"dtype": dtype_name(dtype, name), "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        spans[name] = (dtype, tuple(shape), pos, nbytes)
        pos += nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    entries = {name: Entry(dtype, shape, start + begin, nbytes)
               for name, (dtype, shape, begin, nbytes) in spans.items()}
    return struct.pack("<Q", len(text)) + text, entries


def read_header(path: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of the safetensors file ``path`` and its ``__metadata__``; a
    ``CheckpointError`` naming the file when the header is corrupt or the file is
    shorter than the header says."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, no header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path} is corrupt or truncated: header of {length} bytes in a file of {size}")
        try:
            fields = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} is corrupt: its header is not JSON ({err})") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} is corrupt: its header is not a JSON object")
    metadata = fields.pop(METADATA_KEY, None) or {}
    entries, start = {}, 8 + length
    for name, field in fields.items():
        try:
            dtype = DTYPES[field["dtype"]]
            shape = tuple(int(n) for n in field["shape"])
            begin, end = (int(o) for o in field["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is corrupt: bad header entry for {name!r}: {field!r}") from None
        nbytes = prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path} is corrupt: {name!r} of shape {shape} ({field['dtype']}) "
                                  f"spans bytes {begin}..{end}")
        if start + end > size:
            raise CheckpointError(f"{path} is truncated: {name!r} ends at byte {start + end}, the file has {size}")
        entries[name] = Entry(dtype, shape, start + begin, nbytes)
    return entries, metadata


def create(path: str, header: bytes, entries: dict[str, Entry]) -> None:
    """Create ``path`` holding ``header``, as long as the whole file: the tensors' bytes
    are written into it later, by the ranks holding them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, max((e.offset + e.nbytes for e in entries.values()), default=len(header)))
        write_at(fd, [memoryview(header)], 0, path)
    finally:
        os.close(fd)
