"""``save`` / ``load``: torch.distributed.checkpoint's call shape over MPI.

Both are collective over the process group (an MPI communicator; ``COMM_WORLD`` by
default). They resolve ``Stateful`` objects (:mod:`.stateful`), then hand the plain
nested state dict to a storage writer or reader (:mod:`.storage`): the native format
(:mod:`.formats.native`) unless one is given, or, for ``load``, the format the directory holds
(a native ``index.json``, else torch DCP's ``.metadata``).

Without a launcher (``python script.py``) MPI starts as a one-process job
(``COMM_WORLD`` of size 1), so both work as torch's non-distributed mode does.
``no_dist=True`` makes every process act alone (``COMM_SELF``): ``save`` writes the
process's own full tensors (a DTensor must be replicated; give each process its own
directory, or call it on one), ``load`` fills each process's targets, DTensors'
shards included, from the files without communicating.
"""
from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata

from ..runtime.agreement import on_rank0
from . import async_saver, stateful
from .arguments import check_planner, communicator, refuse_sharded, storage
from .formats.dcp import FileSystemReader
from .formats.native import NativeReader, NativeWriter
from .storage import StorageReader, StorageWriter


def save(
    state_dict: Any,
    checkpoint_id: str | os.PathLike | None = None,
    *,
    storage_writer: StorageWriter | None = None,
    planner: Any = None,
    process_group: MPI.Intracomm | None = None,
    no_dist: bool = False,
    comm: MPI.Intracomm | None = None,
) -> Metadata:
    """Write ``state_dict`` (a dict of nested dicts/lists of DTensors, tensors, values and
    ``Stateful`` objects) to ``checkpoint_id`` or through ``storage_writer`` (default:
    the native format). Collective over ``process_group`` (``comm``: its older name).

    ``planner``: None or torch's ``DefaultSavePlanner()`` (the same behaviour); others
    raise ``ValueError``: torch's planners rewrite torch's write items, and the storage
    writers plan their own (each distinct box once, replicas spread over the ranks).
    Waits for this process's ``async_save`` in flight first.

    Returns torch's ``Metadata`` of what was written, the same on every rank (as torch's
    ``save``): each flat key's ``TensorStorageMetadata`` (global size, properties, the
    saved chunk boxes) or ``BytesStorageMetadata``, ``planner_data`` and the writer's
    ``storage_data`` (:mod:`.metadata`).
    """
    group = communicator(process_group, comm, no_dist)
    writer = storage(checkpoint_id, storage_writer, NativeWriter, "writer")
    check_planner(planner, "save")
    async_saver.wait_for_async_saves()
    plain = stateful.resolve(state_dict, group)
    if no_dist:
        refuse_sharded(plain)
    return writer.write(plain, group)


def reader_class(path: str) -> type[StorageReader] | None:
    """The reader of the checkpoint format at ``path`` (looking at the file system only):
    native when it holds an ``index.json``, else torch DCP's when it holds a
    ``.metadata``; None when neither."""
    for reader in (NativeReader, FileSystemReader):
        if reader.recognizes(path):
            return reader
    return None


def no_checkpoint(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"no checkpoint at {path!r}: it holds neither an mpidtensor index.json "
                             "nor a torch.distributed.checkpoint .metadata")


def detect_reader(path: str, comm: MPI.Intracomm) -> StorageReader:
    """The reader for the checkpoint at ``path`` (:func:`reader_class`): rank 0 looks,
    all ranks agree; ``FileNotFoundError`` on every rank when there is none."""
    found = on_rank0(comm, reader_class, path)
    if found is None:
        raise no_checkpoint(path)
    return found(path)


def load(
    state_dict: Any,
    checkpoint_id: str | os.PathLike | None = None,
    *,
    storage_reader: StorageReader | None = None,
    planner: Any = None,
    process_group: MPI.Intracomm | None = None,
    no_dist: bool = False,
    comm: MPI.Intracomm | None = None,
) -> None:
    """Fill ``state_dict`` in place from ``checkpoint_id`` or ``storage_reader``: tensors
    and DTensors are copied into (each rank its part of its own layout, whatever layout
    and world size saved them), other values replaced; a ``Stateful`` gets its filled
    ``state_dict()`` through ``load_state_dict()``. Without a reader the format is the
    directory's (native, or torch DCP). Collective over ``process_group`` (``comm``).

    ``planner``: None or torch's ``DefaultLoadPlanner()`` (the same behaviour); others
    raise ``ValueError`` (the readers plan their reads by box intersection). A missing key, a shape or dtype mismatch (found before any
    data moves) or a corrupt file raises ``CheckpointError`` naming it on every rank.
    """
    group = communicator(process_group, comm, no_dist)
    if storage_reader is None and checkpoint_id is None:
        raise ValueError("give checkpoint_id (a directory) or storage_reader")
    check_planner(planner, "load")
    async_saver.wait_for_async_saves()
    if storage_reader is None:
        reader = detect_reader(os.fspath(checkpoint_id), group)
    else:
        reader = storage(checkpoint_id, storage_reader, NativeReader, "reader")
    targets = stateful.resolve(state_dict, group)
    reader.read(targets, group)
    stateful.restore(state_dict, targets, group)


__all__ = ["load", "save"]
