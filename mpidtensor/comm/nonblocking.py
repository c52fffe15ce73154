"""Non-blocking collectives on flat torch tensors: start now, ``wait()`` later.

They exist so that FSDP can issue the next parameter group's all-gather (or the
last group's reduce-scatter) and keep computing while MPI moves the data. Each
returns a :class:`Handle`; the result is valid only after ``handle.wait()``, and the
buffers stay referenced by the handle until then. Every rank must start the same
collectives on a communicator in the same order (MPI's rule for non-blocking
collectives). Each start reports itself to ``recorders.record`` like the blocking ones.

Inputs are 1-D C-contiguous tensors whose size is a multiple of the communicator
size where pieces are involved (FSDP pads every shard to the same length), so the
regular ``Iallgather`` / ``Ireduce_scatter_block`` apply rather than their ``v`` forms.
"""
from __future__ import annotations

from typing import Callable

import torch
from mpi4py import MPI

from ..runtime import progress, watchdog
from . import recorders
from .base import ReduceOp, reduction
from .buffers import as_buffer, empty, from_address, mpi_type, reuse, stage


class Handle:
    """A started collective; ``wait()`` completes it and returns its result tensor."""

    __slots__ = ("_request", "_keep", "_finish", "_result", "_what")

    def __init__(self, request: MPI.Request, keep: tuple, finish: Callable[[], torch.Tensor],
                 what: tuple[str, MPI.Intracomm, dict]) -> None:
        self._request = request
        self._what = what  # (kind, communicator, sizes) for the watchdog's report
        self._keep = keep  # buffers MPI reads or writes until completion
        self._finish = finish
        self._result: torch.Tensor | None = None
        progress.started(self)

    def wait(self) -> torch.Tensor:
        """Block until the collective is done (idempotent); return its result."""
        if self._request is not None:
            watchdog.wait(self._request, *self._what)
            progress.finished(self)
            self._request = None
            self._result = self._finish()
            self._keep = self._finish = None
        return self._result

    def done(self) -> bool:
        """Whether ``wait()`` has completed."""
        return self._request is None

    def test(self) -> bool:
        """Let MPI progress the collective (one ``MPI_Test``) without waiting for it;
        whether its data has arrived (``wait()`` still returns the result)."""
        return self._request is None or self._request.Test()


def iall_gather(send: torch.Tensor, comm: MPI.Intracomm, out: torch.Tensor | None = None) -> Handle:
    """Start gathering every rank's 1-D ``send`` (same size everywhere) back to back in rank
    order; the handle's result is ``out`` (``size * send.numel()`` elements) or a new tensor."""
    _check_flat(send)
    numel = send.numel() * comm.size
    if out is None:
        out = torch.empty(numel, dtype=send.dtype, device=send.device)
    elif out.numel() != numel or out.dtype != send.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {send.dtype} with {numel} elements")
    src = stage(send)
    dst = out if out.device == src.device else empty((numel,), out)
    datatype = mpi_type(send.dtype)
    if recorders.ACTIVE:
        recorders.record("all_gather", src.nbytes)
    request = comm.Iallgather([as_buffer(src), src.numel(), datatype], [as_buffer(dst), src.numel(), datatype])
    return Handle(request, (src, dst), lambda: out if dst is out else out.copy_(dst),
                  ("iall_gather", comm, {"dtype": send.dtype, "bytes": src.nbytes}))


class Posted:
    """An all-gather that one caller posts again and again, its own handle (one post in flight
    at a time): a subclass's ``post`` sets ``_request`` and ``_result``; ``wait`` completes it
    as :class:`Handle`'s does."""

    __slots__ = ("comm", "_request", "_result", "_details")

    def wait(self) -> torch.Tensor | None:
        """Block until the posted all-gather (one request, or a list of them) is done
        (watched); return its output, once (later calls ``None``: the output is no longer
        held here)."""
        request, out = self._request, self._result
        if request is not None:
            if type(request) is list:
                watchdog.wait_all(request, "iall_gather", self.comm, details=self._details)
            else:
                watchdog.call("iall_gather", self.comm, request.Wait, details=self._details)
            progress.finished(self)
            self._request = None
        self._result = None
        return out

    def test(self) -> bool:
        """One ``MPI_Test`` (``Testall`` for a list; ``Handle.test``'s): whether the posted
        data has arrived."""
        request = self._request
        if type(request) is list:
            return MPI.Request.Testall(request)
        return request is None or request.Test()


class PostedAllGather(Posted):
    """An ``Iallgather`` of ``nbytes`` bytes per rank over ``comm`` that one caller posts again
    and again (FSDP's all-gather of one parameter group, every step), its MPI arguments made
    once: the count and datatype, the fixed ``send`` buffer's address (if it has one), and
    pooled receive rows of ``(comm.size, nbytes)`` bytes (``buffers.reuse``: the last post's
    buffer again when nothing holds it, its address kept; a buffer a post still writes is
    held here, so the pool hands it to nobody else). Host tensors; one post in flight at a
    time: the object is its own handle (``post`` starts, ``wait`` completes, as
    :class:`Handle`'s), ~10 Python calls a post against ~30 for ``iall_gather``."""

    __slots__ = ("nbytes", "send", "_source", "_rows")

    def __init__(self, comm: MPI.Intracomm, nbytes: int, send: torch.Tensor | None = None) -> None:
        self.comm, self.nbytes, self.send = comm, nbytes, send
        self._source = None if send is None else [from_address(send.data_ptr(), nbytes), nbytes, MPI.BYTE]
        self._rows = reuse((comm.size, nbytes), torch.uint8)
        self._request: MPI.Request | None = None
        self._result: torch.Tensor | None = None
        self._details = {"dtype": torch.uint8, "bytes": nbytes}

    def post(self, send: torch.Tensor | None = None, out: torch.Tensor | None = None) -> PostedAllGather:
        """Start gathering ``nbytes`` of ``send`` (C-contiguous host; default the fixed send
        buffer) from every rank into ``out`` (C-contiguous host, ``comm.size * nbytes`` bytes
        or more) or pooled (size, nbytes) rows."""
        if out is None:
            out, address = self._rows.take()
        else:
            address = from_address(out.data_ptr(), self.nbytes * self.comm.size)
        source = self._source if send is None else [from_address(send.data_ptr(), self.nbytes), self.nbytes, MPI.BYTE]
        if recorders.ACTIVE:
            recorders.record("all_gather", self.nbytes)
        self._request = self.comm.Iallgather(source, [address, self.nbytes, MPI.BYTE])
        self._result = out
        progress.started(self)
        return self


def ireduce_scatter(
    send: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = "sum", out: torch.Tensor | None = None
) -> Handle:
    """Start reducing 1-D ``send`` over all ranks; rank r's result is piece r of
    ``comm.size`` equal pieces (into ``out`` if given). bf16/fp16 are reduced in fp32."""
    _check_flat(send)
    if send.numel() % comm.size:
        raise ValueError(f"{send.numel()} elements do not split into {comm.size} equal pieces")
    dtype, mpi_op = reduction(send.dtype, op)
    piece = send.numel() // comm.size
    if out is None:
        out = torch.empty(piece, dtype=send.dtype, device=send.device)
    elif out.numel() != piece or out.dtype != send.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {send.dtype} with {piece} elements")
    src = stage(send, dtype)
    dst = out if (out.device == src.device and out.dtype == dtype) else empty((piece,), out, dtype)
    datatype = mpi_type(dtype)
    if recorders.ACTIVE:
        recorders.record("reduce_scatter", src.nbytes)
    request = comm.Ireduce_scatter_block([as_buffer(src), piece, datatype], [as_buffer(dst), piece, datatype], mpi_op)
    return Handle(request, (src, dst), lambda: _finish_reduction(dst, out, op, comm.size),
                  ("ireduce_scatter", comm, {"dtype": dtype, "bytes": src.nbytes}))


def iall_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = "sum", *, inplace: bool = False) -> Handle:
    """Start reducing 1-D ``tensor`` elementwise over all ranks; the result goes into
    ``tensor`` itself if ``inplace``, else into a new tensor."""
    _check_flat(tensor)
    dtype, mpi_op = reduction(tensor.dtype, op)
    out = tensor if inplace else torch.empty_like(tensor)
    src = stage(tensor, dtype, copy=not inplace)  # in place: ``tensor`` itself unless staged
    datatype = mpi_type(dtype)
    if recorders.ACTIVE:
        recorders.record("all_reduce", src.nbytes)
    request = comm.Iallreduce(MPI.IN_PLACE, [as_buffer(src), src.numel(), datatype], mpi_op)
    return Handle(request, (src,), lambda: _finish_reduction(src, out, op, comm.size),
                  ("iall_reduce", comm, {"dtype": dtype, "bytes": src.nbytes}))


def _finish_reduction(result: torch.Tensor, out: torch.Tensor, op: str, size: int) -> torch.Tensor:
    if op == "avg":
        result /= size
    if result.data_ptr() != out.data_ptr() or result.dtype != out.dtype:
        out.copy_(result)
    return out


def _check_flat(tensor: torch.Tensor) -> None:
    if tensor.ndim != 1 or not tensor.is_contiguous():
        raise ValueError(f"non-blocking collectives take 1-D contiguous tensors, got shape {tuple(tensor.shape)}")
