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

Where the largest source sends ``BY_PIECE_MIN`` bytes or more, the same placement is one
contiguous ``Iallgatherv`` per piece instead (piece ``j`` of every source lands at its
``recv_pieces[s][j]``), with no datatype: MPICH moved a large contiguous message between
local ranks faster than one through a derived type (docs/performance.md, round 13: one
Llama layer group of 3.15 MB per rank at 4 ranks, 2.8-2.9 ms against 3.6), while below
about 1 MiB the one ``Ialltoallw`` wins (0.20 MB: 282-285 µs against 438-453). Between two
ranks it does not (:func:`pays`: the caller gathers into rows and copies out instead).
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
BY_PIECE_MIN = 1 << 20  # bytes the largest source sends from which each piece is its own Iallgatherv
_INT_MAX = 2 ** 31 - 1  # MPI's counts and displacements are C ints


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
    same bytes to all); source ``s``'s bytes land at ``recv_pieces[s]`` of the output, its
    piece ``j`` from its send piece ``j`` (the lists line up piece by piece, empty pieces
    included). Host tensors; one post in flight at a time: the object is its own handle
    (``post`` starts, ``Posted.wait`` completes). One ``Ialltoallw`` over byte datatypes,
    or one ``Iallgatherv`` per piece where the largest source sends ``BY_PIECE_MIN`` bytes
    or more (a choice from the receive layout, which every rank shares)."""

    __slots__ = ("send", "nbytes", "_send", "_recv_counts", "_recv_types", "_zeros", "_by_piece", "__weakref__")

    def __init__(self, comm: MPI.Intracomm, send: torch.Tensor, send_pieces: Pieces,
                 recv_pieces: Sequence[Pieces]) -> None:
        world = comm.size
        if len(recv_pieces) != world or any(len(pieces) != len(send_pieces) for pieces in recv_pieces):
            raise ValueError(f"{len(recv_pieces)} receive layouts for {world} ranks, or not one receive piece "
                             f"per send piece ({len(send_pieces)})")
        self.comm, self.send = comm, send
        self.nbytes = sum(length for _, length in send_pieces)  # this rank's bytes to each rank
        self._request: MPI.Request | list[MPI.Request] | None = None
        self._result: torch.Tensor | None = None
        self._details = {"dtype": torch.uint8, "bytes": self.nbytes}
        self._by_piece = _by_piece(send, send_pieces, recv_pieces)
        if self._by_piece is not None:
            return
        send_type, send_count = _byte_type(send_pieces)
        received = [_byte_type(pieces) for pieces in recv_pieces]
        self._recv_types = [datatype for datatype, _ in received]
        self._recv_counts = [count for _, count in received]
        self._zeros = [0] * world
        self._send = [from_address(send.data_ptr(), send.nbytes), [send_count] * world, self._zeros,
                      [send_type] * world]
        weakref.finalize(self, free_types, [t for t in (send_type, *self._recv_types) if t != MPI.BYTE])

    def post(self, out: torch.Tensor) -> PlacedAllGather:
        """Start gathering into ``out`` (C-contiguous host bytes covering every receive piece)."""
        if recorders.ACTIVE:
            recorders.record("all_gather", self.nbytes)
        if self._by_piece is not None:
            address, comm = out.data_ptr(), self.comm
            self._request = [comm.Iallgatherv(source, [from_address(address + base, span), counts, displs, MPI.BYTE])
                             for source, base, span, counts, displs in self._by_piece]
        else:
            recv = [from_address(out.data_ptr(), out.nbytes), self._recv_counts, self._zeros, self._recv_types]
            self._request = self.comm.Ialltoallw(self._send, recv)
        self._result = out
        progress.started(self)
        return self


def _largest(recv_pieces: Sequence[Pieces]) -> int:
    """The bytes the largest source sends."""
    return max(sum(length for _, length in pieces) for pieces in recv_pieces)


def pays(recv_pieces: Sequence[Pieces]) -> bool:
    """Whether a :class:`PlacedAllGather` of this receive layout beats a contiguous
    all-gather into rows and a copy out: by piece always; through the one ``Ialltoallw``
    from 3 ranks. Between 2 ranks (a 2x2 mesh's data-parallel pairs) the ``Ialltoallw``
    lost to rows + copy: FSDP x TP at dim 128, md / hand-written step 1.39-1.40 against
    1.29-1.30 (docs/performance.md, round 15), where on 4 ranks it wins (FSDP Llama 1.15
    against 1.17)."""
    return len(recv_pieces) > 2 or _largest(recv_pieces) >= BY_PIECE_MIN


def _by_piece(send: torch.Tensor, send_pieces: Pieces, recv_pieces: Sequence[Pieces]) -> list[tuple] | None:
    """The ``Iallgatherv`` arguments of each piece (this rank's send buffer, then the receive
    span's offset and length in the output, every source's count and displacement in it),
    pieces no rank sends left out; None where the largest source sends under
    ``BY_PIECE_MIN`` bytes or a count or offset exceeds MPI's ints (one ``Ialltoallw`` then)."""
    if _largest(recv_pieces) < BY_PIECE_MIN:
        return None
    runs = []
    for j, (offset, length) in enumerate(send_pieces):
        places = [pieces[j] for pieces in recv_pieces]
        if not any(n for _, n in places):
            continue
        base = min(at for at, _ in places)
        displs, counts = [at - base for at, _ in places], [n for _, n in places]
        span = max(d + n for d, n in zip(displs, counts))
        if span > _INT_MAX:
            return None
        runs.append(([from_address(send.data_ptr() + offset, length), length, MPI.BYTE], base, span, counts, displs))
    return runs
