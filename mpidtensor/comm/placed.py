"""An all-gather that places every rank's bytes where they belong in the output (no copy out).

A contiguous ``Iallgather`` lands the ranks' send buffers back to back as (ranks, bytes)
rows, which a copy then moves into their places (FSDP's group all-gather: each rank's
shard of each parameter goes to its rows of that parameter). Here the receive side says
where each source's bytes go: one committed ``hindexed`` byte datatype per source rank,
its blocks the (offset, length) pieces of the output that rank fills, and the send side
one such type over the pieces of the send buffer that this rank contributes. One
``Ialltoallw`` (every destination gets the same send type) then moves the data straight
from the send buffer into the output.

The datatypes are made once per layout (offsets are relative to the buffers, so the
output may move between posts: FSDP's unsharded storage is freed and allocated again
each step) and freed when the object goes.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import progress
from . import recorders
from .buffers import from_address
from .nonblocking import Posted
from .prepared import free_types

Pieces = Sequence[tuple[int, int]]  # (byte offset, byte length) in a buffer


def _byte_type(pieces: Pieces) -> tuple[MPI.Datatype, int]:
    """A committed datatype of ``pieces`` (empty ones dropped) over bytes, and how many of
    it move (0 when every piece is empty: ``MPI.BYTE``, nothing to free)."""
    kept = [(offset, length) for offset, length in pieces if length]
    if not kept:
        return MPI.BYTE, 0
    lengths, offsets = [length for _, length in kept], [offset for offset, _ in kept]
    return MPI.BYTE.Create_hindexed(lengths, offsets).Commit(), 1


class PlacedAllGather(Posted):
    """Every rank of ``comm`` sends its ``send_pieces`` of a fixed send buffer (``send``, the
    same bytes to all); source ``s``'s bytes land at ``recv_pieces[s]`` of the output.
    ``recv_pieces[s]`` must total what rank ``s``'s send pieces do. Host tensors; one post
    in flight at a time: the object is its own handle (``post`` starts, ``Posted.wait``
    completes)."""

    __slots__ = ("send", "nbytes", "_send", "_recv_counts", "_recv_types", "_zeros", "__weakref__")

    def __init__(self, comm: MPI.Intracomm, send: torch.Tensor, send_pieces: Pieces,
                 recv_pieces: Sequence[Pieces]) -> None:
        world = comm.size
        if len(recv_pieces) != world:
            raise ValueError(f"{len(recv_pieces)} receive layouts for {world} ranks")
        self.comm, self.send = comm, send
        self.nbytes = sum(length for _, length in send_pieces)  # this rank's bytes to each rank
        send_type, send_count = _byte_type(send_pieces)
        received = [_byte_type(pieces) for pieces in recv_pieces]
        self._recv_types = [datatype for datatype, _ in received]
        self._recv_counts = [count for _, count in received]
        self._zeros = [0] * world
        self._send = [from_address(send.data_ptr(), send.nbytes), [send_count] * world, self._zeros,
                      [send_type] * world]
        self._request: MPI.Request | None = None
        self._result: torch.Tensor | None = None
        self._details = {"dtype": torch.uint8, "bytes": self.nbytes}
        weakref.finalize(self, free_types, [t for t in (send_type, *self._recv_types) if t != MPI.BYTE])

    def post(self, out: torch.Tensor) -> PlacedAllGather:
        """Start gathering into ``out`` (C-contiguous host bytes covering every receive piece)."""
        if recorders.ACTIVE:
            recorders.record("all_gather", self.nbytes)
        recv = [from_address(out.data_ptr(), out.nbytes), self._recv_counts, self._zeros, self._recv_types]
        self._request = self.comm.Ialltoallw(self._send, recv)
        self._result = out
        progress.started(self)
        return self
