"""The collectives of one FSDP group, replaceable as in torch, and the gradient scaling.

``set_custom_all_gather(comm)`` / ``set_custom_reduce_scatter(comm)`` take objects of the
shape of torch's ``AllGather`` / ``ReduceScatter`` (``torch.distributed.fsdp``'s ``Comm``
classes, or any object with the same two methods): ``allocate(size, *, dtype, device)``
returns the buffer a collective reads or writes, and ``comm(output_tensor=...,
input_tensor=..., group=..., [op=...,] async_op=True)`` runs it. mpidtensor has no
ProcessGroup: ``group`` is the mpi4py communicator of the mesh's shard dim, and the
reduce-scatter's ``op`` is ``"sum"`` (FSDP scales separately, see ``divide_factors``: torch's
``PREMUL_SUM`` is a scaling of each rank's term before this sum).
The call may return an object with ``wait()`` (a started collective) or ``None`` (done).
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Sequence

import torch
from mpi4py import MPI

from ..runtime import progress
from ..comm.nonblocking import Handle, iall_gather, iall_reduce, ireduce_scatter
from ..comm.buffers import reuse
from ..comm.pool import pool, tracked_empty
from ..comm.collectives import BySignature, prepare_reduce_scatter
from .packing import cat_rows, pack_ranks


class _Done:
    """A custom collective's work (``wait()``-able, or ``None`` if it already finished)
    and the tensor it fills, behind the ``Handle`` interface."""

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


def check_comm(comm: Any, kind: str) -> None:
    """Raise ``TypeError`` unless ``comm`` has ``allocate`` and is callable, as torch's ``Comm``."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(f"a custom {kind} needs allocate(size, *, dtype, device) and __call__ (torch's "
                        f"{kind} interface), got {type(comm).__name__}")


def allocate(custom: Any, size: Sequence[int], dtype: torch.dtype, device: torch.device,
             reusable: bool = False) -> torch.Tensor:
    """A communication buffer: from the custom comm's ``allocate`` if there is one; a
    ``reusable`` host buffer (dropped once its collective is done) from the buffer pool,
    which saves faulting in fresh pages every step."""
    if custom is None:
        if reusable and device.type == "cpu" and pool.limit_bytes:
            return pool.take(tuple(size), dtype)
        return tracked_empty(tuple(size), dtype, device)
    return custom.allocate(tuple(size), dtype=dtype, device=device)


def start_all_gather(custom: Any, send: torch.Tensor, comm: MPI.Intracomm, out: torch.Tensor) -> Handle | _Done:
    """Start gathering every rank's ``send`` into ``out``; ``wait()`` returns ``out``. On a
    one-rank group there is nothing to gather: ``send`` is copied, no collective runs,
    custom or not (as torch's FSDP, which skips collectives on a one-rank mesh)."""
    if comm.size == 1:  # copied as MPI writes: the unsharded parameters' version counter (which
        # autograd checks for the tensors a forward saved) stays as it is
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.view(-1).copy_(send.view(-1))
        return _Done(None, out)
    if custom is None:
        return iall_gather(send, comm, out=out)
    return _Done(custom(output_tensor=out, input_tensor=send, group=comm, async_op=True), out)


def reduce_scatters(comm: MPI.Intracomm) -> BySignature:
    """FSDP's reduce-scatters over ``comm`` (``start_reduce_scatter``'s), prepared by signature."""
    return BySignature(prepare_reduce_scatter, comm, op="sum", dim=0, sizes=(1,) * comm.size)


def start_reduce_scatter(custom: Any, send: torch.Tensor, scatters: BySignature) -> Handle | _Done:
    """Start summing the 1-D ``send`` over ``scatters``' communicator; ``wait()`` returns this
    rank's piece.

    Without a custom collective and with MPI progress ``"off"`` (the default: nothing moves
    a started collective before its wait) this is the blocking ``Reduce_scatter``, done on
    return: MPICH's non-blocking one costs more CPU, and FSDP's wait for it would move all
    of its data anyway (docs/performance.md, "FSDP step"), prepared once per size and dtype
    (``scatters``, from :func:`reduce_scatters`: later calls go to MPI)."""
    comm = scatters.comm
    piece = send.numel() // comm.size
    if comm.size == 1:  # nothing to reduce, custom or not (as torch's FSDP on a one-rank mesh)
        return _Done(None, send)
    if custom is None:
        if progress.mode() == "off":
            return _Done(None, scatters(send.view(comm.size, piece)).view(piece))
        return ireduce_scatter(send, comm, "sum", out=allocate(None, (piece,), send.dtype, send.device))
    out = allocate(custom, (piece,), send.dtype, send.device)
    return _Done(custom(output_tensor=out, input_tensor=send, group=comm, op="sum", async_op=True), out)


class GroupScatter:
    """The reduce-scatter of one FSDP group's gradients over ``comm`` in ``dtype``, worked out
    once per group (``GradientReduction._scatter``): the (world, total) send rows from a reused
    pooled buffer, whether one ``torch.cat`` packs them (every gradient split evenly along dim 0,
    in ``dtype``: ``packing.cat_rows``, ``pack_ranks``' first case, its checks made here) and the prepared
    ``Reduce_scatter`` (its count, datatype and output buffer made once). For host buffers over
    2+ ranks with torch's default collective and MPI progress ``"off"`` (then
    ``start_reduce_scatter`` is this same blocking call): ~8 Python calls a group fewer."""

    __slots__ = ("count", "shapes", "cat", "sends", "run")

    def __init__(self, params: list, comm: MPI.Intracomm, dtype: torch.dtype) -> None:
        world = comm.size
        total = sum(p.shard_numel for p in params)
        self.count = len(params)  # the sharded parameters it was made for (a backward may reduce fewer)
        self.shapes = [(world, p.shard_numel) for p in params]
        self.cat = all(p.pre == 1 and p.rows == p.pad_rows * world and p.param_dtype == dtype for p in params)
        self.sends = reuse((world, total), dtype)
        self.run = prepare_reduce_scatter((world, total), dtype, comm, "sum", dim=0, sizes=(1,) * world)

    def start(self, grads: list[tuple[Any, torch.Tensor]], pre: float | None) -> _Done:
        """Pack ``grads`` ((parameter, unsharded gradient), the group's sharded parameters in
        order), divide by ``pre`` and reduce-scatter: done on return."""
        send = self.sends.take()[0]
        if not (self.cat and cat_rows(send, map(_second, grads), self.shapes)):
            pack_ranks(send, grads)
        divide(send, pre)
        return _Done(None, self.run(send).view(-1))


def start_all_reduce(flat: torch.Tensor, comm: MPI.Intracomm) -> Handle | _Done:
    """Start summing ``flat`` in place over ``comm`` (nothing to do on one rank)."""
    if comm.size == 1:
        return _Done(None, flat)
    return iall_reduce(flat, comm, "sum", inplace=True)


def divide_factors(dp_size: int, factor: float | None, reduce_dtype: torch.dtype,
                   force_sum: bool, shard_size: int | None = None) -> tuple[float | None, float | None, float | None]:
    """``(pre, with_comm, post)``: the gradient sum over the data-parallel ranks is divided
    by ``factor`` (default ``dp_size``) as torch's FSDP2 splits it. ``pre`` divides before
    the reduce-scatter, ``with_comm`` right after the collectives, ``post`` after the
    all-reduce hook. In float32/bfloat16 without ``force_sum`` torch reduces with ``AVG``
    (no factor, or the shard group's size: sum, then divide: ``with_comm``) or with
    ``PREMUL_SUM(1 / factor)`` (any other factor: each rank's term scaled, then summed:
    ``pre``, which the reduction then sums); either way the all-reduce hook sees the
    scaled result. In other dtypes about the factor's square root goes before the sum and
    the rest after (less overflow); with ``force_sum`` in float32/bfloat16, all of it after
    the hook."""
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None or factor == shard_size:
            return None, float(dp_size if factor is None else factor), None
        return float(factor), None, None
    factor = float(dp_size if factor is None else factor)
    if not overflow_risk:
        return None, None, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), None, factor / pre


def divide(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


_second = itemgetter(1)


class NoGather:
    """The all-gather of a group with nothing to gather (only replicated parameters)."""

    @staticmethod
    def wait() -> None:
        return None


NO_GATHER = NoGather()
NO_INPUTS: dict[int, tuple[torch.Tensor, ...]] = {}  # the all-gather inputs of a group without extensions
