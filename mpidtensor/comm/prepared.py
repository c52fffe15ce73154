"""Prepared collectives: one collective bound to a communicator and an input signature.

A prepared collective checks its arguments and chooses its algorithm, counts, copies and
datatypes when it is made; a call on a host tensor of its signature then goes straight to
MPI. Redistribution plans, FSDP's reduce-scatters and the tensor-parallel gathers keep one
per signature, so a repeated collective pays for the general functions' work once. Each
kind makes its own (``gather.prepare_all_gather``, ...; all exported by ``collectives``)
from the layout and the MPI call its general function uses.
"""
from __future__ import annotations

import weakref
from math import prod
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import base, guard, recorders
from ..runtime import watchdog
from .base import Types, limits
from .buffers import stage


class Prepared:
    """One collective bound to a communicator and an input signature (shape and dtype),
    its arguments checked and its algorithm, counts and datatypes chosen when made.

    Calling it on a host tensor of that signature goes straight to MPI (after ``stage``: a
    contiguous copy if it is not C-contiguous), watched by the watchdog, with debug mode off and the
    thresholds as they were; any other input, or debug mode on, takes the general function (which
    checks and stages as usual). ``fast`` is the collective as a function of a staged host
    tensor, its constants bound (a kind's runner with ``host=True``); ``owned``: derived
    datatypes made for it alone (:func:`owned_types`), freed with it. Redistribution
    steps keep one per plan (docs/performance.md, "Where the time goes at 4 KiB")."""

    __slots__ = ("kind", "comm", "shape", "dtype", "nbytes", "complex", "limits", "fast", "general",
                 "__weakref__")

    def __init__(self, kind: str, comm: MPI.Intracomm, shape: Sequence[int], dtype: torch.dtype,
                 fast: Callable[[torch.Tensor], torch.Tensor] | None,
                 general: Callable[[torch.Tensor], torch.Tensor], owned: Sequence[MPI.Datatype] = ()) -> None:
        self.kind, self.comm, self.shape, self.dtype = kind, comm, torch.Size(shape), dtype
        self.nbytes = prod(shape) * dtype.itemsize
        self.complex = dtype.is_complex  # only a complex tensor can carry the conjugate bit
        self.limits = limits()
        self.fast = fast  # None: this signature always takes the general function
        self.general = general
        if owned:
            weakref.finalize(self, free_types, owned)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if (type(tensor) is torch.Tensor and tensor.shape == self.shape and tensor.dtype is self.dtype
                and self.fast is not None and not tensor.is_cuda and not guard.ENABLED
                # ``limits()`` inline (attribute reads, not a Python call per collective)
                and (base.MAX_COUNT, base.ALLGATHER_PADDED_MIN, base.ALLTOALL_PACKED_MIN, base.ALLTOALL_PACK_SEND_MIN,
                     base.GATHER_TYPED_MAX) == self.limits):
            if recorders.ACTIVE:
                recorders.record(self.kind, self.nbytes)
            if (tensor.requires_grad or not tensor.is_contiguous() or tensor.is_neg()
                    or (self.complex and tensor.is_conj())):
                tensor = stage(tensor)  # what ``stage`` would return as it is, checked inline
            if not watchdog.ENABLED:
                return self.fast(tensor)
            return watchdog.call(self.kind, self.comm, self.fast, tensor, details=self)
        return self.general(tensor)

    def __str__(self) -> str:
        """The collective's input in words (the watchdog's report)."""
        return f"prepared for shape {tuple(self.shape)}, dtype {self.dtype} ({self.nbytes} bytes)"


class BySignature:
    """One collective of one kind on ``comm``, prepared the first time each input shape and
    dtype comes (``prepare(shape, dtype, comm, **options)``: a kind's ``prepare_*``); a call
    runs that prepared collective. For callers that repeat a collective on tensors of a few
    signatures (a norm's parameter gradients, a loss's row statistics, FSDP's
    reduce-scatters), where the general function would check, stage and lay out each call
    (~20 Python calls against ~10). It holds ``comm``: keep it no longer than the mesh."""

    __slots__ = ("prepare", "comm", "options", "runs")

    def __init__(self, prepare: Callable[..., Prepared], comm: MPI.Intracomm, **options) -> None:
        self.prepare, self.comm, self.options = prepare, comm, options
        self.runs: dict[tuple[torch.Size, torch.dtype], Prepared] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.shape, tensor.dtype)
        try:
            run = self.runs[key]
        except KeyError:
            run = self.runs[key] = self.prepare(tensor.shape, tensor.dtype, self.comm, **self.options)
        return run(tensor)


def owned_types() -> tuple[list[MPI.Datatype], Types]:
    """``(owned, own)``: ``own(key, make)`` commits a datatype of a prepared collective's own
    (the ``types`` a kind's runner takes), listed in ``owned`` to be freed with it: the
    shared ``derived`` cache could free one it still uses."""
    owned: list[MPI.Datatype] = []

    def own(key, make):
        owned.append(make().Commit())
        return owned[-1]
    return owned, own


def free_types(types: list[MPI.Datatype]) -> None:
    """Free the datatypes a collective committed for itself alone (nothing to free once MPI
    is finalized: the process is ending); a ``weakref.finalize`` callback of their owner."""
    if not MPI.Is_finalized():
        for datatype in types:
            datatype.Free()
