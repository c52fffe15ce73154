"""File I/O of checkpoint blocks and the box arithmetic that maps one layout onto another;
the file steps every format shares (new names, fsync of a directory, removal).

Each rank writes the blocks it saves into its own data file with vectored ``pwritev``
calls straight from the tensors' memory, then ``fsync``. Not one shared file: buffered
writes to one file serialize on its inode lock (ext4, xfs), and four ranks writing one
file measured 3-40x slower than four files (4 MiB writes took 50-470 ms each on a loaded
node). A load reads a box that is one contiguous run of a stored block with ``preadv``
into the destination's memory; any other box is copied out of a memory map of the file
(one copy, only the pages it touches). No call moves more than ``MAX_CHUNK_BYTES``
(tests set it small); short reads and writes are resumed.
"""
from __future__ import annotations

import errno
import os
import secrets
from collections import deque
from dataclasses import dataclass
from math import prod
from typing import Iterator, Sequence

import numpy as np
import torch

from .errors import CheckpointError

#: The most bytes one read or write call (or one ``Bcast`` in ``state_dict``) moves.
MAX_CHUNK_BYTES = 1 << 30
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape) in global indices


@dataclass(frozen=True)
class Chunk:
    """A box of a saved tensor stored row-major and contiguous: ``nbytes`` at byte
    ``offset`` of the data file ``file``."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.start, self.shape


# --- boxes ---------------------------------------------------------------------------------------------
def intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b``; None when it holds no element."""
    start = tuple(max(sa, sb) for sa, sb in zip(a[0], b[0]))
    stop = tuple(min(sa + na, sb + nb) for sa, na, sb, nb in zip(a[0], a[1], b[0], b[1]))
    shape = tuple(e - s for s, e in zip(start, stop))
    return None if any(n <= 0 for n in shape) else (start, shape)


def relative(box: Box, outer: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor holding ``outer`` (which contains it)."""
    return tuple(slice(s - o, s - o + n) for s, o, n in zip(box[0], outer[0], box[1]))


def run_offset(box: Box, outer: Box) -> int | None:
    """Element offset of ``box`` in the row-major bytes of ``outer`` when the box is one
    contiguous run of them, else None: dims before the first one longer than 1 have
    length 1 and the dims after it are whole."""
    _, shape = box
    first = next((d for d, n in enumerate(shape) if n != 1), len(shape))
    if any(shape[d] != outer[1][d] for d in range(first + 1, len(shape))):
        return None
    return sum((s - o) * prod(outer[1][d + 1:]) for d, (s, o) in enumerate(zip(box[0], outer[0])))


def runs(box: Box, outer: Box) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs of ``box`` in the row-major elements of ``outer`` (which
    contains it): ``(offset in outer, offset in box, length)``, in order."""
    start, shape = box
    split = next((d for d in range(len(shape), 0, -1) if shape[d - 1] != outer[1][d - 1]), 0)
    split = max(split - 1, 0)  # dims from ``split`` on form one run per index of the dims before
    length = prod(shape[split:])
    strides = [prod(outer[1][d + 1:]) for d in range(len(shape))]
    base = sum((s - o) * st for s, o, st in zip(start, outer[0], strides))
    for n, index in enumerate(np.ndindex(*shape[:split])):
        yield base + sum(i * st for i, st in zip(index, strides)), n * length, length


# --- files ---------------------------------------------------------------------------------------------
def new_token() -> str:
    """A random name part: the files of one save, or a temporary, never collide with others."""
    return secrets.token_hex(8)


def fsync_dir(directory: str) -> None:
    """Make the names of ``directory``'s files durable (a commit renames after this)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_files(directory: str, names: list[str]) -> None:
    """Remove ``names`` from ``directory``; those already gone are skipped."""
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


# --- writing -------------------------------------------------------------------------------------------
def write_call(fd: int, buffers: list[memoryview], offset: int) -> int:
    """One ``pwritev`` (a separate function so that tests can make it fail or write short)."""
    return os.pwritev(fd, buffers, offset)


def write_file(path: str, parts: Sequence[tuple[int, np.ndarray]]) -> None:
    """Create ``path`` (it must not exist) holding each ``(offset, bytes)`` of ``parts``
    (ascending, disjoint; the gaps between them zero-filled) and fsync it."""
    views, pos = [], 0
    for offset, raw in parts:
        if offset > pos:
            views.append(memoryview(bytes(offset - pos)))
        views.append(memoryview(raw).cast("B"))
        pos = offset + raw.nbytes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_at(fd, views, 0, path)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_at(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Write ``views`` back to back from byte ``offset`` of ``fd`` (the file ``path``), at
    most ``MAX_CHUNK_BYTES`` and ``IOV_MAX`` buffers per call, resuming after short writes."""
    left = deque(v for v in views if len(v))
    limit = max(1, MAX_CHUNK_BYTES)
    while left:
        batch, total = [], 0
        for v in left:
            if len(batch) == _IOV_MAX or total == limit:
                break
            batch.append(v[:limit - total])
            total += len(batch[-1])
        done = write_call(fd, batch, offset)
        if done <= 0:
            raise OSError(errno.EIO, f"write to {path} made no progress")
        offset += done
        while done:
            if len(left[0]) <= done:
                done -= len(left.popleft())
            else:
                left[0], done = left[0][done:], 0


# --- reading -------------------------------------------------------------------------------------------
class Reader:
    """The data files of one checkpoint directory, opened on first use and closed by
    :meth:`close`: ``read_into`` fills a buffer from a file range, ``array`` maps one."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._fds: dict[str, int] = {}
        self._maps: dict[str, np.ndarray] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self._directory, name)

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` (bytes) from file ``name`` at byte ``offset``."""
        if name not in self._fds:
            self._fds[name] = os.open(self._path(name), os.O_RDONLY)
        fd, pos, size = self._fds[name], 0, len(dest)
        while pos < size:
            got = os.preadv(fd, [dest[pos:pos + max(1, MAX_CHUNK_BYTES)]], offset + pos)
            if got <= 0:
                raise CheckpointError(f"data file {self._path(name)} ends before byte {offset + size}")
            pos += got

    def array(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of file ``name`` as a uint8 array over a
        copy-on-write map of the file (nothing is read until it is touched)."""
        if name not in self._maps:
            self._maps[name] = np.memmap(self._path(name), np.uint8, mode="c")
        mapped = self._maps[name]
        if offset + nbytes > mapped.size:
            raise CheckpointError(f"data file {self._path(name)} ends before byte {offset + nbytes}")
        return mapped[offset: offset + nbytes]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()  # unmapped once the last array over them is gone


def read_box(reader: Reader, stored: Sequence[Chunk], box: Box, dest: np.ndarray, dtype: torch.dtype) -> None:
    """Fill ``dest`` (the row-major bytes of ``box`` of a tensor of ``dtype``) from the
    stored chunks that overlap the box: a common part that is one run in both goes
    straight into ``dest``, any other is copied out of the file's map."""
    itemsize, target = dtype.itemsize, None
    for chunk in stored:
        common = intersect(box, chunk.box)
        if common is None:
            continue
        src, dst = run_offset(common, chunk.box), run_offset(common, box)
        if src is not None and dst is not None:
            lo = dst * itemsize
            reader.read_into(chunk.file, chunk.offset + src * itemsize,
                             memoryview(dest)[lo: lo + prod(common[1]) * itemsize])
            continue
        if target is None:
            target = torch.from_numpy(dest).view(dtype).reshape(box[1])
        mapped = torch.from_numpy(reader.array(chunk.file, chunk.offset, chunk.nbytes)).view(dtype)
        target[relative(common, box)].copy_(mapped.reshape(chunk.shape)[relative(common, chunk.box)])
