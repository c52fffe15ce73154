"""An all-to-all through MPI shared-memory windows, for a communicator whose ranks share one node.

Each rank copies its whole tensor into its own window (one contiguous copy), the ranks
meet at a barrier, and each copies its piece of every rank's tensor straight out of that
rank's window into its result: one strided copy out of all the windows at once where the
pieces are even (MPI lays the ranks' parts back to back; 18 -> 10 µs of CPU per rank at
256 KiB, 4 ranks, against a copy per rank), else a copy per rank. MPI's ``Alltoall`` needs the pieces
packed first (a strided copy), then copies each message into shared memory and out again:
three copies of every byte against two here, and no rendezvous per message. Measured on
``Shard(0) -> Shard(1)`` at 256 KiB per rank, 4 ranks on 2 cores (docs/performance.md,
"The all-to-all cell"); MPI's derived datatypes, which would skip the packing copy, were
4-7x slower there.

The barrier is MPI's own. A nonblocking barrier tested with ``sched_yield`` between tests
(a waiting rank handing its core to the rank it waits for) cut CPU per rank by ~10% on
loaded cores but was slower on idle ones: ``record_general``'s row, 4 ranks on 2 idle cores,
alternated in one shell, 1.77 and 1.87x the bare call against 1.45 and 1.42x with ``Barrier``.

The windows belong to the communicator (an attribute, freed with it): two of them,
used in turn, so that one barrier per call suffices (a rank writes a window again only
after the next call's barrier, which every rank reaches after reading it). They are made
on the first such all-to-all on the communicator and grown when a larger one comes, which
every rank of it does at the same call: the sizes read facts all ranks share.
"""
from __future__ import annotations

from math import prod
from typing import Sequence

import torch
from mpi4py import MPI

from ..runtime import watchdog
from .base import Run, resized
from .buffers import empty

LARGEST = 8 << 20  # bytes per rank: beyond it the windows would hold more memory than they save


class _Windows:
    """A communicator's pair of shared windows, each rank's views of every rank's part."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm, self.nbytes, self.turn = comm, 0, 0
        self.generation = object()  # a new one each time the windows are made
        self.windows: list[MPI.Win] = []
        self.parts: list[list[torch.Tensor]] = []  # per window, every rank's bytes
        # per window, every rank's bytes as rows of one tensor where the ranks' parts lie
        # back to back (MPI's default contiguous allocation, checked), else None
        self.rows: list[torch.Tensor | None] = []

    def grow(self, nbytes: int) -> None:
        """Windows of ``nbytes`` per rank, made anew (collective)."""
        self.free()
        for _ in range(2):
            window = watchdog.call("all_to_all (shared window)", self.comm, MPI.Win.Allocate_shared,
                                   nbytes, 1, MPI.INFO_NULL, self.comm)
            window.Lock_all(MPI.MODE_NOCHECK)
            self.windows.append(window)
            self.parts.append([torch.frombuffer(window.Shared_query(r)[0], dtype=torch.uint8, count=nbytes)
                               for r in range(self.comm.size)])
            first = self.parts[-1][0].data_ptr()
            back_to_back = all(part.data_ptr() == first + r * nbytes for r, part in enumerate(self.parts[-1]))
            size = self.comm.size
            self.rows.append(torch.frombuffer(MPI.buffer.fromaddress(first, size * nbytes), dtype=torch.uint8,
                                              count=size * nbytes).view(size, nbytes) if back_to_back else None)
        self.nbytes, self.generation = nbytes, object()

    def free(self) -> None:
        """Free the windows (collective)."""
        for window in self.windows:
            window.Unlock_all()
            window.Free()
        self.windows, self.parts, self.rows, self.nbytes = [], [], [], 0


def _free_windows(comm: MPI.Comm, keyval: int, windows: _Windows) -> None:
    """Free ``comm``'s windows with it (an attribute's delete callback)."""
    if not MPI.Is_finalized():
        windows.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_windows)
_ONE_NODE = MPI.Comm.Create_keyval()


def one_node(comm: MPI.Intracomm) -> bool:
    """Whether every rank of ``comm`` shares this rank's node (collective on first call
    for ``comm``, then kept as an attribute)."""
    known = comm.Get_attr(_ONE_NODE)
    if known is None:
        node = watchdog.call("all_to_all (node check)", comm, comm.Split_type, MPI.COMM_TYPE_SHARED)
        known = node.size == comm.size
        node.Free()
        comm.Set_attr(_ONE_NODE, known)
    return known


def _windows(comm: MPI.Intracomm) -> _Windows:
    """``comm``'s windows (an attribute, made empty on first use: grown by the first call)."""
    windows = comm.Get_attr(_KEYVAL)
    if windows is None:
        windows = _Windows(comm)
        comm.Set_attr(_KEYVAL, windows)
    return windows


def shared_runner(comm: MPI.Intracomm, shape: Sequence[int], dtype: torch.dtype, split_dim: int, concat_dim: int,
                  split_sizes: Sequence[int], concat_sizes: Sequence[int], out_shape: Sequence[int],
                  fallback: Run) -> Run:
    """The all-to-all of ``alltoall.all_to_all`` (``shape``: this rank's input) as a function
    of the staged input, through ``comm``'s shared windows where its ranks share a node and
    the input is on the host (else ``fallback``, the same as MPI's collective); the result
    C-contiguous, from ``empty`` (the pool)."""
    rank = comm.rank
    # every rank's input, and this rank's piece of each (facts every rank shares)
    shapes = [resized(shape, concat_dim, n) for n in concat_sizes]
    need = max(map(prod, shapes)) * dtype.itemsize
    start, length = sum(split_sizes[:rank]), split_sizes[rank]
    pieces = [(r, sum(concat_sizes[:r]), n) for r, n in enumerate(concat_sizes) if n and length]
    out_shape = tuple(out_shape)
    # Where every rank's input has one shape and every piece is there, the pieces land in
    # rank order as equal runs of the result: one strided copy out of all the windows'
    # parts at once (viewed as one tensor) instead of a copy per rank.
    together = len(pieces) == comm.size and len(set(concat_sizes)) == 1
    # the result viewed as those runs, as Python ints: ``view`` parses a ``torch.Size`` ~1.5 µs
    # slower than ints (2.4 vs 0.9 µs a call)
    runs = (comm.size, *map(int, resized(shape, split_dim, length)))
    views: list = [None, None, None]  # the windows' generation, then per window (mine, pieces there)
    kept: list = [None]  # ``comm``'s windows once known to share a node (else False): no look-up per call

    def laid_out(windows: _Windows) -> list:
        """Per window: this rank's input as laid out in it, and this rank's piece of each
        rank's input there: one view of them all (rank first) where they lie at even strides,
        else a view per rank (views, made once per generation of the windows)."""
        def typed(part: torch.Tensor, r: int) -> torch.Tensor:
            return part[:prod(shapes[r]) * dtype.itemsize].view(dtype).view(shapes[r])
        laid = [windows.generation]
        for parts, rows in zip(windows.parts, windows.rows):
            if together and rows is not None and windows.nbytes % dtype.itemsize == 0:
                every = rows[:, :prod(shape) * dtype.itemsize].view(dtype).view(comm.size, *shape)
                laid.append((typed(parts[rank], rank), every.narrow(1 + split_dim, start, length)))
            else:
                laid.append((typed(parts[rank], rank), [(offset, n, typed(parts[r], r).narrow(split_dim, start, length))
                                                        for r, offset, n in pieces]))
        return laid

    def run(send: torch.Tensor) -> torch.Tensor:
        if send.is_cuda:
            return fallback(send)
        windows = kept[0]
        if windows is None:
            windows = kept[0] = _windows(comm) if one_node(comm) else False
        if windows is False:
            return fallback(send)
        if windows.nbytes < need:
            windows.grow(need)
        nonlocal views
        if views[0] is not windows.generation:
            views = laid_out(windows)
        turn = windows.turn = windows.turn ^ 1
        mine, theirs = views[1 + turn]
        mine.copy_(send)
        window = windows.windows[turn]
        # this rank's writes visible, then every rank's (MPI's shared-memory model); the
        # barrier is watched by the caller's watch on the whole collective (``Prepared``,
        # ``base.enter``): no watch of its own, one Python call less before it
        window.Sync()
        comm.Barrier()
        window.Sync()
        out = empty(out_shape, send)
        if type(theirs) is torch.Tensor:  # every rank's piece at once: the result as one run per rank
            out.view(*runs).copy_(theirs)
            return out
        for offset, n, piece in theirs:
            out.narrow(concat_dim, offset, n).copy_(piece)
        return out
    return run
