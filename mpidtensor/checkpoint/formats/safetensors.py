"""Hugging Face safetensors checkpoints, both ways: ``HuggingFaceStorageWriter`` /
``HuggingFaceStorageReader`` with the call shape of ``torch.distributed.checkpoint``'s
(its module path: :mod:`..hf_storage`); the steps of :mod:`..transaction` they fill in.

Writing, consolidated (``save_distributed=False``, or ``enable_consolidation=True``):
``model-0000i-of-0000n.safetensors`` files (which tensor goes to which: the
``fqn_to_index_mapping``, default all in one) plus ``model.safetensors.index.json``, the
layout ``save_pretrained`` writes and ``from_pretrained`` reads. No rank gathers a
tensor: every rank computes the same headers, each file's owner creates it (header,
full length), then each rank writes the distinct boxes it holds (the native writer's
rule for replicas) straight into place, one ``pwrite`` per contiguous run. torch writes
per-rank shard files first and copies them into the consolidated files afterwards; here
the consolidated files are written once. The files get temporary names until every
rank has written and synced; then rank 0 renames them and writes the index (so an
interrupted save leaves the previous weights as they were) and removes the weights
files the new index supersedes (``model.safetensors`` included: ``from_pretrained``
would prefer it).

Writing, sharded (``save_distributed=True, enable_consolidation=False``): each rank
writes its boxes into ``shard-<rank+1>-model-0000i-of-0000n.safetensors`` with torch's
``DCP_SHARDING_INFO`` (each tensor's offset in the global one) in the header metadata,
under a temporary name that rank 0 replaces once every rank has written, then removes
the shard files of earlier saves.

Both return the torch ``Metadata`` of the save on every rank
(:meth:`HuggingFaceStorageWriter.metadata`).

Reading: one ``model.safetensors``, an index with several files, or torch's shard
files; each rank reads only the bytes of its box of each target (resharding by box
intersection), straight into the target when the box is one run of the file.

The file format, built and parsed here so that every rank can compute where its parts go
and write them straight into the file: an 8-byte little-endian header length, a JSON
header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, offsets relative to the end of the header, padded with spaces to 8
bytes), then each tensor's row-major little-endian bytes back to back.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import io, opaque, shards
from ..errors import CheckpointError
from ..metadata import describe, torch_leaves
from ..transaction import Job, LoadFormat, SavedTensor, SaveFormat, start_save

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader"]

INDEX = "model.safetensors.index.json"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch's header metadata of shard files
_WEIGHTS = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors")
_SHARDS = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")


def file_name(index: int, count: int, shard: int | None = None) -> str:
    """torch's names: ``model-0000i-of-0000n.safetensors``, ``shard-0000r-`` before it."""
    name = f"model-{index:05d}-of-{count:05d}.safetensors"
    return name if shard is None else f"shard-{shard:05d}-{name}"


@dataclass
class _Plan:
    """What every rank computes alike before writing: the leaves going to each file index
    (from 1), their count, and (consolidated) each file's header and entries."""

    files: dict[int, list[int]]
    count: int
    layouts: dict[int, tuple[bytes, dict[str, Entry]]]


class HuggingFaceStorageWriter(SaveFormat):
    """Writes a state dict of tensors and DTensors as safetensors files (see the module
    docstring for the layouts). ``thread_count`` and ``thread_count_consolidation`` are
    torch's knobs for its per-rank thread pools, accepted for its call shape: here the
    ranks themselves write in parallel, each its own parts."""

    def __init__(self, path: str | os.PathLike, fqn_to_index_mapping: dict[str, int] | None = None,
                 thread_count: int = 1, save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1) -> None:
        super().__init__(path)
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.thread_count = thread_count
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation

    @property
    def consolidated(self) -> bool:
        return self.enable_consolidation or not self.save_distributed

    @property
    def shares_files(self) -> bool:
        return self.consolidated

    def prepare(self, state_dict: Any) -> str:
        return start_save(self.path, state_dict)

    def plan(self, job: Job) -> _Plan:
        files = self._files(job.leaves)  # the same on every rank: raises on all or none
        count = max(files, default=1)
        layouts = {}
        if self.consolidated:
            layouts = {index: build_header([(job.leaves[i].fqn, job.leaves[i].value.dtype,
                                             tuple(job.leaves[i].value.shape)) for i in ids])
                       for index, ids in files.items()}
        return _Plan(files, count, layouts)

    def _files(self, leaves: list) -> dict[int, list[int]]:
        """The leaves going to each file index (from 1)."""
        not_tensors = [leaf.fqn for leaf in leaves if not isinstance(leaf.value, torch.Tensor)]
        if not_tensors:
            raise TypeError(f"safetensors hold tensors only; not tensors: {not_tensors}")
        subclasses = [f"{leaf.fqn!r} ({cls})" for leaf in leaves if (cls := opaque.class_name(leaf.value))]
        if subclasses:
            raise TypeError(f"safetensors hold plain dtypes only; tensor subclasses: {', '.join(subclasses)}")
        for leaf in leaves:
            dtype_name(leaf.value.dtype, leaf.fqn)
        mapping = self.fqn_to_index_mapping
        if mapping is None:
            return {1: list(range(len(leaves)))} if leaves else {}
        missing = [leaf.fqn for leaf in leaves if leaf.fqn not in mapping]
        if missing:
            raise ValueError(f"fqn_to_index_mapping has no file index for {missing}")
        if any(not isinstance(mapping[leaf.fqn], int) or mapping[leaf.fqn] < 1 for leaf in leaves):
            raise ValueError("fqn_to_index_mapping's file indices count from 1")
        files: dict[int, list[int]] = {}
        for i, leaf in enumerate(leaves):
            files.setdefault(mapping[leaf.fqn], []).append(i)
        return dict(sorted(files.items()))

    def _names(self, job: Job, rank: int) -> dict[int, str]:
        """The final name of each file that ``rank`` creates: consolidated, its share of the
        files (round robin); sharded, a shard file per file index it writes boxes of."""
        plan = job.plan
        if self.consolidated:
            return {index: file_name(index, plan.count) for n, index in enumerate(plan.files)
                    if n % job.comm.size == rank}
        return {index: file_name(index, plan.count, rank + 1) for index, ids in plan.files.items()
                if any(rank in job.writers[i].values() for i in ids)}

    def _temp(self, job: Job, name: str) -> str:
        return f".{name}.tmp-{job.saved}"

    def own_files(self, job: Job) -> list[str]:
        return [self._temp(job, name) for name in self._names(job, job.rank).values()]

    def create(self, job: Job) -> None:
        """This rank's share of the consolidated files: the header, at the full length."""
        for index, name in self._names(job, job.rank).items():
            create_file(os.path.join(self.path, self._temp(job, name)), *job.plan.layouts[index])

    def write_boxes(self, job: Job, boxes: list[tuple[int, torch.Tensor]]) -> None:
        """Consolidated: each box straight into its place in the shared files. Sharded: a
        shard file per file index, with each box's offset in the global tensor."""
        values, plan = dict(boxes), job.plan
        for index, ids in plan.files.items():
            parts = [i for i in ids if i in values]
            if not parts:
                continue
            if self.consolidated:
                temp = self._temp(job, file_name(index, plan.count))
                entries = plan.layouts[index][1]
                _write_runs(os.path.join(self.path, temp), [(entries[job.leaves[i].fqn], values[i]) for i in parts])
                continue
            info = {job.leaves[i].fqn: {"saved_offsets": list(job.meta(i)[1][2][0])} for i in parts}
            header, entries = build_header(
                [(job.leaves[i].fqn, values[i].dtype, job.meta(i)[1][2][1]) for i in parts],
                {SHARDING_INFO_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})
            temp = self._temp(job, file_name(index, plan.count, job.rank + 1))
            io.write_file(os.path.join(self.path, temp), [(0, np.frombuffer(header, np.uint8))] +
                          [(entries[job.leaves[i].fqn].offset, shards.local_bytes(values[i])) for i in parts])

    def commit(self, job: Job, parts: list) -> tuple[None, list[str]]:
        """Every rank's files under their names (consolidated: then the index, so an
        interrupted save leaves the previous weights as they were); the weights or shard
        files superseded."""
        io.fsync_dir(self.path)
        names = {name: index for rank in range(job.comm.size) for index, name in self._names(job, rank).items()}
        for name in names:
            os.replace(os.path.join(self.path, self._temp(job, name)), os.path.join(self.path, name))
        if not self.consolidated:
            return None, sorted(name for name in os.listdir(self.path)
                                if (_SHARDS.fullmatch(name) and name not in names) or ".tmp-" in name)
        plan = job.plan
        weight_map = {job.leaves[i].fqn: file_name(index, plan.count) for index, ids in plan.files.items() for i in ids}
        total = sum(e.nbytes for _, entries in plan.layouts.values() for e in entries.values())
        tmp = os.path.join(self.path, f".{INDEX}.tmp-{io.new_token()}")
        with open(tmp, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, INDEX))
        io.fsync_dir(self.path)
        return None, sorted(name for name in os.listdir(self.path)
                            if (_WEIGHTS.fullmatch(name) and name not in names) or ".tmp-" in name)

    def metadata(self, job: Job, committed: None) -> Metadata:
        """Built by every rank alike from facts they share. A tensor's chunks are its
        distinct boxes, in the order of the ranks that wrote them (in the consolidated
        layout too, where they lie in place in one file); ``storage_data`` maps each to
        the name of the safetensors file holding it; ``storage_meta``: the directory and
        the save's token."""
        plan = job.plan
        file_index = {i: index for index, ids in plan.files.items() for i in ids}
        chunks = {}
        for i, leaf_writers in enumerate(job.writers):
            ranked = sorted(leaf_writers.items(), key=lambda item: item[1])
            chunks[job.leaves[i].fqn] = [
                (box, file_name(file_index[i], plan.count, None if self.consolidated else rank + 1))
                for box, rank in ranked]
        return describe(torch_leaves(job.state_dict), chunks, {},
                        StorageMeta(checkpoint_id=self.path, save_id=job.saved))


def _write_runs(path: str, parts: list[tuple[Entry, torch.Tensor]]) -> None:
    """Write each tensor's local box into its place in the file ``path`` (created with
    the header and length) by one ``pwrite`` per contiguous run, then fsync."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for entry, value in parts:
            box, raw = shards.box(value), memoryview(shards.local_bytes(value))
            itemsize = value.dtype.itemsize
            for at, begin, length in io.runs(box, ((0,) * value.ndim, tuple(value.shape))):
                io.write_at(fd, [raw[begin * itemsize:(begin + length) * itemsize]],
                            entry.offset + at * itemsize, path)
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading ------------------------------------------------------------------------------------------
class Stored:
    """A tensor as the safetensors files hold it: dtype, global shape, the stored boxes."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.shape: tuple[int, ...] = ()
        self.chunks: list[io.Chunk] = []

    def add(self, chunk: io.Chunk) -> None:
        self.chunks.append(chunk)
        ends = [tuple(s + n for s, n in zip(c.start, c.shape)) for c in self.chunks]
        self.shape = tuple(max(e[d] for e in ends) for d in range(len(chunk.shape)))


def _files_to_read(directory: str) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of the checkpoint (the index's, else every one) and the
    index's ``weight_map`` ({} without an index)."""
    index_path = os.path.join(directory, INDEX)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index_path} is corrupt: {type(err).__name__}: {err}") from None
        return sorted(set(weight_map.values())), weight_map
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no safetensors checkpoint at {directory!r}")
    names = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no safetensors checkpoint at {directory!r} (no {INDEX}, no .safetensors file)")
    return names, {}


def scan(directory: str) -> dict[str, Stored]:
    """Every tensor of the safetensors checkpoint in ``directory``, from the headers."""
    names, weight_map = _files_to_read(directory)
    tensors: dict[str, Stored] = {}
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}, named by {INDEX}, is missing")
        entries, metadata = read_header(path)
        try:
            offsets = json.loads(metadata[SHARDING_INFO_KEY]) if SHARDING_INFO_KEY in metadata else {}
        except ValueError:
            raise CheckpointError(f"{path} is corrupt: bad {SHARDING_INFO_KEY} metadata") from None
        for key, e in entries.items():
            start = tuple(offsets[key]["saved_offsets"]) if key in offsets else (0,) * len(e.shape)
            stored = tensors.setdefault(key, Stored(e.dtype))
            if stored.dtype != e.dtype or (stored.chunks and len(stored.shape) != len(e.shape)):
                raise CheckpointError(f"the parts of {key!r} in the safetensors files differ in dtype or rank")
            stored.add(io.Chunk(start, e.shape, name, e.offset, e.nbytes))
    for key, name in weight_map.items():
        if key not in tensors:
            raise CheckpointError(f"{os.path.join(directory, name)} lacks {key!r}, which {INDEX} puts there")
    for key, stored in tensors.items():
        covered, numel = sum(prod(c.shape) for c in stored.chunks), prod(stored.shape)
        if covered != numel:
            raise CheckpointError(f"the stored parts of {key!r} cover {covered} of {numel} elements")
    return tensors


class HuggingFaceStorageReader(LoadFormat):
    """Reads Hugging Face safetensors weights (``model.safetensors``, an index with
    several files, or torch's shard files) into a state dict of any layout.
    ``thread_count`` is accepted for torch's call shape (each rank reads its own parts)."""

    values_refused = "safetensors hold tensors only"

    def __init__(self, path: str | os.PathLike, thread_count: int = 1) -> None:
        super().__init__(path)
        self.thread_count = thread_count

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        path = os.fspath(path)
        return os.path.isfile(os.path.join(path, INDEX)) or (
            os.path.isdir(path) and any(name.endswith(".safetensors") for name in os.listdir(path)))

    def open(self) -> dict[str, Stored]:
        return scan(self.path)

    def contents(self, job: Job) -> dict[str, SavedTensor]:
        return {key: SavedTensor(stored.shape, shards.DTYPE_NAMES.get(stored.dtype, str(stored.dtype)),
                                 [chunk.box for chunk in stored.chunks], None) for key, stored in job.saved.items()}

    def read_boxes(self, job: Job) -> tuple[list[str], dict[int, Any]]:
        reader = io.Reader(self.path)
        try:
            for leaf in job.leaves:
                _read_box(reader, job.saved[leaf.fqn], leaf.value)
        finally:
            reader.close()
        return [], {}


def _read_box(reader: io.Reader, stored: Stored, target: torch.Tensor) -> None:
    """Fill this rank's box of ``target`` from the stored parts that overlap it."""
    local = shards.local_tensor(target)
    if not local.numel():
        return
    direct = local.device.type == "cpu" and local.is_contiguous()
    staging = local if direct else torch.empty(local.shape, dtype=local.dtype)
    io.read_box(reader, stored.chunks, shards.box(target), staging.reshape(-1).view(torch.uint8).numpy(), local.dtype)
    if not direct:
        local.copy_(staging)


# --- the safetensors file ------------------------------------------------------------------------------
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


def create_file(path: str, header: bytes, entries: dict[str, Entry]) -> None:
    """Create ``path`` holding ``header``, as long as the whole file: the tensors' bytes
    are written into it later, by the ranks holding them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, max((e.offset + e.nbytes for e in entries.values()), default=len(header)))
        io.write_at(fd, [memoryview(header)], 0, path)
    finally:
        os.close(fd)
