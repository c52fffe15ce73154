"""Moving key/value blocks (and their gradients) between the ranks of a ring.

Blocks travel as one flat C-contiguous buffer each (keys then values, :func:`pack`), on
the communication device of ``comm.buffers`` (host memory for CUDA tensors unless MPI is
CUDA-aware), so that one message carries both. :func:`shift` starts a neighbour exchange
(``Irecv`` from rank - 1, ``Isend`` to rank + 1) that the caller tests now and then
during the block computation it overlaps with and waits for after it; :func:`gather` and :func:`reduce_scatter` are the
all-gather variant's two collectives (``comm.collectives``).
"""
from __future__ import annotations

from math import prod
from typing import Sequence

import torch
from mpi4py import MPI

from ...comm import collectives, recorders
from ...comm.buffers import as_buffer, empty, mpi_type, stage, unstage
from ...runtime import watchdog


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensors`` flattened back to back (as ``dtype``) in one buffer on the communication device."""
    like = tensors[0]
    flat = empty((sum(t.numel() for t in tensors),), like, dtype or like.dtype)
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += tensor.numel()
    return flat


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]], like: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` (a buffer from :func:`pack`) with ``shapes``, on ``like``'s device
    as ``like``'s dtype (``flat`` itself where it already is)."""
    flat = unstage(flat, like)
    pieces, offset = [], 0
    for shape in shapes:
        pieces.append(flat[offset:offset + prod(shape)].view(shape))
        offset += prod(shape)
    return pieces


class Shift:
    """A started neighbour exchange; :meth:`wait` returns the received buffer."""

    __slots__ = ("_requests", "_keep", "received", "_what")

    def __init__(self, requests: list[MPI.Request], keep: tuple, received: torch.Tensor, what: tuple) -> None:
        self._requests = requests
        self._what = what  # (kind, communicator, details) for the watchdog's report
        self._keep = keep  # buffers MPI uses until completion
        self.received = received

    def test(self) -> None:
        """Let MPI move data without blocking: MPICH progresses point-to-point messages only
        inside MPI calls, so a shift left alone during a long computation waits for the end."""
        if self._requests:
            MPI.Request.Testall(self._requests)

    def wait(self) -> torch.Tensor:
        if self._requests:
            watchdog.wait_all(self._requests, *self._what)
            self._requests, self._keep = [], ()
        return self.received


def shift(send: torch.Tensor, receive_numel: int, comm: MPI.Intracomm, tag: int, step: str = "") -> Shift:
    """Start sending flat ``send`` to rank + 1 and receiving ``receive_numel`` elements of
    its dtype from rank - 1 (ranks of ``comm``, cyclically); ``tag`` keeps concurrent
    shifts of different kinds apart; ``step`` names the shift in the watchdog's report."""
    send = stage(send)
    received = empty((receive_numel,), send)
    datatype = mpi_type(send.dtype)
    recorders.record("ring_shift", send.nbytes)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    requests = [comm.Irecv([as_buffer(received), receive_numel, datatype], source=left, tag=tag),
                comm.Isend([as_buffer(send), send.numel(), datatype], dest=right, tag=tag)]
    return Shift(requests, (send,), received, (
        f"ring shift{' (' + step + ')' if step else ''}", comm,
        f"{receive_numel * send.dtype.itemsize} bytes from rank {left}, {send.nbytes} to rank {right}, tag {tag}"))


def gather(flat: torch.Tensor, numels: Sequence[int], comm: MPI.Intracomm) -> list[torch.Tensor]:
    """Every rank's flat buffer (rank r's has ``numels[r]`` elements), in rank order."""
    return list(collectives.all_gather(flat, comm, dim=0, sizes=numels).split(list(numels)))


def reduce_scatter(flat: torch.Tensor, numels: Sequence[int], comm: MPI.Intracomm) -> torch.Tensor:
    """Rank r gets the sum over all ranks of the ``numels[r]`` elements of ``flat`` at its offset."""
    return collectives.reduce_scatter(flat, comm, "sum", dim=0, sizes=numels)

