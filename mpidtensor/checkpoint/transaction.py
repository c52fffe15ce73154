"""The one checkpoint transaction: every format's save and load run these steps, and a
format supplies only its encoding (a :class:`SaveFormat` / :class:`LoadFormat`
subclass: the native format, torch DCP's, safetensors; see :mod:`.formats`).

save (:func:`save`), collective over ``comm``:

1. where ranks hold different keys (pipeline stages), each takes the union
   (:func:`.union.complete`); the state dict is flattened the format's way
   (:meth:`SaveFormat.leaves`);
2. rank 0 prepares the directory (:meth:`~SaveFormat.prepare`: creates it, names this
   save's files so that they collide with no committed checkpoint's) and every rank
   learns the outcome;
3. one ``allgather`` of the leaves' metadata (keys, global shapes, dtypes, the box each
   rank holds) decides on every rank alike who writes each distinct box (:mod:`.shards`),
   and the format plans from those shared facts (:meth:`~SaveFormat.plan`: refuses what
   it cannot hold on every rank, before any data moves);
4. ``Partial`` DTensors are reduced (every rank, in leaf order);
5. a file that several ranks write into is created first by one of them
   (:meth:`~SaveFormat.create`), every rank agreeing that all exist;
6. each rank writes its boxes (:meth:`~SaveFormat.write_boxes`);
7. rank 0 gathers what every rank wrote and commits (:meth:`~SaveFormat.commit`: one
   atomic rename makes the save the checkpoint) unless some rank failed; on any error
   each rank removes the files it made (:meth:`~SaveFormat.own_files`) and every rank
   raises the same error, so a failed save leaves the previous checkpoint loadable;
8. the files the commit superseded are removed by all ranks together;
9. every rank returns the same torch ``Metadata`` (:meth:`~SaveFormat.metadata`).

load (:func:`load`): the targets flattened the format's way; rank 0 reads the
checkpoint's description (:meth:`LoadFormat.open`: an index, a ``.metadata``, headers)
for every rank; one ``allgather`` of the targets' metadata, checked against what the
checkpoint holds (:meth:`~LoadFormat.contents`, :func:`target_errors`: keys, kinds,
shapes, dtypes, subclass layouts), raised on every rank before any data moves; each rank
fills its boxes (:meth:`~LoadFormat.read_boxes`); one
``allgather`` agrees on errors and on problems found (checksums); the values of the
non-tensor leaves are put back into the state dict.

Each step that can fail on some ranks only is agreed through :mod:`..runtime.agreement`
(the commit is its :func:`~..runtime.agreement.gather_to_rank0`); :func:`remove_stale` is
the one step of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch
from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata

from ..runtime.agreement import attempt, exchange, gather_to_rank0, on_rank0, raise_agreed, raise_listed
from . import io, opaque, shards, tree, union
from .errors import CheckpointError
from ..runtime import watchdog
from .metadata import gc_paused, torch_leaves
from .storage import StorageReader, StorageWriter

__all__ = ["Job", "LoadFormat", "SaveFormat", "SavedTensor", "load", "remove_stale", "save", "start_save",
           "target_errors"]


@dataclass
class Job:
    """One save or load, as a format's steps see it: what every rank shares."""

    directory: str
    comm: MPI.Intracomm
    state_dict: Any
    leaves: list  # the format's leaves, in order; each has ``fqn``, ``value`` and ``keys``
    metas: list[list[tuple]]  # every rank's ``(fqn, TensorMeta or None)`` of each leaf (:func:`.shards.leaf_meta`)
    saved: Any  # save: what ``prepare`` gave (a token); load: what ``open`` gave (the checkpoint's description)
    writers: list[dict[tuple, int]] = field(default_factory=list)  # save: per leaf, each box's writing rank
    plan: Any = None  # save: what the format's ``plan`` gave

    @property
    def rank(self) -> int:
        return self.comm.rank

    def meta(self, i: int) -> tuple:
        """This rank's ``(fqn, TensorMeta or None)`` of leaf ``i``."""
        return self.metas[self.comm.rank][i]

    def writes(self) -> bool:
        """Whether this rank writes a box of some tensor."""
        return any(self.comm.rank in leaf_writers.values() for leaf_writers in self.writers)

    def boxes(self, i: int) -> list[tuple]:
        """Every rank's box of the tensor leaf ``i``, in rank order (None for a rank whose
        state dict lacks it: load targets may differ between ranks, e.g. pipeline stages)."""
        key = self.meta(i)[0]
        return [metas[i][1][2] if i < len(metas) and metas[i][0] == key else boxes.get(key)
                for metas, boxes in zip(self.metas, self._boxes_by_key)]

    @cached_property
    def _boxes_by_key(self) -> list[dict[str, tuple]]:
        return [{key: meta[2] for key, meta in metas if meta is not None} for metas in self.metas]


class SavedTensor(NamedTuple):
    """A tensor leaf as a checkpoint holds it: what a load checks its targets against."""

    shape: tuple[int, ...]
    dtype: str  # its name (:data:`.shards.DTYPE_NAMES`; torch's for a dtype without one)
    boxes: list[tuple]  # the saved boxes, ``(start, shape)``
    cls: Any  # the subclass stored opaquely (:mod:`.opaque`), None for a plain tensor, ``...`` when unknown


class SaveFormat(StorageWriter):
    """A storage writer whose ``write`` is :func:`save`; a format subclasses it with its
    encoding. The steps run on every rank unless they say otherwise."""

    #: Whether several ranks write into one file (which :meth:`create` makes first).
    shares_files = False

    def write(self, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
        """Write ``state_dict``; the torch ``Metadata`` of the save, alike on every rank."""
        return save(self, state_dict, comm)

    def leaves(self, state_dict: Any) -> list:
        """The state dict flattened as the format stores it (each leaf with ``fqn``,
        ``value`` and ``keys``)."""
        return tree.leaves(state_dict)

    def prepare(self, state_dict: Any) -> Any:
        """Rank 0 alone, before any data moves: the directory made ready; what names this
        save's files (:attr:`Job.saved`)."""
        raise NotImplementedError

    def plan(self, job: Job) -> Any:
        """What the format decides from the facts every rank shares (:attr:`Job.plan`);
        it raises alike on every rank for what the format cannot hold."""
        return None

    def own_files(self, job: Job) -> list[str]:
        """The files this rank may create in this save (removed when it fails)."""
        raise NotImplementedError

    def create(self, job: Job) -> None:
        """The files that several ranks write into, created by their owners (only when
        :attr:`shares_files`)."""

    def write_boxes(self, job: Job, boxes: list[tuple[int, torch.Tensor]]) -> Any:
        """Write this rank's boxes (``(leaf index, tensor)``, ``Partial`` ones reduced);
        what rank 0 needs to know of them to commit."""
        raise NotImplementedError

    def commit(self, job: Job, parts: list) -> tuple[Any, list[str]]:
        """Rank 0 alone, once every rank wrote its ``parts`` (in rank order): the save made
        the checkpoint atomically; ``(what the metadata step needs, the files superseded)``."""
        raise NotImplementedError

    def metadata(self, job: Job, committed: Any) -> Metadata:
        """The torch ``Metadata`` of the save, alike on every rank (``committed``: what
        :meth:`commit` gave, on every rank)."""
        raise NotImplementedError


class LoadFormat(StorageReader):
    """A storage reader whose ``read`` is :func:`load`; a format subclasses it with its
    decoding."""

    #: Why the format holds only tensors, when it does (a value target is refused with it).
    values_refused: str | None = None

    def read(self, state_dict: Any, comm: MPI.Intracomm) -> None:
        """Fill ``state_dict`` in place from the checkpoint. Collective."""
        load(self, state_dict, comm)

    def leaves(self, state_dict: Any) -> list:
        """The targets flattened as the format stores them (see :meth:`SaveFormat.leaves`)."""
        return tree.leaves(state_dict)

    def open(self) -> Any:
        """Rank 0 alone: the checkpoint's description (:attr:`Job.saved`), which every rank
        gets; ``FileNotFoundError`` or ``CheckpointError`` when there is none or it is corrupt."""
        raise NotImplementedError

    def contents(self, job: Job) -> dict[str, SavedTensor | None]:
        """Each saved leaf by flat key, from :attr:`Job.saved`: a tensor's
        :class:`SavedTensor`, None for a value."""
        raise NotImplementedError

    def read_boxes(self, job: Job) -> tuple[list[str], dict[int, Any]]:
        """Fill this rank's box of each tensor target; the problems found in the data
        (checksum mismatches) and the saved values of the other leaves, by leaf index."""
        raise NotImplementedError


def save(fmt: SaveFormat, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
    """Write ``state_dict`` through ``fmt`` (the steps in the module docstring)."""
    state_dict = union.complete(state_dict, comm)
    leaves = fmt.leaves(state_dict)
    token = on_rank0(comm, fmt.prepare, state_dict)
    metas = shards.gather_metas([shards.leaf_meta(leaf.fqn, leaf.value) for leaf in leaves], comm)
    job = Job(fmt.path, comm, state_dict, leaves, metas, token, shards.box_writers(metas))
    job.plan = fmt.plan(job)
    mine = shards.boxes_to_write(job.writers, comm.rank)
    boxes = []
    for i, leaf in enumerate(leaves):  # every rank reduces the Partial DTensors, in the same order
        if isinstance(leaf.value, torch.Tensor):
            value = shards.reduced(leaf.value)
            if i in mine:
                boxes.append((i, value))
    own = fmt.own_files(job)
    try:
        if fmt.shares_files:
            raise_agreed(comm, attempt(fmt.create, job)[1])  # all exist before any rank writes into one
        part, error = attempt(fmt.write_boxes, job, boxes)
        with gc_paused():  # a commit may hand on a large Metadata: rank 0 builds it, the others unpickle it
            committed, stale = gather_to_rank0(comm, part, error, lambda parts: fmt.commit(job, parts))
    except Exception:
        io.remove_files(job.directory, own)  # no committed checkpoint names them
        raise
    remove_stale(comm, job.directory, stale)
    with gc_paused():
        return fmt.metadata(job, committed)


def load(fmt: LoadFormat, state_dict: Any, comm: MPI.Intracomm) -> None:
    """Fill ``state_dict`` in place through ``fmt`` (the steps in the module docstring)."""
    leaves = fmt.leaves(state_dict)
    saved = on_rank0(comm, fmt.open)
    metas = [shards.leaf_meta(leaf.fqn, leaf.value) for leaf in leaves]
    unloadable = [shards.unloadable(leaf.fqn, leaf.value) for leaf in leaves]
    gathered = exchange(comm, (metas, [p for p in unloadable if p]))
    job = Job(fmt.path, comm, state_dict, leaves, [metas for metas, _ in gathered], saved)
    raise_listed(target_errors(fmt.contents(job), job.metas, fmt.values_refused)
                 + [p for _, problems in gathered for p in problems], CheckpointError)
    outcome, error = attempt(fmt.read_boxes, job)
    problems, values = outcome if error is None else ([], {})
    found = exchange(comm, problems, error)
    raise_listed([p for rank_problems in found for p in rank_problems], CheckpointError)
    for i, value in values.items():
        tree.put(state_dict, leaves[i].keys, value)


def target_errors(contents: dict[str, SavedTensor | None], metas_by_rank: list[list[tuple]],
                  values_refused: str | None = None) -> list[str]:
    """Why the targets (every rank's metadata: the same verdict on every rank) do not fit
    the checkpoint's ``contents``: a missing key, a value for a tensor or the reverse, a
    shape or dtype mismatch, a plain tensor for a subclass or the reverse, a subclass
    whose target boxes are not saved ones (opaque blocks are not resharded)."""
    errors, opaque_targets = [], {}
    for metas in metas_by_rank:
        for key, meta in metas:
            saved = contents.get(key, False)
            if meta is None and values_refused:
                errors.append(f"{key!r} is not a tensor; {values_refused}")
            elif saved is False:
                errors.append(f"missing key {key!r} in the checkpoint")
            elif (meta is None) != (saved is None):
                kinds = ("a value", "a tensor")
                errors.append(f"{key!r} is {kinds[meta is not None]} in the state dict but "
                              f"{kinds[saved is not None]} in the checkpoint")
            elif meta is not None:
                if tuple(meta[0]) != saved.shape:
                    errors.append(f"shape mismatch for {key!r}: checkpoint {saved.shape}, state dict {tuple(meta[0])}")
                if meta[1] != saved.dtype:
                    errors.append(f"dtype mismatch for {key!r}: checkpoint {saved.dtype}, state dict {meta[1]}")
                if saved.cls is not ...:
                    errors.append(opaque.kind_error(key, saved.cls, meta[3]))
                cls = meta[3] if saved.cls is ... else saved.cls
                if cls is not None:
                    opaque_targets.setdefault(key, (cls, saved.boxes, []))[2].append(meta[2])
    for key, (cls, boxes, targets) in opaque_targets.items():
        errors.append(opaque.layout_error(key, cls, boxes, targets))
    return [e for e in errors if e]


def remove_stale(comm: MPI.Intracomm, directory: str, names: list[str]) -> None:
    """The files ``names`` (the same list on every rank) that a commit superseded, removed
    by all ranks in parallel (unlinking is slow); returns once every rank is done."""
    if names:
        io.remove_files(directory, names[comm.rank::comm.size])
        watchdog.call("checkpoint: every rank done removing superseded files (Barrier)", comm, comm.Barrier)


def start_save(directory: str, state_dict: Any) -> str:
    """A format's :meth:`~SaveFormat.prepare` on rank 0: ``directory`` created if missing,
    once ``state_dict`` is known to flatten torch's way (the ``Metadata`` that ``save``
    returns needs it: one torch cannot flatten fails on every rank, writing nothing); a
    new token naming this save's files."""
    torch_leaves(state_dict)
    os.makedirs(directory, exist_ok=True)
    return io.new_token()
