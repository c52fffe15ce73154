"""Point-to-point transport of tensors: one message per hop, receives posted ahead.

A :class:`Channel` owns a duplicate of a group's communicator, so its messages never
match anyone else's. Both ends know the shapes and dtypes of what travels (agreed once,
see ``pipelining.meta``), so a message is raw bytes with no header: a single C-contiguous
tensor is sent from its own memory and received into a pooled tensor of its dtype and
shape; several are packed into one buffer (each at a 16-byte aligned offset), and their
receive lands in one pooled buffer whose slices become the received tensors (no copy on
the host). bfloat16 and any other dtype travel as bytes.
GPU tensors go through :mod:`comm.buffers` like the collectives: handed to MPI where it is
CUDA-aware, staged through host memory where not.

Peer failure: a rank whose computation fails calls :meth:`Channel.notify`, a one-byte
message to every other rank on a reserved tag; every wait of the channel also waits on
that notice (``Waitany``), so no rank is left waiting for a message that will not come.
The notice's receive is posted by :meth:`Channel.open` and completed by
:meth:`Channel.close` with a message to itself (a few microseconds a step: nothing stays
posted between steps). After a failure the channel is :meth:`abandon`-ed and replaced.
"""
from __future__ import annotations

from math import prod
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import watchdog
from . import buffers

ALIGN = 16  # bytes: each packed tensor starts at a multiple, so a dtype view of it is legal
NOTICE_TAG = 0


class PeerFailed(Exception):
    """Another rank of the channel notified a failure."""


def layout(metas: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offset of each ``(shape, dtype)`` in a packed message, and its total size."""
    offsets, end = [], 0
    for shape, dtype in metas:
        offsets.append(end)
        end += -(-prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, end


class Receive:
    """One message's receive, prepared once and posted again each round: from ``source``
    with ``tag``, tensors ``metas`` (``(shape, dtype)`` each) landing on ``device``; its
    buffer's shape and the packed layout are computed here, not per post. ``what`` (such
    as a pipeline action ``1F3``) names it in the watchdog's report, which formats it
    only then (it keeps no buffer alive)."""

    __slots__ = ("comm", "source", "tag", "metas", "device", "like", "shape", "dtype", "offsets", "nbytes", "what")

    def __init__(self, comm: MPI.Intracomm, source: int, tag: int, metas, device: torch.device | str,
                 what: object = None) -> None:
        self.comm, self.source, self.tag, self.what = comm, source, tag, what
        self.metas = [(tuple(shape), dtype) for shape, dtype in metas]
        self.device = torch.device(device)
        self.like = torch.empty(0, dtype=torch.uint8, device=self.device)  # where its buffers live
        if len(self.metas) == 1:  # the tensor itself: no slice or view once it has arrived
            (self.shape, self.dtype), self.offsets = self.metas[0], None
            self.nbytes = prod(self.shape) * self.dtype.itemsize
        else:
            self.offsets, self.nbytes = layout(self.metas)
            self.shape, self.dtype = (self.nbytes,), torch.uint8

    def __str__(self) -> str:
        return (f"{self.nbytes} bytes from rank {self.source} (world rank "
                f"{watchdog.world_rank(self.comm, self.source)}), tag {self.tag}"
                + (f", for pipeline action {self.what}" if self.what is not None else ""))


class Channel:
    """Tensor messages among the ranks of ``comm`` (collective: every rank makes one)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()
        self.failed = False
        self._sends: list[tuple[MPI.Request, object]] = []  # requests and what they read
        self._notice_buf = bytearray(1)
        self._notice = MPI.REQUEST_NULL
        self._posted: dict[Receive, tuple[MPI.Request, torch.Tensor]] = {}  # posted, not yet waited for

    def open(self) -> None:
        """Start a round of messages (a step): post the receive of a failure notice."""
        self._notice = self.comm.Irecv([self._notice_buf, MPI.BYTE], MPI.ANY_SOURCE, NOTICE_TAG)

    def close(self) -> None:
        """End a round in which no rank failed: the notice's receive is completed by a
        message of this rank to itself (no ``MPI_Cancel``: with MPICH over UCX a cancelled
        receive was seen to stay posted inside UCX and take the next round's notice)."""
        if self._notice != MPI.REQUEST_NULL:
            watchdog.wait_all([self.comm.Isend([_ONE, MPI.BYTE], self.comm.rank, NOTICE_TAG), self._notice],
                              "the close of a round of messages (a step's; a message to itself)", self.comm)

    # -- receiving ------------------------------------------------------------------------
    def post(self, receive: Receive) -> None:
        """Post ``receive`` (until :meth:`wait` for it; once at a time)."""
        buffer = buffers.empty(receive.shape, receive.like, receive.dtype)
        data = buffers.contiguous_buffer(buffer)
        self._posted[receive] = (self.comm.Irecv([data, MPI.BYTE], receive.source, receive.tag), buffer)

    def wait(self, receive: Receive) -> list[torch.Tensor]:
        """The tensors of a posted receive, once it has arrived; :class:`PeerFailed` if a
        peer's failure notice comes first."""
        request, buffer = self._posted[receive]
        self._wait_or_notice([request], "receive", receive)
        del self._posted[receive]
        if receive.offsets is None:
            out = [buffer]
        else:
            out = [buffer[offset:offset + prod(shape) * dtype.itemsize].view(dtype).view(shape)
                   for (shape, dtype), offset in zip(receive.metas, receive.offsets)]
        if buffer.device != receive.device:
            out = [t.to(receive.device) for t in out]
        return out

    # -- sending --------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> None:
        """Start sending ``tensors`` as one message; complete by :meth:`finish_sends`."""
        if len(tensors) == 1:
            data = buffers.stage(tensors[0])
        else:
            offsets, nbytes = layout([(tuple(t.shape), t.dtype) for t in tensors])
            like = tensors[0]
            data = buffers.empty((nbytes,), torch.empty(0, dtype=torch.uint8, device=buffers.comm_device(like)))
            with torch.no_grad():
                for t, offset in zip(tensors, offsets):
                    piece = data[offset:offset + t.numel() * t.dtype.itemsize]
                    piece.view(t.dtype).view(t.shape).copy_(t)
        if data.is_cuda:
            torch.cuda.current_stream(data.device).synchronize()
        # C-contiguous either way (staged, or packed): no check
        request = self.comm.Isend([buffers.contiguous_buffer(data), MPI.BYTE], dest, tag)
        self._sends.append((request, data))

    def finish_sends(self) -> None:
        """Wait until every started send is done (or raise :class:`PeerFailed`): by the end
        of a round most are, so one ``Testall`` over them usually completes them all."""
        if self._sends and MPI.Request.Testall([r for r, _ in self._sends]):
            self._sends.clear()
        while self._sends:
            index = self._wait_or_notice([r for r, _ in self._sends], "sends", f"{len(self._sends)} messages")
            del self._sends[index]

    def _wait_or_notice(self, requests: list[MPI.Request], kind: str, details: object) -> int:
        """Index of one of ``requests`` that completed; :class:`PeerFailed` if the failure
        notice arrives first (one ``Waitany`` over both: no polling). ``kind`` and
        ``details`` name the wait in the watchdog's report."""
        if self.failed:
            raise PeerFailed()
        index = watchdog.wait_any([self._notice, *requests], f"point-to-point {kind} (or a peer's failure notice)",
                                  self.comm, details)
        if index == 0:
            self.failed = True
            raise PeerFailed()
        return index - 1

    # -- failure --------------------------------------------------------------------------
    def notify(self) -> None:
        """Tell every other rank that this one failed (their waits raise :class:`PeerFailed`)."""
        self.failed = True
        for rank in range(self.comm.size):
            if rank != self.comm.rank:
                self._sends.append((self.comm.Isend([_ONE, MPI.BYTE], rank, NOTICE_TAG), None))

    def abandon(self) -> None:
        """Give the channel up after a failure: its posted receives are cancelled, and the
        communicator, the receive buffers and whatever was being sent are kept for the rest
        of the process (never freed or reused: a cancel that did not take, or a message
        still on its way, then lands in memory nobody else uses)."""
        for request in [self._notice] + [request for request, _ in self._posted.values()]:
            if request != MPI.REQUEST_NULL and not request.Test():
                request.Cancel()
        _abandoned.append((self.comm, self._notice, self._notice_buf, self._posted, self._sends))
        self._posted, self._sends = {}, []


_ONE = b"\x01"
# Abandoned channels' communicators, requests and buffers: kept alive (one entry per failure).
_abandoned: list[tuple] = []
