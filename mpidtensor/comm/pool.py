"""Reuse of host communication buffers.

Collective outputs and staging buffers come from here rather than from a fresh
``torch.empty``, for two reasons measured here (MPICH 5.0.2, 2 ranks):

* a fresh buffer of some MiB is mapped by glibc and pays a page fault per 4 KiB page
  on first touch: an ``Allgather`` of 4 MiB per rank took 528 µs into a reused
  output and 786 µs into a fresh one, of 32 MiB 11 ms against 61 ms;
* at small sizes an allocation plus its registration for the memory statistics
  costs as much as the whole MPI call (a 4 KiB ``Allgather``: 2.8 µs).

A buffer is a CPU tensor, found by its dtype and shape. It is handed out as a new
alias (``detach()``: 0.4 µs here, against 1.4 µs for a ``view`` and 0.8 µs for a
``torch.empty``), and handed out again only once no tensor refers to
its storage any more (the storage's reference count is back to what it is when the
pool alone holds it), so a result that a user, a DTensor or autograd still holds is
never overwritten. Limit: a bare ``untyped_storage()`` object kept with no tensor
left on it does not count as a holder.

The pool keeps at most ``PER_SIZE`` buffers of one size, ``MAX_SIZES`` sizes and
``settings.buffer_pool_mb`` MiB (``MPIDTENSOR_BUFFER_POOL_MB``, default 512; 0 turns
pooling off; a change resizes the pool at once) in all, dropping
the least recently used idle sizes first; a request it cannot pool gets a fresh
buffer, freed as usual. Hand-outs and returns are reported to :mod:`.accounting`
as allocations and frees; a buffer is known to be back when a scan or a request of
its size sees it idle, so between scans the handed-out figure is an upper bound. A
buffer handed out again is counted (a free and an allocation) and reported at the next
scan, which every reading of the memory statistics starts with.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from math import prod

import torch

from . import accounting
from ..runtime.settings import settings

PER_SIZE = 4  # buffers of one dtype and shape
MAX_SIZES = 1024  # distinct (dtype, shape) keys
HUGE_PAGES_MIN = 4 << 20  # bytes: a new buffer this large asks for transparent huge pages (as numpy does)

# torch's C++ reference count of a storage, and a storage's address: public API has neither.
_use_count = torch._C._storage_Use_Count
_storage_address = torch._C._storage_address


class _Buffer:
    __slots__ = ("tensor", "storage", "cdata", "idle", "nbytes", "out", "pooled", "address")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        # Made now and held, so that nobody's later untyped_storage() moves the idle count.
        self.storage = tensor.untyped_storage()
        self.cdata = _storage_address(tensor)
        self.idle = _use_count(self.cdata)
        self.nbytes = tensor.nbytes
        self.out = False  # handed out and not yet seen back
        self.pooled = True  # False once the pool has dropped it
        self.address = None  # its MPI buffer, made by the first ``Reuse`` that hands it out


class BufferPool:
    """Host buffers by dtype and shape, reused once nothing else refers to them."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._sizes: dict[tuple[torch.dtype, tuple[int, ...]], list[_Buffer]] = {}
        # when each size was last asked for (a count of requests): the least recently used go first.
        # (A stamp is a subscript store; ``OrderedDict.move_to_end`` was a call per hand-out.)
        self._used: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
        self._requests = 0
        self._addresses: dict[int, _Buffer] = {}  # the pooled buffers by storage address
        self._bytes = 0  # all pooled buffers
        self._out_bytes = 0  # those handed out and not yet seen back
        self._lock = threading.Lock()  # a check and its hand-out must not interleave
        self._reused = self._reused_bytes = 0  # buffers handed out again since the last scan

    @property
    def pooled_bytes(self) -> int:
        """Bytes of all buffers the pool holds, idle or handed out."""
        return self._bytes

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A C-contiguous CPU tensor of ``shape`` and ``dtype`` whose storage no other tensor
        refers to."""
        key = (dtype, shape)
        with self._lock:
            try:
                buffers = self._sizes[key]
            except KeyError:
                buffers = None
            else:
                for buffer in buffers:
                    if _use_count(buffer.cdata) <= buffer.idle:
                        return self._hand_out_again(key, buffer)
            self._requests += 1
            if buffers is not None:
                self._used[key] = self._requests
            if (buffers is None or len(buffers) < PER_SIZE) and self._make_room(prod(shape) * dtype.itemsize):
                buffer = _Buffer(host_empty(shape, dtype))
                self._sizes.setdefault(key, []).append(buffer)
                self._used[key] = self._requests
                self._addresses[buffer.cdata] = buffer
                self._bytes += buffer.nbytes
                self._hand_out(buffer)
                return buffer.tensor.detach()
            return tracked_empty(shape, dtype)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views a pooled buffer."""
        return _storage_address(tensor) in self._addresses

    def scan(self) -> int:
        """Mark the buffers nobody holds as back and report the reuses since the last scan to
        :mod:`.accounting`; the bytes still handed out (exact now)."""
        with self._lock:
            if self._reused:
                accounting.pool_reused(self._reused_bytes, self._reused)
                self._reused = self._reused_bytes = 0
            for buffers in self._sizes.values():
                for buffer in buffers:
                    if buffer.out and _use_count(buffer.cdata) <= buffer.idle:
                        self._returned(buffer)
            return self._out_bytes

    def clear(self) -> None:
        """Forget every buffer (those still handed out live on with their holders)."""
        with self._lock:
            for buffers in self._sizes.values():
                for buffer in buffers:
                    if buffer.out:
                        self._returned(buffer)  # its holders' own from now on
                    _dropped(buffer)
            self._sizes.clear()
            self._used.clear()
            self._addresses.clear()
            self._bytes = 0

    def resize(self, limit_bytes: int) -> None:
        """Keep at most ``limit_bytes`` from now on, dropping idle buffers beyond it."""
        with self._lock:
            self.limit_bytes = limit_bytes
            self._make_room(0)

    def _hand_out_again(self, key: tuple[torch.dtype, tuple[int, ...]], buffer: _Buffer) -> torch.Tensor:
        """Hand the idle pooled ``buffer`` of size ``key`` out again (the lock held): a new
        alias of it, its size stamped as just used."""
        self._requests += 1
        self._used[key] = self._requests
        if buffer.out:  # back since its last hand-out: a free and an allocation, reported by
            self._reused += 1  # the next scan (as cheap as can be: 4 KiB collectives come here)
            self._reused_bytes += buffer.nbytes
        else:
            self._hand_out(buffer)
        return buffer.tensor.detach()

    def _hand_out(self, buffer: _Buffer) -> None:
        buffer.out = True
        self._out_bytes += buffer.nbytes
        accounting.pool_handed_out(buffer.nbytes)

    def _returned(self, buffer: _Buffer) -> None:
        buffer.out = False
        self._out_bytes -= buffer.nbytes
        accounting.pool_returned(buffer.nbytes)

    def _make_room(self, nbytes: int) -> bool:
        """Drop idle buffers, least recently used sizes first, until ``nbytes`` more fit."""
        if nbytes > self.limit_bytes:
            return False
        for key in sorted(self._sizes, key=self._used.__getitem__):
            if self._bytes + nbytes <= self.limit_bytes and len(self._sizes) < MAX_SIZES:
                break
            kept = []
            for buffer in self._sizes[key]:
                if _use_count(buffer.cdata) > buffer.idle:
                    kept.append(buffer)
                    continue
                self._bytes -= buffer.nbytes
                del self._addresses[buffer.cdata]
                if buffer.out:
                    self._returned(buffer)
                _dropped(buffer)
            if kept:
                self._sizes[key] = kept
            else:
                del self._sizes[key], self._used[key]
        return self._bytes + nbytes <= self.limit_bytes and len(self._sizes) < MAX_SIZES


def _dropped(buffer: _Buffer) -> None:
    """The pool lets go of ``buffer``: a ``Reuse`` that still names it holds no memory."""
    buffer.pooled = False
    buffer.tensor = buffer.storage = buffer.address = None


class Reuse:
    """Hand-outs of one shape and dtype to one caller that asks again and again (a prepared
    collective's output, whose calls ``buffers.empty`` and ``host_buffer`` took four Python
    calls): ``take()`` hands the pool buffer it got last out again when nothing else refers to
    it (the pool's own check, under its lock), with the MPI buffer made for it once; otherwise
    a hand-out as :meth:`BufferPool.take`'s (or, pooling off, a fresh tracked buffer).
    ``as_mpi`` makes a tensor's MPI buffer (``buffers.host_buffer``). The pool never resizes
    a buffer's storage, so the address it was made for stays its own."""

    __slots__ = ("pool", "key", "shape", "dtype", "as_mpi", "buffer")

    def __init__(self, pool: BufferPool, shape: tuple[int, ...], dtype: torch.dtype, as_mpi) -> None:
        self.pool, self.shape, self.dtype, self.as_mpi = pool, tuple(shape), dtype, as_mpi
        self.key = (dtype, self.shape)
        self.buffer: _Buffer | None = None  # the pooled buffer handed out last

    def take(self):
        """``(tensor, its MPI buffer)``: a C-contiguous host tensor no other tensor refers to."""
        buffer, pool = self.buffer, self.pool
        if buffer is not None and pool.limit_bytes:  # (pooling turned off since: fresh buffers)
            with pool._lock:
                if buffer.pooled and _use_count(buffer.cdata) <= buffer.idle:
                    return pool._hand_out_again(self.key, buffer), buffer.address
        if not pool.limit_bytes:
            tensor = tracked_empty(self.shape, self.dtype)
            return tensor, self.as_mpi(tensor)
        tensor = pool.take(self.shape, self.dtype)
        buffer = self.buffer = pool._addresses.get(_storage_address(tensor))  # None: not pooled
        if buffer is None:
            return tensor, self.as_mpi(tensor)
        if buffer.address is None:
            buffer.address = self.as_mpi(buffer.tensor)
        return tensor, buffer.address


def _libc_madvise():
    """libc's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()
_MADV_HUGEPAGE = 14  # linux/mman.h


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, advised by :func:`advise_huge_pages`."""
    return advise_huge_pages(torch.empty(shape, dtype=dtype))


def tracked_empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor the library allocates outside the pool: advised by
    :func:`advise_huge_pages` before its first touch and registered with
    :mod:`.accounting`, so the memory API counts it."""
    return accounting.track_buffer(advise_huge_pages(torch.empty(shape, dtype=dtype, device=device)))


def advise_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``; if it is a host tensor of ``HUGE_PAGES_MIN`` bytes or more, its memory
    asks the kernel for transparent huge pages, as numpy does for its arrays. Call it before
    the first touch: MPI's shared-memory copies into such memory then miss the TLB far less
    (an ``Allgather`` of 32 MiB per rank at 4 ranks here: 45 ms into a ``torch.empty`` buffer,
    32-36 ms into a numpy one or an advised one). Where the kernel's THP mode is ``never``,
    or the call fails, pages stay small."""
    if _MADVISE is not None and tensor.nbytes >= HUGE_PAGES_MIN and tensor.device.type == "cpu":
        start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # madvise wants a page boundary
        _MADVISE(start, tensor.data_ptr() + tensor.nbytes - start, _MADV_HUGEPAGE)
    return tensor


pool = BufferPool(int(settings.buffer_pool_mb * 2**20))
settings.on_change("buffer_pool_mb", lambda mb: pool.resize(int(mb * 2**20)))
