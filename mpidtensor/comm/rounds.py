"""Collectives in rounds of at most ``limit`` elements, for MPI libraries without large counts.

Before MPI 4 the counts and displacements of one call must fit in a C int; a collective
that would exceed ``base.MAX_COUNT`` runs here as several calls, each within the
limit, with the same result. ``limit`` is passed in (not read from a global) so that
tests can lower it on the collectives module alone.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Sequence

import torch
from mpi4py import MPI

from .buffers import as_buffer


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of back-to-back pieces of ``sizes`` starts."""
    return list(accumulate(sizes, initial=0))[:-1]


def spans(total: int, limit: int | None) -> list[tuple[int, int]]:
    """``(start, length)`` of consecutive rounds covering ``total`` elements (one if it fits)."""
    if limit is None or total <= limit:
        return [(0, total)]
    return [(start, min(limit, total - start)) for start in range(0, total, limit)]


def span(tensor: torch.Tensor, start: int, n: int) -> Any:
    """A buffer over elements ``[start, start + n)`` of a C-contiguous tensor."""
    if start == 0 and n == tensor.numel():
        return as_buffer(tensor)
    return as_buffer(tensor.view(-1)[start:start + n])


def _round_parts(counts: Sequence[int], size: int, limit: int) -> list[tuple[int, list[int]]]:
    """Rounds over rank-ordered pieces of ``counts`` elements: ``(offset in each piece,
    elements of each piece)``, with at most ``limit`` elements per round in all."""
    width = max(1, limit // size)
    return [(start, [min(max(c - start, 0), width) for c in counts]) for start in range(0, max(counts), width)]


def all_gather_rounds(send: torch.Tensor, flat: torch.Tensor, counts: Sequence[int], comm: MPI.Intracomm,
                      datatype: MPI.Datatype, limit: int) -> None:
    """``Allgatherv`` of ``send`` into ``flat`` (pieces back to back in rank order), in rounds."""
    starts = offsets(counts)
    for start, part in _round_parts(counts, comm.size, limit):
        got = flat.new_empty(sum(part))
        mine = part[comm.rank]
        comm.Allgatherv([span(send, start, mine), mine, datatype],
                        [as_buffer(got), (part, offsets(part)), datatype])
        for offset, piece in zip(starts, got.split(part)):
            flat[offset + start:offset + start + len(piece)] = piece


def reduce_scatter_rounds(send: torch.Tensor, out: torch.Tensor, counts: Sequence[int], comm: MPI.Intracomm,
                          datatype: MPI.Datatype, mpi_op: MPI.Op, limit: int) -> None:
    """``Reduce_scatter`` of flat ``send`` (pieces of ``counts``) into ``out``, in rounds."""
    starts = offsets(counts)
    for start, part in _round_parts(counts, comm.size, limit):
        packed = torch.cat([send[o + start:o + start + n] for o, n in zip(starts, part)])
        mine = part[comm.rank]
        comm.Reduce_scatter([as_buffer(packed), len(packed), datatype],
                            [span(out, start, mine), mine, datatype], part, mpi_op)


def scatter_rounds(pieces: torch.Tensor | None, out: torch.Tensor, counts: Sequence[int], comm: MPI.Intracomm,
                   root: int, datatype: MPI.Datatype, limit: int) -> None:
    """``Scatterv`` of the root's flat ``pieces`` (of ``counts``) into ``out``, in rounds."""
    starts = offsets(counts)
    for start, part in _round_parts(counts, comm.size, limit):
        send = None
        if pieces is not None:
            packed = torch.cat([pieces[o + start:o + start + n] for o, n in zip(starts, part)])
            send = [as_buffer(packed), (part, offsets(part)), datatype]
        mine = part[comm.rank]
        comm.Scatterv(send, [span(out, start, mine), mine, datatype], root)
