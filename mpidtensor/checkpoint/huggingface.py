"""Hugging Face safetensors checkpoints, both ways: ``HuggingFaceStorageWriter`` /
``HuggingFaceStorageReader`` with the call shape of ``torch.distributed.checkpoint``'s.

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
``DCP_SHARDING_INFO`` (each tensor's offset in the global one) in the header metadata.

Both return the torch ``Metadata`` of the save on every rank
(:meth:`HuggingFaceStorageWriter._metadata`).

Reading: one ``model.safetensors``, an index with several files, or torch's shard
files; each rank reads only the bytes of its box of each target (resharding by box
intersection), straight into the target when the box is one run of the file.
"""
from __future__ import annotations

import json
import os
import re
from math import prod
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from . import collective, io, opaque, shards
from . import format as fmt
from . import safetensors_file as sf
from .metadata import describe, gc_paused, start_save, torch_leaves
from .storage import StorageReader, StorageWriter

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader"]

INDEX = "model.safetensors.index.json"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch's header metadata of shard files
_WEIGHTS = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors")
_SHARDS = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")


def file_name(index: int, count: int, shard: int | None = None) -> str:
    """torch's names: ``model-0000i-of-0000n.safetensors``, ``shard-0000r-`` before it."""
    name = f"model-{index:05d}-of-{count:05d}.safetensors"
    return name if shard is None else f"shard-{shard:05d}-{name}"


class HuggingFaceStorageWriter(StorageWriter):
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

    def write(self, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
        """Write ``state_dict``; its torch ``Metadata`` (see :meth:`_metadata`). Collective."""
        leaves = [(fmt.fqn(path), value) for path, value in fmt.flatten(state_dict)]
        token = collective.on_rank0(comm, start_save, self.path, state_dict)
        metas = [shards.leaf_meta(key, value) for key, value in leaves]
        all_metas = shards.gather_metas(metas, comm)
        files = self._files(leaves)  # the same on every rank: raises on all or none
        values = [shards.reduced(value) for _, value in leaves]  # collective, in the same order
        writers = shards.box_writers(all_metas)
        mine = shards.boxes_to_write(writers, comm.rank)
        if self.consolidated:
            self._write_consolidated(files, leaves, values, mine, token, comm)
        else:
            self._write_shards(files, leaves, values, mine, token, comm)
        return self._metadata(state_dict, leaves, writers, files, token)

    @gc_paused()
    def _metadata(self, state_dict: Any, leaves: list[tuple[str, Any]], writers: list[dict[tuple, int]],
                  files: dict[int, list[int]], token: str) -> Metadata:
        """The torch ``Metadata`` of the save, which every rank builds alike from facts
        they share. A tensor's chunks are its distinct boxes, in the order of the ranks
        that wrote them (in the consolidated layout too, where they lie in place in one
        file); ``storage_data`` maps each to the name of the safetensors file holding it;
        ``storage_meta``: the directory and the save's token."""
        count = max(files, default=1)
        file_index = {i: index for index, ids in files.items() for i in ids}
        chunks = {}
        for i, leaf_writers in enumerate(writers):
            ranked = sorted(leaf_writers.items(), key=lambda item: item[1])
            chunks[leaves[i][0]] = [(box, file_name(file_index[i], count, None if self.consolidated else rank + 1))
                                    for box, rank in ranked]
        return describe(torch_leaves(state_dict), chunks, {}, StorageMeta(checkpoint_id=self.path, save_id=token))

    def _files(self, leaves: list[tuple[str, Any]]) -> dict[int, list[int]]:
        """The leaves going to each file index (from 1)."""
        not_tensors = [key for key, value in leaves if not isinstance(value, torch.Tensor)]
        if not_tensors:
            raise TypeError(f"safetensors hold tensors only; not tensors: {not_tensors}")
        subclasses = [f"{key!r} ({cls})" for key, value in leaves if (cls := opaque.class_name(value))]
        if subclasses:
            raise TypeError(f"safetensors hold plain dtypes only; tensor subclasses: {', '.join(subclasses)}")
        for key, value in leaves:
            sf.dtype_name(value.dtype, key)
        mapping = self.fqn_to_index_mapping
        if mapping is None:
            return {1: list(range(len(leaves)))} if leaves else {}
        missing = [key for key, _ in leaves if key not in mapping]
        if missing:
            raise ValueError(f"fqn_to_index_mapping has no file index for {missing}")
        if any(not isinstance(mapping[key], int) or mapping[key] < 1 for key, _ in leaves):
            raise ValueError("fqn_to_index_mapping's file indices count from 1")
        files: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(leaves):
            files.setdefault(mapping[key], []).append(i)
        return dict(sorted(files.items()))

    def _write_consolidated(self, files: dict[int, list[int]], leaves: list, values: list, mine: set[int],
                            token: str, comm: MPI.Intracomm) -> None:
        count = max(files, default=1)
        names = {index: file_name(index, count) for index in files}
        layouts = {index: sf.build_header([(leaves[i][0], values[i].dtype, tuple(values[i].shape)) for i in ids])
                   for index, ids in files.items()}
        temp = {index: os.path.join(self.path, f".{name}.tmp-{token}") for index, name in names.items()}
        created, error = [], None
        try:
            for n, index in enumerate(files):
                if n % comm.size == comm.rank:
                    created.append(os.path.basename(temp[index]))
                    sf.create(temp[index], *layouts[index])
        except Exception as err:  # noqa: BLE001  (raised on every rank below)
            error = err
        errors = comm.allgather(error)  # every file exists before any rank writes into it
        if all(e is None for e in errors):
            try:
                for index, ids in files.items():
                    parts = [i for i in ids if i in mine]
                    if parts:
                        entries = layouts[index][1]
                        _write_runs(temp[index], [(entries[leaves[i][0]], values[i]) for i in parts])
            except Exception as err:  # noqa: BLE001  (raised on every rank below)
                error = err
            errors = comm.allgather(error)
        if any(e is not None for e in errors):
            fmt.remove_files(self.path, created)
            collective.raise_first(errors)
        stale = collective.on_rank0(comm, self._commit, names, temp, layouts, leaves, files)
        collective.remove_stale(comm, self.path, stale)

    def _commit(self, names: dict, temp: dict, layouts: dict, leaves: list, files: dict) -> list[str]:
        """Rank 0: the files under their names, then the index; the weights files it
        supersedes."""
        fmt.fsync_dir(self.path)
        for index, name in names.items():
            os.replace(temp[index], os.path.join(self.path, name))
        weight_map = {leaves[i][0]: names[index] for index, ids in files.items() for i in ids}
        total = sum(e.nbytes for _, entries in layouts.values() for e in entries.values())
        tmp = os.path.join(self.path, f".{INDEX}.tmp-{fmt.new_token()}")
        with open(tmp, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, INDEX))
        fmt.fsync_dir(self.path)
        kept = set(names.values())
        return sorted(name for name in os.listdir(self.path)
                      if (_WEIGHTS.fullmatch(name) and name not in kept) or ".tmp-" in name)

    def _write_shards(self, files: dict[int, list[int]], leaves: list, values: list, mine: set[int],
                      token: str, comm: MPI.Intracomm) -> None:
        """Each rank: its boxes, in a shard file per file index, with their offsets."""
        count = max(files, default=1)
        written, error = [], None
        try:
            for index, ids in files.items():
                parts = [i for i in ids if i in mine]
                if not parts:
                    continue
                boxes = {leaves[i][0]: shards.box(values[i]) for i in parts}
                info = {key: {"saved_offsets": list(start)} for key, (start, _) in boxes.items()}
                header, entries = sf.build_header(
                    [(leaves[i][0], values[i].dtype, boxes[leaves[i][0]][1]) for i in parts],
                    {SHARDING_INFO_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})
                name = file_name(index, count, comm.rank + 1)
                path = os.path.join(self.path, f".{name}.tmp-{token}")
                io.write_file(path, [(0, np.frombuffer(header, np.uint8))] +
                              [(entries[leaves[i][0]].offset, shards.local_bytes(values[i])) for i in parts])
                written.append((path, os.path.join(self.path, name)))
        except Exception as err:  # noqa: BLE001  (raised on every rank below)
            error = err
        errors = comm.allgather(error)
        if any(e is not None for e in errors):
            fmt.remove_files(self.path, [os.path.basename(tmp) for tmp, _ in written])
            collective.raise_first(errors)
        for tmp, final in written:
            os.replace(tmp, final)
        kept = comm.gather([os.path.basename(final) for _, final in written], root=0)
        if comm.rank == 0:  # the shard files of earlier saves
            kept = {name for names in kept for name in names}
            fmt.remove_files(self.path, [name for name in os.listdir(self.path)
                                         if (_SHARDS.fullmatch(name) and name not in kept) or ".tmp-" in name])
        comm.Barrier()


def _write_runs(path: str, parts: list[tuple[sf.Entry, torch.Tensor]]) -> None:
    """Write each tensor's local box into its place in the file ``path`` (created with
    the header and length) by one ``pwrite`` per contiguous run, then fsync."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for entry, value in parts:
            box, raw = shards.box(value), memoryview(shards.local_bytes(value))
            itemsize = value.dtype.itemsize
            for at, start, length in io.runs(box, ((0,) * value.ndim, tuple(value.shape))):
                io.write_at(fd, [raw[start * itemsize:(start + length) * itemsize]],
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
        self.chunks: list[fmt.Chunk] = []

    def add(self, chunk: fmt.Chunk) -> None:
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
            raise fmt.CheckpointError(f"{index_path} is corrupt: {type(err).__name__}: {err}") from None
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
        entries, metadata = sf.read_header(path)
        try:
            offsets = json.loads(metadata[SHARDING_INFO_KEY]) if SHARDING_INFO_KEY in metadata else {}
        except ValueError:
            raise fmt.CheckpointError(f"{path} is corrupt: bad {SHARDING_INFO_KEY} metadata") from None
        for key, e in entries.items():
            start = tuple(offsets[key]["saved_offsets"]) if key in offsets else (0,) * len(e.shape)
            stored = tensors.setdefault(key, Stored(e.dtype))
            if stored.dtype != e.dtype or (stored.chunks and len(stored.shape) != len(e.shape)):
                raise fmt.CheckpointError(f"the parts of {key!r} in the safetensors files differ in dtype or rank")
            stored.add(fmt.Chunk(start, e.shape, name, e.offset, e.nbytes))
    for key, name in weight_map.items():
        if key not in tensors:
            raise fmt.CheckpointError(f"{os.path.join(directory, name)} lacks {key!r}, which {INDEX} puts there")
    for key, stored in tensors.items():
        covered, numel = sum(prod(c.shape) for c in stored.chunks), prod(stored.shape)
        if covered != numel:
            raise fmt.CheckpointError(f"the stored parts of {key!r} cover {covered} of {numel} elements")
    return tensors


def _target_errors(tensors: dict[str, Stored], leaves: list[tuple[str, Any]]) -> list[str]:
    errors = []
    for key, value in leaves:
        stored = tensors.get(key)
        if not isinstance(value, torch.Tensor):
            errors.append(f"{key!r} is not a tensor; safetensors hold tensors only")
        elif stored is None:
            errors.append(f"missing key {key!r} in the checkpoint")
        elif stored.shape != tuple(value.shape):
            errors.append(f"shape mismatch for {key!r}: checkpoint {stored.shape}, state dict {tuple(value.shape)}")
        elif stored.dtype != value.dtype:
            errors.append(f"dtype mismatch for {key!r}: checkpoint {stored.dtype}, state dict {value.dtype}")
        elif opaque.class_name(value):
            errors.append(opaque.kind_error(key, None, opaque.class_name(value)))
        else:
            try:
                shards.check_loadable(key, value)
            except fmt.CheckpointError as err:
                errors.append(str(err))
    return errors


class HuggingFaceStorageReader(StorageReader):
    """Reads Hugging Face safetensors weights (``model.safetensors``, an index with
    several files, or torch's shard files) into a state dict of any layout.
    ``thread_count`` is accepted for torch's call shape (each rank reads its own parts)."""

    def __init__(self, path: str | os.PathLike, thread_count: int = 1) -> None:
        super().__init__(path)
        self.thread_count = thread_count

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        path = os.fspath(path)
        return os.path.isfile(os.path.join(path, INDEX)) or (
            os.path.isdir(path) and any(name.endswith(".safetensors") for name in os.listdir(path)))

    def read(self, state_dict: Any, comm: MPI.Intracomm) -> None:
        leaves = [(fmt.fqn(path), value) for path, value in fmt.flatten(state_dict)]
        tensors = collective.on_rank0(comm, scan, self.path)
        collective.raise_found(comm, _target_errors(tensors, leaves))
        reader, error = io.Reader(self.path), None
        try:
            for key, target in leaves:
                _read_box(reader, tensors[key], target)
        except Exception as err:  # noqa: BLE001  (raised on every rank below)
            error = err
        finally:
            reader.close()
        collective.raise_agreed(comm, error)


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
