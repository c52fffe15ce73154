"""Collective MPI-IO transfers of boxes of row-major global tensors.

A box (``start``, ``shape``) of a global tensor stored row-major at a byte offset is
read or written through a file view over a subarray datatype, so each rank moves its
own block straight between its contiguous local buffer and the file. MPI counts and
datatype sizes are C ints, so a box is cut into pieces of at most
``MAX_CHUNK_BYTES`` bytes each (a module constant, set small in tests), and the
subarray of a piece spans only the global dims it needs, which stay below the limit
too. A rank's pieces go in as few collective calls as the limit allows: one file
view over a struct of their subarrays, one memory datatype over their buffers
(``MPI_BOTTOM`` + addresses), one ``Write_all``/``Read_all``. Every rank makes the
same number of calls (agreed by one ``allreduce``); ranks with nothing left take
part with an empty view.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np
from mpi4py import MPI

MAX_CHUNK_BYTES = 1 << 30
#: MPI-IO hints (ROMIO names) for every checkpoint file. Each rank moves large blocks,
#: so independent access beats two-phase collective buffering (whose data exchange
#: measured 4-10x slower on an oversubscribed node); write data sieving would lock
#: the file for read-modify-write. On a parallel file system with many small
#: non-contiguous boxes, re-enabling ``romio_cb_*`` may pay off.
HINTS: dict[str, str] = {"romio_cb_read": "disable", "romio_cb_write": "disable", "romio_ds_write": "disable"}


@dataclass(frozen=True)
class Piece:
    """One transfer: a view (``disp`` bytes, subarray ``sizes/subsizes/starts`` of
    ``itemsize``-byte elements) and the matching bytes ``buffer[lo:lo + nbytes]``."""

    disp: int
    sizes: tuple[int, ...]
    subsizes: tuple[int, ...]
    starts: tuple[int, ...]
    itemsize: int
    buffer: np.ndarray
    lo: int
    nbytes: int

    @property
    def extent(self) -> int:
        """Bytes of the file the piece's view spans."""
        return prod(self.sizes) * self.itemsize


def _split_dim(gshape: Sequence[int], itemsize: int, limit: int) -> int:
    """The outermost dim whose global rows (everything inside it) fit the limit."""
    for d in range(len(gshape)):
        if prod(gshape[d + 1:]) * itemsize <= limit:
            return d
    return len(gshape) - 1


def pieces(
    offset: int, gshape: Sequence[int], start: Sequence[int], shape: Sequence[int], itemsize: int,
    buffer: np.ndarray, limit: int | None = None,
) -> list[Piece]:
    """The pieces moving box (``start``, ``shape``) of a ``gshape`` tensor stored at byte
    ``offset`` to or from ``buffer`` (the box's bytes, contiguous, row-major)."""
    limit = max(MAX_CHUNK_BYTES if limit is None else limit, itemsize)
    if prod(shape) == 0:
        return []
    if len(gshape) == 0:  # a 0-dim tensor: one element
        gshape, start, shape = (1,), (0,), (1,)
    n = len(gshape)
    gstrides = [prod(gshape[k + 1:]) for k in range(n)]
    lstrides = [prod(shape[k + 1:]) for k in range(n)]
    d = _split_dim(gshape, itemsize, limit)
    inner = prod(shape[d + 1:])
    rows = max(1, limit // (inner * itemsize))
    out = []
    for outer in itertools.product(*(range(shape[k]) for k in range(d))):
        for a in range(0, shape[d], rows):
            ext = min(rows, shape[d] - a)
            gidx = [start[k] + outer[k] for k in range(d)] + [start[d] + a]
            lidx = list(outer) + [a]
            out.append(Piece(
                disp=offset + sum(i * s for i, s in zip(gidx, gstrides)) * itemsize,
                sizes=(ext, *gshape[d + 1:]),
                subsizes=(ext, *shape[d + 1:]),
                starts=(0, *start[d + 1:]),
                itemsize=itemsize,
                buffer=buffer,
                lo=sum(i * s for i, s in zip(lidx, lstrides)) * itemsize,
                nbytes=ext * inner * itemsize,
            ))
    return out


def _rounds(todo: list[Piece], limit: int) -> list[list[Piece]]:
    """The pieces grouped into one collective call each: at most ``limit`` bytes, in
    ascending and non-overlapping file order (as the typemap of a file view must be)."""
    left, out = sorted(todo, key=lambda p: p.disp), []
    while left:
        group, rest, end, total = [], [], 0, 0
        for p in left:
            if not group or (p.disp >= end and total + p.nbytes <= limit):
                group.append(p)
                end, total = p.disp + p.extent, total + p.nbytes
            else:
                rest.append(p)
        out.append(group)
        left = rest
    return out


class _RoundTypes:
    """The file and memory datatypes of one round: a struct of the pieces' subarrays
    (relative to the first piece) and an hindexed type over their buffers' addresses."""

    def __init__(self, group: list[Piece]) -> None:
        self._owned: list[MPI.Datatype] = []
        base = group[0].disp
        lengths, disps, types = [], [], []
        for p in group:
            disps.append(p.disp - base)
            if p.sizes == p.subsizes:  # contiguous in the file
                lengths.append(p.nbytes)
                types.append(MPI.BYTE)
            else:
                elem = self._own(MPI.BYTE.Create_contiguous(p.itemsize))
                lengths.append(1)
                types.append(self._own(elem.Create_subarray(list(p.sizes), list(p.subsizes), list(p.starts))))
        self.disp = base
        self.filetype = self._own(MPI.Datatype.Create_struct(lengths, disps, types))
        addresses = [MPI.Get_address(p.buffer) + p.lo for p in group]
        self.memtype = self._own(MPI.BYTE.Create_hindexed([p.nbytes for p in group], addresses))

    def _own(self, datatype: MPI.Datatype) -> MPI.Datatype:
        self._owned.append(datatype.Commit())
        return datatype

    def free(self) -> None:
        for t in self._owned:
            t.Free()


_EMPTY = np.zeros(0, np.uint8)


def _transfer(fh: MPI.File, comm: MPI.Intracomm, todo: list[Piece], write: bool) -> None:
    groups = _rounds(todo, max(MAX_CHUNK_BYTES, 1))
    for r in range(comm.allreduce(len(groups), op=MPI.MAX)):
        if r < len(groups):
            types = _RoundTypes(groups[r])
            fh.Set_view(types.disp, MPI.BYTE, types.filetype)
            buf = [MPI.BOTTOM, 1, types.memtype]
        else:
            types = None
            fh.Set_view(0, MPI.BYTE, MPI.BYTE)
            buf = [_EMPTY, 0, MPI.BYTE]
        try:
            if write:
                write_piece(fh, buf)
            else:
                fh.Read_all(buf)
        finally:
            if types is not None:
                types.free()


def _info() -> MPI.Info:
    if not HINTS:
        return MPI.INFO_NULL
    info = MPI.Info.Create()
    for key, value in HINTS.items():
        info.Set(key, value)
    return info


def write_piece(fh: MPI.File, buf: list) -> None:
    """One collective write (a separate function so that tests can make it fail)."""
    fh.Write_all(buf)


def write_pieces(path: str, comm: MPI.Intracomm, todo: list[Piece], size: int) -> None:
    """Create ``path`` of ``size`` bytes and write every rank's pieces; synced on return."""
    fh = MPI.File.Open(comm, path, MPI.MODE_WRONLY | MPI.MODE_CREATE, _info())
    try:
        fh.Set_size(size)
        _transfer(fh, comm, todo, write=True)
        fh.Sync()
    finally:
        fh.Close()


def read_pieces(path: str, comm: MPI.Intracomm, todo: list[Piece]) -> None:
    """Read every rank's pieces from ``path`` into their buffers."""
    fh = MPI.File.Open(comm, path, MPI.MODE_RDONLY, _info())
    try:
        _transfer(fh, comm, todo, write=False)
    finally:
        fh.Close()
