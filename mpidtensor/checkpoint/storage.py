"""Where ``save`` writes and ``load`` reads: the storage protocol behind the
``storage_writer=`` / ``storage_reader=`` arguments.

``save`` and ``load`` resolve ``Stateful`` objects first, then hand the plain nested
state dict (DTensors, tensors and other values) to a writer or reader. Each format is
one pair of classes: the native format (the default), torch DCP's file layout and
Hugging Face safetensors. Both methods are collective over ``comm`` and must raise
the same error on every rank; ``write`` returns the torch ``Metadata`` of what it
wrote, the same on every rank (:mod:`.metadata`), which ``save`` returns.
``async_save`` calls ``write`` from a background thread with a duplicate of the
caller's communicator and a staged state dict (host copies, no ``Partial`` DTensors
left), while the caller's thread runs the training's collectives: a writer must
communicate over ``comm`` only, never over the meshes of the DTensors it is given.
"""
from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata


class StorageWriter:
    """Writes a state dict to ``path`` (a directory)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def write(self, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
        """Write ``state_dict`` (nested dicts/lists of DTensors, tensors and values); the
        torch ``Metadata`` describing what was written. Collective."""
        raise NotImplementedError


class StorageReader:
    """Reads a checkpoint at ``path`` into a state dict of targets."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        """Whether ``path`` holds a checkpoint in this reader's format (``load`` picks
        the reader by this when none is given). Looks at the file system only."""
        raise NotImplementedError

    def read(self, state_dict: Any, comm: MPI.Intracomm) -> None:
        """Fill ``state_dict`` in place: tensors and DTensors are copied into (each rank
        its own part of the target layout), other values replaced. Collective."""
        raise NotImplementedError
