"""mpidtensor's own checkpoint format (the default of ``save``/``load``): its writer and
reader (the steps of :mod:`..transaction` they fill in), and the index that describes it,
which one process reads without MPI (:mod:`..plain`). docs/checkpoint-format.md
documents both versions.

A checkpoint is a directory holding ``index.json`` and the data files that the index
names (``data-<token>-<rank>.bin``, one per rank that wrote blocks). The index lists the
leaves of the nested state dict in order; each has a ``path`` (the keys from the root)
and either a ``tensor`` (dtype, shape and its blocks: a box, the data file and 64-byte
aligned offset holding the box's row-major bytes, a CRC-32; a tensor subclass: the box's
``torch.save`` bytes, see :mod:`..opaque`) or a ``value`` (JSON) / ``pickle`` (base64) /
``empty`` (an empty container). Version 1 (one data file holding every tensor whole) is
still read: :func:`chunks` gives both as stored boxes. Committing a checkpoint is
replacing ``index.json`` atomically: data files not named by the index are leftovers of
an interrupted or superseded save.

save: every distinct non-empty box of a tensor is written once, by one of the ranks
holding it, straight from the local tensor into that rank's own new data file (one
``pwritev`` batch, one fsync); rank 0 gathers where each block went, with its CRC-32,
and commits the index. Every rank builds the same torch ``Metadata`` without a message
(:meth:`NativeWriter.metadata`).

load: each rank reads the box of the target layout it holds from the saved blocks that
overlap it, whatever layout was saved (resharding is box intersection). Each saved
block's CRC-32 is checked once: by a rank whose target box is that block, else by a rank
that reads it for the check. Opaque subclass blocks load only into targets holding saved
boxes (every rank that reads one checks its CRC-32).
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import zlib
from math import prod
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import io, opaque, shards, tree
from ..errors import CheckpointError
from ..metadata import describe, torch_leaves
from ..transaction import Job, LoadFormat, SavedTensor, SaveFormat, start_save

try:  # ISA-L's CRC-32 (the same checksum as zlib's) runs at 10-30 GB/s, zlib's at ~1
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is optional
    _crc32 = zlib.crc32

__all__ = ["NativeReader", "NativeWriter"]

FORMAT = "mpidtensor-checkpoint"
VERSION = 2
READABLE = (1, 2)
INDEX = "index.json"
ALIGN = 64
#: The ``encoding`` of a tensor whose blocks are ``torch.save`` bytes (see :mod:`..opaque`).
TORCH_SAVE = "torch.save"


class NativeWriter(SaveFormat):
    """Writes mpidtensor's own format (docs/checkpoint-format.md) to the directory ``path``."""

    def prepare(self, state_dict: Any) -> str:
        return start_save(self.path, state_dict)

    def own_files(self, job: Job) -> list[str]:
        return [data_name(job.saved, job.rank)] if job.writes() else []

    def write_boxes(self, job: Job, boxes: list[tuple[int, torch.Tensor]]) -> dict[int, dict]:
        """This rank's boxes into its new data file: the raw ones in leaf order, then the
        ``torch.save`` bytes of the opaque ones (so that the raw ones' offsets follow from
        their sizes alone); where each block went, with its CRC-32 (and an opaque one's
        ``nbytes``), by leaf index."""
        raws = [(i, shards.local_bytes(t)) for i, t in boxes if job.meta(i)[1][3] is None]
        raws += [(i, opaque.to_bytes(t)) for i, t in boxes if job.meta(i)[1][3] is not None]
        offsets = layout([raw.nbytes for _, raw in raws])
        blocks = {}
        for (i, raw), offset in zip(raws, offsets):
            begin, shape = job.meta(i)[1][2]
            blocks[i] = {"start": list(begin), "shape": list(shape), "offset": offset, "crc32": crc32(raw)}
            if job.meta(i)[1][3] is not None:
                blocks[i]["nbytes"] = raw.nbytes
        if raws:
            io.write_file(os.path.join(job.directory, data_name(job.saved, job.rank)),
                          [(offset, raw) for (_, raw), offset in zip(raws, offsets)])
        return blocks

    def commit(self, job: Job, parts: list[dict]) -> tuple[dict[str, list], list[str]]:
        """The index from every rank's written blocks, committed; the opaque leaves' saved
        chunks for the ``Metadata`` (``(box, _StorageInfo)`` by flat key, in the order of
        the writing ranks) and the files the index supersedes."""
        data_files, by_leaf = [], {}
        for rank, rank_blocks in enumerate(parts):
            if rank_blocks:
                for i, block in rank_blocks.items():
                    by_leaf.setdefault(i, []).append({**block, "file": len(data_files)})
                data_files.append(data_name(job.saved, rank))
        entries, pickled = [], {}
        for i, leaf in enumerate(job.leaves):
            meta = None
            if job.meta(i)[1] is not None:
                key, (shape, _, _, cls) = job.meta(i)
                if cls is not None:
                    pickled[key] = [((tuple(b["start"]), tuple(b["shape"])), _StorageInfo(
                        data_files[b["file"]], b["offset"], b["nbytes"])) for b in by_leaf.get(i, [])]
                saved = sorted(by_leaf.get(i, []), key=lambda b: b["start"])
                shards.check_covered(key, shape, [(b["start"], b["shape"]) for b in saved])
                meta = tensor_meta(shape, leaf.value.dtype, saved, cls)
            entries.append(make_entry(leaf.path, meta, leaf.value))
        return pickled, commit_index(job.directory, make_index(data_files, entries))

    def metadata(self, job: Job, committed: dict[str, list]) -> Metadata:
        """Built by every rank alike from facts they share, without a message: which rank
        wrote each raw block (:attr:`Job.writers`) and so where (:meth:`write_boxes` lays a
        rank's raw blocks out first, in leaf order); the opaque leaves' chunks (of unknown
        size before they were written) came with the commit's broadcast.

        A tensor leaf's chunks are its blocks, in the order of the ranks that wrote them,
        ``storage_data`` mapping each to ``_StorageInfo(data file, offset, length)``: the
        byte range holding the block's raw row-major bytes (an opaque block's
        ``torch.save`` bytes). A value (which the index holds, not a data file) has no
        ``storage_data`` entry, and neither has a tensor inside a value (a tuple, say),
        which torch would save as one object. ``storage_meta``: the directory and the
        save's token (its data files' names)."""
        by_rank: dict[int, list] = {}
        for i, leaf_writers in enumerate(job.writers):
            for box, rank in leaf_writers.items():
                if job.meta(i)[1][3] is None:
                    by_rank.setdefault(rank, []).append((i, box))
        chunks: dict[str, list] = dict(committed)
        for rank in sorted(by_rank):
            sizes = [prod(box[1]) * job.leaves[i].value.dtype.itemsize for i, box in by_rank[rank]]
            for (i, box), offset, size in zip(by_rank[rank], layout(sizes), sizes):
                chunks.setdefault(job.meta(i)[0], []).append(
                    (box, _StorageInfo(data_name(job.saved, rank), offset, size)))
        return describe(torch_leaves(job.state_dict), chunks, {},
                        StorageMeta(checkpoint_id=job.directory, save_id=job.saved))


class NativeReader(LoadFormat):
    """Reads mpidtensor's own format (both versions) from the directory ``path``."""

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(path), INDEX))

    def open(self) -> tuple[dict, dict[str, dict]]:
        """The index and its entries by flat key."""
        index = read_index(self.path)
        return index, {e["key"]: e for e in index["entries"]}

    def contents(self, job: Job) -> dict[str, SavedTensor | None]:
        contents = {}
        for key, entry in job.saved[1].items():
            meta = entry.get("tensor")
            contents[key] = meta and SavedTensor(
                tuple(meta["shape"]), meta["dtype"], [(tuple(b["start"]), tuple(b["shape"])) for b in meta["blocks"]],
                meta["class"] if meta.get("encoding") == TORCH_SAVE else None)
        return contents

    def read_boxes(self, job: Job) -> tuple[list[str], dict[int, Any]]:
        index, entries = job.saved
        reader, bad = io.Reader(job.directory), []
        try:
            for i, leaf in enumerate(job.leaves):
                key, meta = job.meta(i)
                if meta is not None:
                    bad += _load_tensor(reader, index, entries[key]["tensor"], key, leaf.value, i, job)
        finally:
            reader.close()
        values = {i: decode_value(entries[key]) for i, (key, meta) in enumerate(job.metas[job.rank]) if meta is None}
        return bad, values


def _destination(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, bool]:
    """The local tensor to fill, a byte buffer to read into, and whether the buffer is it."""
    local = shards.local_tensor(t)
    if local.device.type == "cpu" and local.is_contiguous():
        return local, local.reshape(-1).view(torch.uint8).numpy(), True
    return local, np.empty(local.numel() * local.element_size(), np.uint8), False


def _load_tensor(reader: io.Reader, index: dict, saved: dict, key: str, t: torch.Tensor, i: int,
                 job: Job) -> list[str]:
    """Fill this rank's part of ``t`` (leaf ``i``) from the saved tensor, check the CRC-32s
    this rank is in charge of; the mismatches found."""
    boxes, rank = job.boxes(i), job.rank
    if saved.get("encoding") == TORCH_SAVE:  # the target box is a saved one (target_errors)
        block = next((b for b in saved["blocks"] if (tuple(b["start"]), tuple(b["shape"])) == boxes[rank]), None)
        if block is not None:
            shards.local_tensor(t).copy_(read_block(reader, index, block, key))
        return []
    stored, box = chunks(index, saved), boxes[rank]
    local, buf, direct = _destination(t)
    if buf.size:
        io.read_box(reader, stored, box, buf, local.dtype)
        if not direct:
            local.copy_(torch.from_numpy(buf).view(local.dtype).reshape(local.shape))
    bad = []
    holders = [r for r, held in enumerate(boxes) if held is not None]  # the ranks loading this key
    for b, block in enumerate(saved["blocks"]):
        check = (tuple(block["start"]), tuple(block["shape"]))
        if (boxes.index(check) if check in boxes else holders[(zlib.crc32(key.encode()) + b) % len(holders)]) != rank:
            continue
        if check == box:
            raw = buf
        else:
            chunk = next((c for c in stored if c.box == check), None)
            if chunk is not None:  # a block stored as it was saved: checked in the file's map
                raw = reader.array(chunk.file, chunk.offset, chunk.nbytes)
            else:  # format version 1: the block is a box of the whole stored tensor
                raw = np.empty(prod(check[1]) * local.dtype.itemsize, np.uint8)
                io.read_box(reader, stored, check, raw, local.dtype)
        if crc32(raw) != block["crc32"]:
            bad.append(f"checksum mismatch in tensor {key!r} (block at {block['start']})")
    return bad


# --- the index -----------------------------------------------------------------------------------------
def crc32(buffer) -> int:
    """zlib's CRC-32 of a bytes-like object (computed by ISA-L when it is installed)."""
    return _crc32(buffer) & 0xFFFFFFFF


def data_name(token: str, rank: int) -> str:
    return f"data-{token}-{rank}.bin"


def layout(sizes: list[int]) -> list[int]:
    """Offsets of blocks of ``sizes`` bytes placed in order at ``ALIGN``-byte boundaries."""
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += size
    return offsets


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


def decode_path(path: list) -> tuple:
    return tuple((kind, key) for kind, key in path)


def tensor_meta(shape, dtype: torch.dtype, blocks: list[dict], cls: str | None = None) -> dict:
    """The ``tensor`` field of an index entry; each block ``{start, shape, file, offset,
    crc32}``. A tensor subclass stored opaquely (``cls``, see :mod:`..opaque`) adds
    ``encoding: "torch.save"`` and ``class``, and each of its blocks its ``nbytes``."""
    meta = {"dtype": shards.dtype_name(dtype), "shape": list(shape), "nbytes": prod(shape) * dtype.itemsize,
            "blocks": blocks}
    if cls is not None:
        meta.update({"encoding": TORCH_SAVE, "class": cls})
    return meta


def make_entry(path: tuple, meta: dict | None, value: Any) -> dict:
    entry = {"key": tree.fqn(path), "path": [[kind, key] for kind, key in path]}
    entry.update({"tensor": meta} if meta is not None else encode_value(value))
    return entry


def make_index(data_files: list[str], entries: list[dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "data_files": data_files, "entries": entries}


def commit_index(directory: str, index: dict) -> list[str]:
    """Make ``index`` the checkpoint's index atomically (write and fsync a temporary,
    fsync the directory so that the data files' names are durable, rename, fsync the
    directory); the names of the data files and temporaries it does not name."""
    tmp = os.path.join(directory, f".{INDEX}.tmp-{io.new_token()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(index))  # one string: json.dump streams through the pure-Python encoder
        f.flush()
        os.fsync(f.fileno())
    io.fsync_dir(directory)
    os.replace(tmp, os.path.join(directory, INDEX))
    io.fsync_dir(directory)
    named = set(index["data_files"])
    return sorted(name for name in os.listdir(directory)
                  if (name.startswith("data-") and name not in named) or name.startswith(f".{INDEX}.tmp-"))


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


def chunks(index: dict, meta: dict) -> list[io.Chunk]:
    """Where the bytes of the tensor ``meta`` (an index entry's ``tensor``) are stored:
    its blocks (version 2) or the whole tensor in the one data file (version 1)."""
    if index["version"] == 1:
        if not meta["nbytes"]:
            return []
        return [io.Chunk((0,) * len(meta["shape"]), tuple(meta["shape"]), index["data_file"], meta["offset"],
                         meta["nbytes"])]
    itemsize = shards.DTYPES[meta["dtype"]].itemsize
    return [io.Chunk(tuple(b["start"]), tuple(b["shape"]), index["data_files"][b["file"]], b["offset"],
                     b.get("nbytes", prod(b["shape"]) * itemsize)) for b in meta["blocks"]]


def read_block(reader: io.Reader, index: dict, block: dict, key: str, verify: bool = True) -> torch.Tensor:
    """The opaque tensor stored in ``block`` (of the leaf ``key``) by :func:`..opaque.to_bytes`;
    ``verify`` checks its CRC-32 first."""
    raw = reader.array(index["data_files"][block["file"]], block["offset"], block["nbytes"])
    if verify and crc32(raw) != block["crc32"]:
        raise CheckpointError(f"checksum mismatch in tensor {key!r} (block at {block['start']})")
    return opaque.from_bytes(raw, key)
