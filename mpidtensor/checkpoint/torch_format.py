"""torch.distributed.checkpoint's file layout, both ways: ``FileSystemWriter`` /
``FileSystemReader``, so that checkpoints move between torch DCP and mpidtensor.

The layout (torch 2.x, ``filesystem.py``): a directory holding ``.metadata``, a pickled
``torch.distributed.checkpoint.metadata.Metadata``, and data files ``__<rank>_<n>.distcp``.
The state dict is flattened torch's way (:func:`.metadata.torch_leaves`). In
``Metadata`` (:mod:`.metadata` builds it; ``save`` returns it), ``state_dict_metadata``
gives each flat key a ``TensorStorageMetadata`` (properties, global size, the saved
chunks as (offsets, sizes) boxes, in the order of the ranks that wrote them) or a
``BytesStorageMetadata``; ``planner_data`` maps each flat key to its path of keys;
``storage_data`` maps ``MetadataIndex(key, chunk offsets)`` (no offsets for a value) to
``_StorageInfo(relative_path, offset, length)``, a byte range of a data file holding
``torch.save`` of the chunk's tensor (a value: ``torch.save`` of the object).

Writing: every distinct box of a tensor is saved once, by one of the ranks holding it
(the native writer's rule), into that rank's own data file; rank 0 saves the values and
then commits ``.metadata`` atomically (temporary file, fsync, rename). The data files of
a save never have the names the committed ``.metadata`` uses (``n`` is the smallest not
in use: 0, then 1, 0, ...), so an interrupted save leaves the previous checkpoint loadable; the
superseded files are removed after the commit.

Reading: rank 0 unpickles ``.metadata`` (torch's format is a pickle: load trusted
checkpoints only) and broadcasts it; each rank reads only the saved chunks that overlap
the box it holds of each target (resharding by box intersection: any layout, any world
size), ``torch.load`` reading each straight from its byte range of the file (one copy;
268 MB at 4 ranks loaded in 0.33 s against torch DCP's 0.58 s on a loaded 2-core node).
A tensor subclass (:mod:`.opaque`, e.g. torchao's ``NF4Tensor``) is saved as torch
saves it (``torch.save`` of each rank's local block) and loaded only into a target whose
box is a saved chunk (``copy_`` of the loaded chunk). The metadata does not say which
chunks are subclasses: a chunk that loads as a subclass into a plain target, or as a
plain tensor into a subclass, raises ``CheckpointError`` (after other leaves moved).
Not supported: stream transforms (torch's experimental ``_extensions``: a
``CheckpointError`` saying so) and ``FileSystemWriter(serialization_format=SAFETENSORS)``
data (a ``CheckpointError`` naming the file whose bytes do not load).
"""
from __future__ import annotations

import io as pyio
import os
import pickle
import re
import uuid
from typing import Any

import torch
from mpi4py import MPI
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from . import collective, io, opaque, shards
from . import format as fmt
from .metadata import Leaf, describe, gc_paused, torch_leaves
from .storage import StorageReader, StorageWriter

__all__ = ["FileSystemWriter", "FileSystemReader"]

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION for this layout
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def _set_leaf(state_dict: dict, keys: tuple, value: Any) -> None:
    node = state_dict
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value


# --- writing ------------------------------------------------------------------------------------------
class FileSystemWriter(StorageWriter):
    """Writes torch DCP's layout (``.metadata`` and ``__<rank>_<n>.distcp``), readable by
    ``torch.distributed.checkpoint.load`` at any world size. ``overwrite=False`` refuses
    a directory that already holds a checkpoint; ``sync_files=False`` skips the fsyncs
    (faster; a crash may then leave a committed checkpoint with missing data).
    ``single_file_per_rank``, ``thread_count``, ``per_thread_copy_ahead`` and
    ``cache_staged_state_dict`` are accepted for torch's call shape: every rank writes
    one file from its CPU tensors (torch's default), in one thread."""

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True) -> None:
        super().__init__(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.overwrite = overwrite

    def write(self, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
        """Write ``state_dict``; the ``Metadata`` committed as ``.metadata`` (its
        ``storage_data``: each chunk's and value's ``_StorageInfo``, a byte range of a data
        file holding its ``torch.save``). Collective."""
        leaves = torch_leaves(state_dict)
        generation = collective.on_rank0(comm, self._prepare)
        metas = [shards.leaf_meta(leaf.fqn, leaf.value) for leaf in leaves]
        all_metas = shards.gather_metas(metas, comm)
        mine = shards.boxes_to_write(shards.box_writers(all_metas), comm.rank)
        todo = []
        for i, (_, _, _, value) in enumerate(leaves):
            if isinstance(value, torch.Tensor):
                value = shards.reduced(value)  # collective: every rank, in the same order
                if i in mine:
                    todo.append((i, value))
            elif comm.rank == 0:
                todo.append((i, value))
        name = f"__{comm.rank}_{generation}.distcp"
        written, error = collective.attempt(self._write_data, name, todo, metas) if todo else ([], None)
        try:
            with gc_paused():  # rank 0 builds the Metadata, the others unpickle it
                metadata, stale = collective.commit_on_rank0(comm, written, error,
                                                             lambda parts: self._commit(leaves, parts))
        except Exception:
            if todo and os.path.exists(os.path.join(self.path, name)):
                os.remove(os.path.join(self.path, name))  # no committed metadata names it
            raise
        collective.remove_stale(comm, self.path, stale)
        return metadata

    def _prepare(self) -> int:
        """Rank 0: create the directory; the ``n`` of this save's data files (one the
        committed checkpoint does not use)."""
        os.makedirs(self.path, exist_ok=True)
        committed = os.path.join(self.path, METADATA)
        if not os.path.exists(committed):
            return 0
        if not self.overwrite:
            raise FileExistsError(f"{committed} exists and overwrite=False")
        try:
            used = {info.relative_path for info in _read_metadata(self.path).storage_data.values()}
        except (fmt.CheckpointError, AttributeError):
            return 0  # a broken checkpoint is replaced, not preserved
        taken = {int(m.group(2)) for m in map(_DATA_FILE.fullmatch, used) if m}
        return next(n for n in range(len(taken) + 1) if n not in taken)

    def _write_data(self, name: str, todo: list, metas: list) -> list[tuple]:
        """Save ``todo``'s leaves (this rank's boxes; values) into the data file ``name``:
        ``(flat key, box or None, _StorageInfo)`` of each."""
        written = []
        with open(os.path.join(self.path, name), "wb") as f:
            for i, value in todo:
                offset = f.tell()
                fqn, meta = metas[i]
                if meta is None:
                    buf = pyio.BytesIO()
                    torch.save(value, buf)
                    f.write(buf.getbuffer())
                else:
                    local = shards.local_tensor(value).cpu()
                    if meta[3] is None and (local.untyped_storage().nbytes() != local.nbytes or local.storage_offset()):
                        local = local.clone()  # torch.save writes the whole storage
                    torch.save(local, f)
                written.append((fqn, meta and meta[2], _StorageInfo(name, offset, f.tell() - offset)))
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        return written

    def _commit(self, leaves: list[Leaf], written: list) -> tuple[Metadata, list[str]]:
        """Rank 0: ``.metadata`` from every rank's writes, committed atomically; it and
        the data files it supersedes."""
        chunks: dict[str, list] = {}
        values = {}
        for fqn, box, info in (w for rank_written in written for w in rank_written):
            if box is None:
                values[fqn] = info
            else:
                chunks.setdefault(fqn, []).append((box, info))
        metadata = describe(leaves, chunks, values, StorageMeta(checkpoint_id=self.path, save_id=str(uuid.uuid4())),
                            version=DCP_VERSION)
        tmp = os.path.join(self.path, f"{METADATA}.tmp-{fmt.new_token()}")
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        if self.sync_files:
            fmt.fsync_dir(self.path)  # the data files' names are durable before the commit
        os.replace(tmp, os.path.join(self.path, METADATA))
        if self.sync_files:
            fmt.fsync_dir(self.path)
        used = {info.relative_path for info in metadata.storage_data.values()}
        stale = sorted(name for name in os.listdir(self.path)
                       if (_DATA_FILE.fullmatch(name) and name not in used) or name.startswith(f"{METADATA}.tmp-"))
        return metadata, stale


# --- reading ------------------------------------------------------------------------------------------
def _read_metadata(directory: str) -> Metadata:
    """The committed ``Metadata`` of the torch checkpoint in ``directory``."""
    path = os.path.join(directory, METADATA)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no torch DCP checkpoint at {directory!r} (missing {METADATA})")
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f)  # noqa: S301  (torch's format: a pickle; checkpoints are trusted)
    except Exception as err:  # noqa: BLE001
        raise fmt.CheckpointError(f"{path} is corrupt or truncated: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise fmt.CheckpointError(f"{path} does not hold torch.distributed.checkpoint Metadata with storage data")
    return metadata


def _target_errors(metadata: Metadata, metas: list) -> list[str]:
    """What keeps the leaves ``metas`` from being loaded from ``metadata``."""
    errors = []
    for key, meta in metas:
        saved = metadata.state_dict_metadata.get(key)
        if saved is None:
            errors.append(f"missing key {key!r} in the checkpoint")
        elif (meta is None) != isinstance(saved, BytesStorageMetadata):
            kinds = ("a value", "a tensor")
            errors.append(f"{key!r} is {kinds[meta is not None]} in the state dict but "
                          f"{kinds[isinstance(saved, TensorStorageMetadata)]} in the checkpoint")
        elif meta is not None:
            if tuple(saved.size) != tuple(meta[0]):
                errors.append(f"shape mismatch for {key!r}: checkpoint {tuple(saved.size)}, state dict {meta[0]}")
            dtype = fmt.DTYPE_NAMES.get(saved.properties.dtype, str(saved.properties.dtype))
            if dtype != meta[1]:
                errors.append(f"dtype mismatch for {key!r}: checkpoint {dtype}, state dict {meta[1]}")
    return errors


class FileSystemReader(StorageReader):
    """Reads a checkpoint in torch DCP's layout (written by torch or by
    :class:`FileSystemWriter`) into any layout at any world size."""

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(path), METADATA))

    def read(self, state_dict: Any, comm: MPI.Intracomm) -> None:
        leaves = torch_leaves(state_dict)
        metadata = collective.on_rank0(comm, _read_metadata, self.path)
        metas = [shards.leaf_meta(leaf.fqn, leaf.value) for leaf in leaves]
        errors = _target_errors(metadata, metas)
        for _, _, fqn, value in leaves:
            if isinstance(value, torch.Tensor):
                try:
                    shards.check_loadable(fqn, value)
                except fmt.CheckpointError as err:
                    errors.append(str(err))
                cls, saved = opaque.class_name(value), metadata.state_dict_metadata.get(fqn)
                if cls is not None and isinstance(saved, TensorStorageMetadata):
                    errors.append(opaque.layout_error(fqn, cls, [(c.offsets, c.sizes) for c in saved.chunks],
                                                      [shards.box(value)]))
        collective.raise_found(comm, [e for e in errors if e])

        values, error = collective.attempt(_read_leaves, self.path, metadata, leaves)
        collective.raise_agreed(comm, error)
        for keys, value in values:
            _set_leaf(state_dict, keys, value)


def _read_leaves(directory: str, metadata: Metadata, leaves: list[Leaf]) -> list[tuple]:
    """Fill this rank's box of each tensor leaf from the files; ``(keys, value)`` of
    each other leaf, as saved."""
    values = []
    for keys, _, fqn, value in leaves:
        if isinstance(value, torch.Tensor):
            _read_tensor(directory, metadata, fqn, value)
        else:
            info = _storage_info(metadata, MetadataIndex(fqn), fqn)
            values.append((keys, _load_saved(directory, info, fqn, weights_only=False)))
    return values


def _storage_info(metadata: Metadata, index: MetadataIndex, fqn: str) -> _StorageInfo:
    info = metadata.storage_data.get(index)
    if info is None:
        raise fmt.CheckpointError(f"the checkpoint's metadata has no storage entry for {fqn!r} at {index.offset}")
    if getattr(info, "transform_descriptors", None):
        raise fmt.CheckpointError(f"{fqn!r} is stored with stream transforms {info.transform_descriptors}, "
                                  f"which this reader does not apply")
    return info


class _FileRange(pyio.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable read-only stream:
    ``torch.load`` reads a saved chunk from it straight into the tensor's storage."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self._pos = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence] + pos
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self._length - self._pos)]
        done = os.preadv(self._fd, [view], self._start + self._pos) if len(view) else 0
        self._pos += done
        return done


def _load_saved(directory: str, info: _StorageInfo, fqn: str, weights_only: bool) -> Any:
    """``torch.load`` of the bytes ``info`` names (a chunk or a value of ``fqn``)."""
    path = os.path.join(directory, info.relative_path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {path} of {fqn!r} is missing") from None
    try:
        if os.fstat(fd).st_size < info.offset + info.length:
            raise fmt.CheckpointError(f"data file {path} ends before byte {info.offset + info.length} ({fqn!r})")
        try:
            return torch.load(_FileRange(fd, info.offset, info.length), weights_only=weights_only)
        except Exception as err:  # noqa: BLE001
            raise fmt.CheckpointError(f"data file {path} is corrupt: bytes {info.offset}+{info.length} of "
                                      f"{fqn!r} do not load ({type(err).__name__}: {err})") from None
    finally:
        os.close(fd)


def load_chunk(directory: str, metadata: Metadata, fqn: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n``-th saved chunk of the tensor ``fqn`` (of ``dtype``), as ``torch.load`` gives it."""
    chunk = metadata.state_dict_metadata[fqn].chunks[n]
    info = _storage_info(metadata, MetadataIndex(fqn, chunk.offsets, n), fqn)
    saved = _load_saved(directory, info, fqn, weights_only=True)
    if not isinstance(saved, torch.Tensor) or saved.shape != chunk.sizes or saved.dtype != dtype:
        raise fmt.CheckpointError(f"data file {os.path.join(directory, info.relative_path)} is corrupt: "
                                  f"the chunk of {fqn!r} at {tuple(chunk.offsets)} "
                                  f"is not a {dtype} tensor of shape {tuple(chunk.sizes)}")
    return saved


def _read_tensor(directory: str, metadata: Metadata, fqn: str, target: torch.Tensor) -> None:
    """Fill this rank's box of ``target`` from the saved chunks of ``fqn`` that overlap it;
    a tensor subclass by ``copy_`` from the chunk of its box (see ``read``'s checks)."""
    saved_md = metadata.state_dict_metadata[fqn]
    box, local = shards.box(target), shards.local_tensor(target)
    if not local.numel():
        return
    cls = opaque.class_name(local)
    if cls is not None:
        n = next(n for n, c in enumerate(saved_md.chunks) if (tuple(c.offsets), tuple(c.sizes)) == box)
        saved = load_chunk(directory, metadata, fqn, n, local.dtype)
        if opaque.class_name(saved) is None:
            raise fmt.CheckpointError(opaque.kind_error(fqn, None, cls))
        local.copy_(saved)
        return
    staging = local if local.device.type == "cpu" else torch.empty(local.shape, dtype=local.dtype)
    for n, chunk in enumerate(saved_md.chunks):
        chunk_box = (tuple(chunk.offsets), tuple(chunk.sizes))
        common = io.intersect(box, chunk_box)
        if common is None:
            continue
        saved = load_chunk(directory, metadata, fqn, n, local.dtype)
        if opaque.class_name(saved) is not None:
            raise fmt.CheckpointError(opaque.kind_error(fqn, opaque.class_name(saved), None))
        staging[io.relative(common, box)] = saved[io.relative(common, chunk_box)]
    if staging is not local:
        local.copy_(staging)
