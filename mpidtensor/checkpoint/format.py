"""The on-disk checkpoint format; readable by one process without MPI.

A checkpoint is a directory holding ``index.json`` and the data files that the index
names (``data-<token>-<rank>.bin``, one per rank that wrote blocks). The index lists the
leaves of the nested state dict in order; each has a ``path`` (the keys from the root)
and either a ``tensor`` (dtype, shape and its blocks: a box, the data file and 64-byte
aligned offset holding the box's row-major bytes, a CRC-32; a tensor subclass: the
box's ``torch.save`` bytes, see :mod:`.opaque`) or a ``value`` (JSON) /
``pickle`` (base64) / ``empty`` (an empty container). Version 1 (one data file holding
every tensor whole) is still read: :func:`chunks` gives both as stored boxes.
``docs/checkpoint-format.md`` documents both.

Committing a checkpoint is replacing ``index.json`` atomically: data files not
named by the index are leftovers of an interrupted or superseded save.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import secrets
import zlib
from dataclasses import dataclass
from math import prod
from typing import Any, Iterator

import torch

try:  # ISA-L's CRC-32 (the same checksum as zlib's) runs at 10-30 GB/s, zlib's at ~1
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is optional
    _crc32 = zlib.crc32

FORMAT = "mpidtensor-checkpoint"
VERSION = 2
READABLE = (1, 2)
INDEX = "index.json"
ALIGN = 64
#: The ``encoding`` of a tensor whose blocks are ``torch.save`` bytes (see :mod:`.opaque`).
TORCH_SAVE = "torch.save"

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
# Path element kinds: dict with a str key, dict with an int key, list index, tuple index.
CONTAINERS = {"d": dict, "i": dict, "l": list, "t": tuple}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state dict it is loaded into, or is corrupt."""


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} cannot be checkpointed")
    return DTYPE_NAMES[dtype]


# --- the nested state dict as a flat list of leaves ------------------------------------------------
def flatten(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs of a nested dict/list/tuple in order; a path element is
    ``(kind, key)``. Empty containers are leaves so that they survive a round trip."""
    if isinstance(state, dict) and state:
        for key, value in state.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"state dict keys must be str or int, got {key!r} at {fqn(path)!r}")
            yield from flatten(value, path + (("d" if isinstance(key, str) else "i", key),))
    elif isinstance(state, (list, tuple)) and state:
        kind = "l" if isinstance(state, list) else "t"
        for i, value in enumerate(state):
            yield from flatten(value, path + ((kind, i),))
    else:
        yield path, state


def fqn(path: tuple) -> str:
    """The dotted name of a leaf, as errors and ``torch.distributed.checkpoint`` name it."""
    return ".".join(str(key) for _, key in path)


def unflatten(leaves: list[tuple[tuple, Any]]) -> Any:
    """The nested structure that :func:`flatten` took apart."""
    if len(leaves) == 1 and leaves[0][0] == ():
        return leaves[0][1]
    root: dict = {}
    for path, value in leaves:
        node = root
        for depth, (kind, key) in enumerate(path):
            last = depth == len(path) - 1
            node = node.setdefault((kind, key), value if last else {})
    return _build(root)


def _build(node: Any) -> Any:
    if not isinstance(node, dict) or not node or not isinstance(next(iter(node)), tuple):
        return node
    kind = next(iter(node))[0]
    items = [(key, _build(child)) for (_, key), child in node.items()]
    if kind in ("d", "i"):
        return dict(items)
    return CONTAINERS[kind](value for _, value in items)


# --- index entries ----------------------------------------------------------------------------------
def encode_value(value: Any) -> dict:
    """A non-tensor leaf as an index field: JSON when it round-trips, else pickled."""
    if isinstance(value, (dict, list, tuple)):
        return {"empty": {dict: "dict", list: "list", tuple: "tuple"}[type(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"pickle": base64.b64encode(pickle.dumps(value)).decode("ascii")}


def decode_value(entry: dict) -> Any:
    if "empty" in entry:
        return {"dict": dict, "list": list, "tuple": tuple}[entry["empty"]]()
    if "pickle" in entry:
        return pickle.loads(base64.b64decode(entry["pickle"]))
    return entry["value"]


def encode_path(path: tuple) -> list:
    return [[kind, key] for kind, key in path]


def decode_path(path: list) -> tuple:
    return tuple((kind, key) for kind, key in path)


def layout(sizes: list[int]) -> list[int]:
    """Offsets of blocks of ``sizes`` bytes placed in order at ``ALIGN``-byte boundaries."""
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += size
    return offsets


def crc32(buffer) -> int:
    """zlib's CRC-32 of a bytes-like object (computed by ISA-L when it is installed)."""
    return _crc32(buffer) & 0xFFFFFFFF


# --- files --------------------------------------------------------------------------------------------
def new_token() -> str:
    return secrets.token_hex(8)


def start_save(directory: str) -> str:
    """Create ``directory`` if missing; a new token naming the files of this save."""
    os.makedirs(directory, exist_ok=True)
    return new_token()


def data_name(token: str, rank: int) -> str:
    return f"data-{token}-{rank}.bin"


def commit_index(directory: str, index: dict) -> list[str]:
    """Make ``index`` the checkpoint's index atomically (write and fsync a temporary,
    fsync the directory so that the data files' names are durable, rename, fsync the
    directory); the names of the data files and temporaries it does not name, for
    :func:`remove_files`."""
    token = new_token()
    tmp = os.path.join(directory, f".{INDEX}.tmp-{token}")
    with open(tmp, "w") as f:
        f.write(json.dumps(index))  # one string: json.dump streams through the pure-Python encoder
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)
    os.replace(tmp, os.path.join(directory, INDEX))
    fsync_dir(directory)
    named = set(index["data_files"])
    return sorted(name for name in os.listdir(directory)
                  if (name.startswith("data-") and name not in named) or name.startswith(f".{INDEX}.tmp-"))


def remove_files(directory: str, names: list[str]) -> None:
    """Remove ``names`` from ``directory``; those already gone are skipped."""
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(checkpoint_id: str | os.PathLike) -> dict:
    """The index of a committed checkpoint (version 1 or 2); ``FileNotFoundError`` when
    there is none."""
    path = os.path.join(os.fspath(checkpoint_id), INDEX)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(checkpoint_id)!r} (missing {INDEX})")
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT or index.get("version") not in READABLE:
        raise CheckpointError(f"{path} is not a {FORMAT} index of version {' or '.join(map(str, READABLE))}")
    return index


@dataclass(frozen=True)
class Chunk:
    """A box of a saved tensor stored row-major and contiguous: ``nbytes`` at byte
    ``offset`` of the data file ``file``."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.start, self.shape


def chunks(index: dict, meta: dict) -> list[Chunk]:
    """Where the bytes of the tensor ``meta`` (an index entry's ``tensor``) are stored:
    its blocks (version 2) or the whole tensor in the one data file (version 1)."""
    if index["version"] == 1:
        if not meta["nbytes"]:
            return []
        return [Chunk((0,) * len(meta["shape"]), tuple(meta["shape"]), index["data_file"], meta["offset"],
                      meta["nbytes"])]
    itemsize = DTYPES[meta["dtype"]].itemsize
    return [Chunk(tuple(b["start"]), tuple(b["shape"]), index["data_files"][b["file"]], b["offset"],
                  b.get("nbytes", prod(b["shape"]) * itemsize)) for b in meta["blocks"]]


def tensor_meta(shape, dtype: torch.dtype, blocks: list[dict], cls: str | None = None) -> dict:
    """The ``tensor`` field of an index entry; each block ``{start, shape, file, offset,
    crc32}``. A tensor subclass stored opaquely (``cls``, see :mod:`.opaque`) adds
    ``encoding: "torch.save"`` and ``class``, and each of its blocks its ``nbytes``."""
    meta = {"dtype": dtype_name(dtype), "shape": list(shape), "nbytes": prod(shape) * dtype.itemsize,
            "blocks": blocks}
    if cls is not None:
        meta.update({"encoding": TORCH_SAVE, "class": cls})
    return meta


def make_entry(path: tuple, meta: dict | None, value: Any) -> dict:
    entry = {"key": fqn(path), "path": encode_path(path)}
    entry.update({"tensor": meta} if meta is not None else encode_value(value))
    return entry


def make_index(data_files: list[str], entries: list[dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "data_files": data_files, "entries": entries}
