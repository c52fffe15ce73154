"""The on-disk checkpoint format; readable by one process without MPI.

A checkpoint is a directory holding ``index.json`` and one data file that the index
names (``data-<token>.bin``). The data file holds every tensor as its global
row-major bytes at a 64-byte aligned offset, so ``np.memmap`` reads it. The index
lists the leaves of the nested state dict in order; each has a ``path`` (the keys
from the root) and either a ``tensor`` (dtype, shape, offset, nbytes and the saved
blocks with a CRC-32 each) or a ``value`` (JSON) / ``pickle`` (base64) / ``empty``
(an empty container). ``docs/checkpoint-format.md`` documents it.

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
from typing import Any, Iterator

import numpy as np
import torch

FORMAT = "mpidtensor-checkpoint"
VERSION = 1
INDEX = "index.json"
ALIGN = 64

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


def layout(tensors: list[tuple[list[int], torch.dtype]]) -> tuple[list[int], int]:
    """Aligned byte offsets of tensors ``(shape, dtype)`` placed in order, and the file size."""
    offsets, end = [], 0
    for shape, dtype in tensors:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return offsets, end


def crc32(buffer) -> int:
    return zlib.crc32(buffer) & 0xFFFFFFFF


# --- files --------------------------------------------------------------------------------------------
def new_token() -> str:
    return secrets.token_hex(8)


def data_name(token: str) -> str:
    return f"data-{token}.bin"


def commit_index(directory: str, index: dict) -> None:
    """Make ``index`` the checkpoint's index atomically (write, fsync, rename, fsync the
    directory), then remove the data files and temporaries it does not name."""
    token = new_token()
    tmp = os.path.join(directory, f".{INDEX}.tmp-{token}")
    with open(tmp, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, INDEX))
    _fsync_dir(directory)
    for name in os.listdir(directory):
        stale_data = name.startswith("data-") and name != index["data_file"]
        if stale_data or name.startswith(f".{INDEX}.tmp-"):
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(checkpoint_id: str | os.PathLike) -> dict:
    """The index of a committed checkpoint; ``FileNotFoundError`` when there is none."""
    path = os.path.join(os.fspath(checkpoint_id), INDEX)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(checkpoint_id)!r} (missing {INDEX})")
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a version-{VERSION} {FORMAT} index")
    return index


def tensor_from_file(data: np.memmap, meta: dict) -> torch.Tensor:
    """One saved tensor from the memory-mapped data file (a copy, row-major)."""
    dtype = DTYPES[meta["dtype"]]
    raw = np.array(data[meta["offset"]: meta["offset"] + meta["nbytes"]])
    return torch.from_numpy(raw).view(dtype).reshape(meta["shape"])


def check_blocks(key: str, tensor: torch.Tensor, meta: dict) -> None:
    """Compare each saved block's CRC-32 with ``tensor`` (the whole global tensor)."""
    for block in meta["blocks"]:
        box = tensor
        for d, (start, size) in enumerate(zip(block["start"], block["shape"])):
            box = box.narrow(d, start, size)
        raw = box.contiguous().reshape(-1).view(torch.uint8).numpy()
        if crc32(raw) != block["crc32"]:
            raise CheckpointError(f"checksum mismatch in tensor {key!r} (block at {block['start']})")


def load_plain(checkpoint_id: str | os.PathLike, verify: bool = True) -> Any:
    """The whole checkpoint as plain tensors and values in its nested structure; one
    process, no MPI. ``verify`` checks every block's CRC-32."""
    directory = os.fspath(checkpoint_id)
    index = read_index(directory)
    path = os.path.join(directory, index["data_file"])
    data = np.memmap(path, dtype=np.uint8, mode="r") if index["data_bytes"] else np.zeros(0, np.uint8)
    leaves = []
    for entry in index["entries"]:
        if "tensor" in entry:
            value = tensor_from_file(data, entry["tensor"])
            if verify:
                check_blocks(entry["key"], value, entry["tensor"])
        else:
            value = decode_value(entry)
        leaves.append((decode_path(entry["path"]), value))
    return unflatten(leaves)


def save_plain(state: Any, checkpoint_id: str | os.PathLike) -> None:
    """Write ``state`` (plain tensors and values) as a checkpoint from one process."""
    directory = os.fspath(checkpoint_id)
    os.makedirs(directory, exist_ok=True)
    leaves = list(flatten(state))
    tensors = [(p, v.detach().cpu().contiguous()) for p, v in leaves if isinstance(v, torch.Tensor)]
    offsets, size = layout([(list(t.shape), t.dtype) for _, t in tensors])
    token = new_token()
    metas = {}
    with open(os.path.join(directory, data_name(token)), "wb") as f:
        for (path, t), offset in zip(tensors, offsets):
            raw = t.reshape(-1).view(torch.uint8).numpy()
            f.seek(offset)
            f.write(raw.data)
            block = {"start": [0] * t.ndim, "shape": list(t.shape), "crc32": crc32(raw)}
            metas[path] = tensor_meta(t.shape, t.dtype, offset, [block] if t.numel() else [])
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
    entries = [make_entry(p, metas.get(p), v) for p, v in leaves]
    commit_index(directory, make_index(token, size, entries))


def tensor_meta(shape, dtype: torch.dtype, offset: int, blocks: list[dict]) -> dict:
    nbytes = int(np.prod(list(shape), dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return {"dtype": dtype_name(dtype), "shape": list(shape), "offset": offset, "nbytes": nbytes, "blocks": blocks}


def make_entry(path: tuple, meta: dict | None, value: Any) -> dict:
    entry = {"key": fqn(path), "path": encode_path(path)}
    entry.update({"tensor": meta} if meta is not None else encode_value(value))
    return entry


def make_index(token: str, size: int, entries: list[dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "data_file": data_name(token), "data_bytes": size,
            "entries": entries}
