"""torch.distributed.checkpoint's file layout, both ways: ``FileSystemWriter`` /
``FileSystemReader`` (torch's module path: :mod:`..filesystem`), so that checkpoints
move between torch DCP and mpidtensor; the steps of :mod:`..transaction` they fill in.

The layout (torch 2.x, ``filesystem.py``): a directory holding ``.metadata``, a pickled
``torch.distributed.checkpoint.metadata.Metadata``, and data files ``__<rank>_<n>.distcp``.
The state dict is flattened torch's way (:func:`..metadata.torch_leaves`). In
``Metadata`` (:mod:`..metadata` builds it; ``save`` returns it), ``state_dict_metadata``
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
A tensor subclass (:mod:`..opaque`, e.g. torchao's ``NF4Tensor``) is saved as torch
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
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from .. import io, opaque, shards
from ..errors import CheckpointError
from ..metadata import Leaf, describe, torch_leaves
from ..transaction import Job, LoadFormat, SavedTensor, SaveFormat

__all__ = ["FileSystemWriter", "FileSystemReader"]

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION for this layout
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


# --- writing ------------------------------------------------------------------------------------------
class FileSystemWriter(SaveFormat):
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

    def leaves(self, state_dict: Any) -> list[Leaf]:
        return torch_leaves(state_dict)

    def prepare(self, state_dict: Any) -> int:
        """Create the directory; the ``n`` of this save's data files (one the committed
        checkpoint does not use)."""
        os.makedirs(self.path, exist_ok=True)
        committed = os.path.join(self.path, METADATA)
        if not os.path.exists(committed):
            return 0
        if not self.overwrite:
            raise FileExistsError(f"{committed} exists and overwrite=False")
        try:
            used = {info.relative_path for info in _read_metadata(self.path).storage_data.values()}
        except (CheckpointError, AttributeError):
            return 0  # a broken checkpoint is replaced, not preserved
        taken = {int(m.group(2)) for m in map(_DATA_FILE.fullmatch, used) if m}
        return next(n for n in range(len(taken) + 1) if n not in taken)

    def own_files(self, job: Job) -> list[str]:
        return [_data_name(job)] if job.writes() or job.rank == 0 else []

    def write_boxes(self, job: Job, boxes: list[tuple[int, torch.Tensor]]) -> list[tuple]:
        """This rank's boxes (rank 0: and the values, which torch keeps in data files too),
        each ``torch.save``d into its data file: ``(flat key, box or None, _StorageInfo)``
        of each."""
        todo = boxes + [(i, leaf.value) for i, leaf in enumerate(job.leaves)
                        if job.rank == 0 and not isinstance(leaf.value, torch.Tensor)]
        if not todo:
            return []
        name, written = _data_name(job), []
        with open(os.path.join(self.path, name), "wb") as f:
            for i, value in sorted(todo, key=lambda item: item[0]):
                offset = f.tell()
                fqn, meta = job.meta(i)
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

    def commit(self, job: Job, parts: list[list[tuple]]) -> tuple[Metadata, list[str]]:
        """``.metadata`` from every rank's writes, committed atomically; it and the data
        files it supersedes."""
        chunks: dict[str, list] = {}
        values = {}
        for fqn, box, info in (w for rank_written in parts for w in rank_written):
            if box is None:
                values[fqn] = info
            else:
                chunks.setdefault(fqn, []).append((box, info))
        metadata = describe(job.leaves, chunks, values, StorageMeta(checkpoint_id=self.path, save_id=str(uuid.uuid4())),
                            version=DCP_VERSION)
        tmp = os.path.join(self.path, f"{METADATA}.tmp-{io.new_token()}")
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        if self.sync_files:
            io.fsync_dir(self.path)  # the data files' names are durable before the commit
        os.replace(tmp, os.path.join(self.path, METADATA))
        if self.sync_files:
            io.fsync_dir(self.path)
        used = {info.relative_path for info in metadata.storage_data.values()}
        stale = sorted(name for name in os.listdir(self.path)
                       if (_DATA_FILE.fullmatch(name) and name not in used) or name.startswith(f"{METADATA}.tmp-"))
        return metadata, stale

    def metadata(self, job: Job, committed: Metadata) -> Metadata:
        """The ``Metadata`` committed as ``.metadata`` (its ``storage_data``: each chunk's
        and value's ``_StorageInfo``, a byte range of a data file holding its ``torch.save``)."""
        return committed


def _data_name(job: Job) -> str:
    return f"__{job.rank}_{job.saved}.distcp"

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
        raise CheckpointError(f"{path} is corrupt or truncated: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} does not hold torch.distributed.checkpoint Metadata with storage data")
    return metadata


class FileSystemReader(LoadFormat):
    """Reads a checkpoint in torch DCP's layout (written by torch or by
    :class:`FileSystemWriter`) into any layout at any world size."""

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(path), METADATA))

    def leaves(self, state_dict: Any) -> list[Leaf]:
        return torch_leaves(state_dict)

    def open(self) -> Metadata:
        return _read_metadata(self.path)

    def contents(self, job: Job) -> dict[str, SavedTensor | None]:
        """The kind of a tensor's chunks (plain or a subclass) shows only when they are
        read (``...``): the metadata does not say."""
        return {key: SavedTensor(tuple(md.size), shards.DTYPE_NAMES.get(md.properties.dtype, str(md.properties.dtype)),
                                 [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks], ...)
                if isinstance(md, TensorStorageMetadata) else None
                for key, md in job.saved.state_dict_metadata.items()}

    def read_boxes(self, job: Job) -> tuple[list[str], dict[int, Any]]:
        """Fill this rank's box of each tensor leaf from the files; each other leaf's value,
        as saved."""
        values = {}
        for i, (_, _, fqn, value) in enumerate(job.leaves):
            if isinstance(value, torch.Tensor):
                _read_tensor(job.directory, job.saved, fqn, value)
            else:
                info = _storage_info(job.saved, MetadataIndex(fqn), fqn)
                values[i] = _load_saved(job.directory, info, fqn, weights_only=False)
        return [], values


def _storage_info(metadata: Metadata, index: MetadataIndex, fqn: str) -> _StorageInfo:
    info = metadata.storage_data.get(index)
    if info is None:
        raise CheckpointError(f"the checkpoint's metadata has no storage entry for {fqn!r} at {index.offset}")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{fqn!r} is stored with stream transforms {info.transform_descriptors}, "
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
            raise CheckpointError(f"data file {path} ends before byte {info.offset + info.length} ({fqn!r})")
        try:
            return torch.load(_FileRange(fd, info.offset, info.length), weights_only=weights_only)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"data file {path} is corrupt: bytes {info.offset}+{info.length} of "
                                      f"{fqn!r} do not load ({type(err).__name__}: {err})") from None
    finally:
        os.close(fd)


def load_chunk(directory: str, metadata: Metadata, fqn: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n``-th saved chunk of the tensor ``fqn`` (of ``dtype``), as ``torch.load`` gives it."""
    chunk = metadata.state_dict_metadata[fqn].chunks[n]
    info = _storage_info(metadata, MetadataIndex(fqn, chunk.offsets, n), fqn)
    saved = _load_saved(directory, info, fqn, weights_only=True)
    if not isinstance(saved, torch.Tensor) or saved.shape != chunk.sizes or saved.dtype != dtype:
        raise CheckpointError(f"data file {os.path.join(directory, info.relative_path)} is corrupt: "
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
            raise CheckpointError(opaque.kind_error(fqn, None, cls))
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
            raise CheckpointError(opaque.kind_error(fqn, opaque.class_name(saved), None))
        staging[io.relative(common, box)] = saved[io.relative(common, chunk_box)]
    if staging is not local:
        local.copy_(staging)
