"""``async_save``: snapshot the state dict now, write it while training goes on.

The call (on the caller's thread) resolves ``Stateful`` objects, copies every tensor's
local shard into host buffers (a :class:`HostStager`; the training may change the
parameters as soon as it returns: the checkpoint holds the values of the call), reduces
the copies of ``Partial`` DTensors and duplicates the communicator (an ``allgather``
agrees on failures first, another on which DTensors are ``Partial``; the reductions and
``Dup`` are the only other collectives).
A background thread then runs the storage writer's ``write`` over the duplicate,
collectives included, and the returned ``concurrent.futures.Future`` resolves to what
``save`` returns (torch's ``Metadata``) when the checkpoint is committed. As torch
2.13 does, a stager whose ``stage`` returns a future makes ``async_save`` return an
``AsyncSaveResponse`` instead (``staging_completion``, ``upload_completion``); here its
staging future is already done on return: the Partial reductions and the agreement
need the staged copies on the caller's thread.

Why a duplicated communicator in a thread rather than keeping MPI out of the thread
and committing at the next ``save``/``async_save``/``result()``: the background
thread finishes the checkpoint on its own, so ``done()`` turns true without the
caller's help, a job that never calls ``result()`` on its last save (torch's async
recipe does not) still gets it committed before the interpreter exits (the thread is
joined before MPI finalizes), and any storage writer works unchanged. The duplicate
has its own context, so its collectives never match the training's (both run at the
same time; MPI must provide ``MPI_THREAD_MULTIPLE``, which mpi4py asks for). While it
waits for the other ranks, the thread polls a nonblocking barrier with short sleeps
before each collective instead of spinning inside MPI, which would take a core and
MPI's lock from the training. Where the library gives less than ``THREAD_MULTIPLE``,
``async_save`` warns and writes on the caller's thread (the future is done on return).

Errors: a staging failure on any rank raises from ``async_save`` on every rank; a
write failure on any rank is set on the future on every rank (``result()`` raises it)
and, as for ``save``, leaves the previous checkpoint loadable. ``save``, ``load`` and
``async_save`` first wait for this process's save in flight, so at most one runs and
they never race on a directory.
"""
from __future__ import annotations

import copy
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any

import torch
from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..runtime import watchdog
from ..tensor.dtensor import DTensor
from . import opaque, stateful, tree
from .arguments import check_planner, communicator, refuse_sharded, storage
from .formats.native import NativeWriter
from .shards import reduced
from .storage import StorageWriter


class AsyncCheckpointerType(Enum):
    """Where ``async_save`` writes: in a thread (the one kind supported: a separate
    process would not be part of the MPI job) or a process (refused)."""

    THREAD = "thread"
    PROCESS = "process"


class HostStager:
    """Copies a state dict's tensors into host memory (torch's ``AsyncStager`` protocol:
    ``stage``, ``should_synchronize_after_execute``, ``synchronize_staging``, ``close``).

    Every tensor leaf becomes a copy of its local data in a host buffer (a DTensor: of
    its local shard, wrapped with the same spec; ``async_save`` reduces the ``Partial``
    ones after; a subclass that is not bytes, :mod:`.opaque`, a zeroed one of its own kind
    it copies itself into, exactly: NF4's ``clone`` would re-quantize) and other values
    are deep-copied. With ``cache`` (the default) the
    buffers are kept for the next ``stage`` of a state dict with the same keys, shapes
    and dtypes: fresh memory costs a page fault per page on first touch, several times
    the copy itself, and keeping them is what makes the caller's share of an
    ``async_save`` small (benchmarks/bench_async_save.py). They hold as many bytes as
    this rank's tensors; ``close()`` frees them.
    """

    should_synchronize_after_execute = False

    def __init__(self, cache: bool = True) -> None:
        self.cache = cache
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state_dict: Any) -> Any:
        buffers, staged = {}, []
        for path, leaf in tree.flatten(state_dict):
            if isinstance(leaf, torch.Tensor):
                key = tree.fqn(path)
                local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
                buffer = self._buffers.get(key)
                if opaque.class_name(local) is not None:  # no bytes to copy: a copy of its own kind
                    buffer = local.detach().cpu().new_zeros(local.shape)
                elif buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                    buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu")
                buffer.copy_(local.detach())
                buffers[key] = buffer
                leaf = DTensor(buffer, leaf._spec) if isinstance(leaf, DTensor) else buffer
            else:
                leaf = copy.deepcopy(leaf)
            staged.append((path, leaf))
        self._buffers = buffers if self.cache else {}
        return tree.unflatten(staged)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` copies before it returns."""

    def close(self) -> None:
        self._buffers = {}


_DEFAULT_STAGER = HostStager()
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidtensor-async-save")
_in_flight: list[Future] = []
_warned = threading.Event()


def threads_may_call_mpi() -> bool:
    """Whether a background thread may run MPI calls while the caller's thread does."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def wait_for_async_saves() -> None:
    """Wait for this process's ``async_save`` in flight (its errors stay in its future)."""
    while _in_flight:
        future = _in_flight.pop(0)
        future.exception()


class _PatientComm(MPI.Intracomm):
    """An intracommunicator whose collectives first wait for every rank to arrive by
    polling a nonblocking barrier with short sleeps (the caller's thread keeps the core
    and MPI's lock meanwhile), then run at once."""

    def _arrive(self, name: str) -> None:
        watchdog.poll(self.Ibarrier(), "async checkpoint write: every rank's arrival (nonblocking barrier)", self,
                      f"before its {name}")


def _patient(name: str):
    collective = getattr(MPI.Intracomm, name)

    def call(self: _PatientComm, *args, **kwargs):
        self._arrive(name)
        return collective(self, *args, **kwargs)

    call.__name__ = name
    return call


for _name in ("barrier", "Barrier", "bcast", "Bcast", "gather", "Gather", "Gatherv", "allgather", "Allgather",
              "Allgatherv", "allreduce", "Allreduce", "reduce", "Reduce", "scatter", "Scatter", "Scatterv",
              "alltoall", "Alltoall", "Alltoallv", "Reduce_scatter"):
    setattr(_PatientComm, _name, _patient(_name))


def _write_in_background(writer: StorageWriter, staged: Any, comm: MPI.Intracomm) -> Metadata:
    try:
        return writer.write(staged, comm)
    finally:
        comm.Free()


def _check_checkpointer_type(kind: Any) -> None:
    value = getattr(kind, "value", kind)
    if kind is not None and value != AsyncCheckpointerType.THREAD.value:
        raise ValueError(f"async_checkpointer_type {kind!r} is not supported: a separate process would not be "
                         "part of the MPI job; use AsyncCheckpointerType.THREAD (the default)")


def _partial_names(state_dict: Any) -> tuple[str, ...]:
    return tuple(tree.fqn(path) for path, leaf in tree.flatten(state_dict)
                 if isinstance(leaf, DTensor) and any(p.is_partial() for p in leaf.placements))


def _snapshot(stager: Any, state_dict: Any, comm: MPI.Intracomm, no_dist: bool) -> tuple[Any, bool]:
    """``state_dict`` with its Stateful objects resolved, staged by ``stager`` (a future's
    result when it gives one), then its ``Partial`` DTensors reduced; and whether the
    stager gave a future. Collective: every rank agrees on failures, then on which
    DTensors are Partial, before any reduction."""
    staged, partial, gave_future = None, (), False
    plain, failure, cause = stateful.resolve_here(state_dict)
    if failure is None:
        try:
            if no_dist:
                refuse_sharded(plain)
            staged = stager.stage(plain)
            gave_future = isinstance(staged, Future)
            if gave_future:
                staged = staged.result()
            partial = _partial_names(staged)
        except Exception as err:  # noqa: BLE001  (raised on every rank by agree)
            failure, cause = f"async_save could not stage the state dict: {type(err).__name__}: {err}", err
    stateful.agree(comm, failure, cause)
    # each rank decides alike from every rank's names
    partials = watchdog.call("async_save: every rank's Partial DTensor names (allgather)", comm, comm.allgather,
                             partial)
    differing = [rank for rank, names in enumerate(partials) if names != partials[0]]
    if differing:
        raise ValueError(f"async_save: the state dict on ranks {differing} differs from rank 0's in its "
                         f"Partial DTensors ({list(partials[differing[0]])} against {list(partials[0])})")
    if partial:
        staged = tree.unflatten([(path, reduced(leaf)) for path, leaf in tree.flatten(staged)])
    return staged, gave_future


def async_save(
    state_dict: Any,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: Any = None,
    process_group: MPI.Intracomm | None = None,
    async_checkpointer_type: AsyncCheckpointerType | None = None,
    async_stager: Any = None,
    no_dist: bool = False,
    comm: MPI.Intracomm | None = None,
) -> Future | AsyncSaveResponse:
    """``save`` in the background: returns once the state is copied to host memory; the
    future's ``result()`` is what ``save`` returns (torch's ``Metadata``, the same on
    every rank) when the checkpoint is committed, or raises (on every rank) the error
    any rank met writing it. Collective over ``process_group``.

    Returns torch's ``AsyncSaveResponse`` instead where torch 2.13 does: when the
    stager's ``stage`` returns a future. Its ``staging_completion`` (result None) is done
    on return, ``upload_completion`` is the future above.

    ``async_stager``: an object with torch's ``AsyncStager`` methods (``stage`` gives a
    state dict the caller will not change; default: a shared :class:`HostStager`, which
    keeps its buffers for the next call). ``async_checkpointer_type``: None or THREAD.
    ``storage_writer``, ``planner``, ``no_dist`` as for ``save``.
    """
    group = communicator(process_group, comm, no_dist)
    writer = storage(checkpoint_id, storage_writer, NativeWriter, "writer")
    check_planner(planner, "save")
    _check_checkpointer_type(async_checkpointer_type)
    wait_for_async_saves()
    stager = _DEFAULT_STAGER if async_stager is None else async_stager
    staged, gave_future = _snapshot(stager, state_dict, group, no_dist)
    if getattr(stager, "should_synchronize_after_execute", False):
        stager.synchronize_staging()
    if not threads_may_call_mpi():
        if not _warned.is_set():
            _warned.set()
            warnings.warn("MPI does not provide MPI_THREAD_MULTIPLE: async_save writes on the calling thread",
                          stacklevel=2)
        future: Future = Future()
        try:
            future.set_result(writer.write(staged, group))
        except Exception as err:  # noqa: BLE001  (the same error on every rank: the writer agrees on it)
            future.set_exception(err)
    else:
        future = _EXECUTOR.submit(_write_in_background, writer, staged, 
                                  _PatientComm(watchdog.call("async_save: the writer's communicator (Dup)", group,
                                                             group.Dup)))
        _in_flight.append(future)
    if not gave_future:
        return future
    staging: Future = Future()
    staging.set_result(None)
    return AsyncSaveResponse(staging_completion=staging, upload_completion=future)
