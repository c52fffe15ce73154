"""Memory statistics with the names and meanings of ``torch.accelerator``'s.

On a CUDA device every function reads torch's caching allocator. On the CPU,
where torch keeps no statistics, they count what mpidtensor holds:

* **allocated**: the bytes of distinct CPU storages that are live DTensors' local
  tensors or buffers the library allocated (:mod:`mpidtensor.comm.accounting`
  keeps the figures, by kind): ``library`` buffers registered when allocated
  (FSDP's, re-measured after an in-place ``resize_``), ``pool`` buffers
  (collective outputs and staging, :mod:`mpidtensor.comm.pool`) while handed
  out, and ``dtensor`` local storages that are neither. A storage is counted
  once however many tensors view it, until it is freed or back in the pool, so a
  shard stays counted while anything (``to_local()``, autograd) still holds it.
  DTensors are found, and pooled buffers seen back, at query time (a scan of the
  garbage collector's objects: 10-20 ms per 100k objects here), so that the
  dispatch hot path pays nothing for the statistics. Idle pooled buffers are
  cached, not allocated (as in torch's caching allocator).
* **peak allocated**: the highest *allocated* figure at any library allocation
  or query. Between queries a pooled buffer counts from its hand-out until the
  next query or request of its size sees it back, so the peak may overstate by
  buffers freed in between; a DTensor made after the last query is in the peak
  from the next query on.
* **reserved**: the process's resident set size (``VmRSS``); **peak reserved**:
  its high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs``.

``device_index`` (as in torch: an int, ``"cuda:1"``, a ``torch.device``; also ``"cpu"``)
defaults to the current CUDA device once the process uses CUDA, else the CPU.
``memory_summary(mesh)`` gathers every rank's figures into one table.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import socket
import sys
from collections import OrderedDict
from functools import cache
from typing import TYPE_CHECKING, Any, Union

import torch

from ..comm import accounting
from ..comm.pool import pool
from ..runtime import watchdog

if TYPE_CHECKING:
    from ..mesh import DeviceMesh

Device = Union[torch.device, str, int, None]


def _scan() -> None:
    """Bring the figures up to date: the pool's handed-out bytes, and the local storages
    of all live DTensors (found through the gc) that are not pooled buffers."""
    from ..tensor.dtensor import DTensor

    pool.scan()
    for obj in gc.get_objects():
        if type(obj) is DTensor:  # not isinstance: it would wake lazy objects
            local = obj._local_tensor
            if accounting.is_host_tensor(local) and not pool.owns(local):
                accounting.register_dtensor(local)
    accounting.update_peaks()


# --- the process: resident set size -------------------------------------------------------
def _proc_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (empty where /proc is missing)."""
    figures = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value, _unit = line.split()
                    figures[name[:-1]] = int(value) * 1024
    except OSError:
        pass
    return figures


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


# --- the torch.accelerator API -----------------------------------------------------------
def _cuda_index(device_index: Device) -> int | None:
    """The CUDA device index ``device_index`` names, or None for the CPU. None names the
    current CUDA device once this process uses CUDA (asking earlier would make a CUDA
    context before ``init_device_mesh`` binds the rank's GPU), else the CPU."""
    if device_index is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    if isinstance(device_index, int):
        if not torch.cuda.is_available():
            raise ValueError(f"device index {device_index} names a CUDA device but torch sees none")
        return device_index
    device = torch.device(device_index)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"memory statistics are for 'cpu' or 'cuda' devices, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def memory_stats(device_index: Device = None, /) -> OrderedDict[str, Any]:
    """Allocator statistics: torch's on CUDA; on the CPU (see the module doc)
    ``allocated_bytes.{all,library,dtensor}.{current,peak}``,
    ``allocated_bytes.all.{allocated,freed}``, ``allocation.all.{current,allocated,freed}``
    and ``reserved_bytes.all.{current,peak}`` (RSS and its high-water mark)."""
    cuda = _cuda_index(device_index)
    if cuda is not None:
        return torch.cuda.memory_stats(cuda)
    _scan()
    rss = _proc_status()
    current, peak, counts = accounting.current, accounting.peak, accounting.counts
    stats = {
        "allocated_bytes.all.current": sum(current.values()),
        "allocated_bytes.all.peak": peak["all"],
        "allocated_bytes.all.allocated": counts["allocated_bytes"],
        "allocated_bytes.all.freed": counts["freed_bytes"],
        "allocation.all.current": accounting.live_storages(),
        "allocation.all.allocated": counts["allocated"],
        "allocation.all.freed": counts["freed"],
        "reserved_bytes.all.current": rss.get("VmRSS", 0),
        "reserved_bytes.all.peak": rss.get("VmHWM", 0),
    }
    for kind in accounting.KINDS:
        stats[f"allocated_bytes.{kind}.current"] = current[kind]
        stats[f"allocated_bytes.{kind}.peak"] = peak[kind]
    return OrderedDict(sorted(stats.items()))


def memory_allocated(device_index: Device = None, /) -> int:
    """Bytes held by tensors now (CPU: library buffers and DTensor local storages)."""
    return memory_stats(device_index).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device_index: Device = None, /) -> int:
    """The peak of :func:`memory_allocated` since the start or the last reset."""
    return memory_stats(device_index).get("allocated_bytes.all.peak", 0)


def memory_reserved(device_index: Device = None, /) -> int:
    """Bytes held by the caching allocator (CUDA) or the process's resident set size (CPU)."""
    return memory_stats(device_index).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device_index: Device = None, /) -> int:
    """The peak of :func:`memory_reserved` since the start or the last reset."""
    return memory_stats(device_index).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device_index: Device = None, /) -> None:
    """Make every peak the current value (on the CPU also the RSS high-water mark, where
    the kernel permits: ``/proc/self/clear_refs``)."""
    cuda = _cuda_index(device_index)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
        return
    _scan()
    accounting.reset_peaks()
    _reset_peak_rss()


def reset_accumulated_memory_stats(device_index: Device = None, /) -> None:
    """Zero the historical counters (``*.allocated``, ``*.freed``)."""
    cuda = _cuda_index(device_index)
    if cuda is not None:
        torch.cuda.reset_accumulated_memory_stats(cuda)
        return
    _scan()  # frees that happened before the reset belong to the old counts
    for name in accounting.counts:
        accounting.counts[name] = 0


def empty_cache() -> None:
    """Release unused cached memory: torch's CUDA cache, and on the CPU the C
    library's free heap pages (glibc ``malloc_trim``), which lowers the RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache  # not cleared: fixed for the process
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


# --- all ranks at once --------------------------------------------------------------------
_COLUMNS = (
    ("allocated", "allocated_bytes.all.current"),
    ("peak alloc", "allocated_bytes.all.peak"),
    ("library", "allocated_bytes.library.current"),
    ("dtensor", "allocated_bytes.dtensor.current"),
    ("reserved", "reserved_bytes.all.current"),
    ("peak reserved", "reserved_bytes.all.peak"),
)


def memory_summary(mesh: "DeviceMesh | None" = None, device_index: Device = None, *, file=sys.stdout) -> str:
    """Every rank's figures in one table (MiB), printed on rank 0 of ``mesh``
    (all of ``COMM_WORLD`` if None) and returned on every rank. Collective."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if mesh is None else mesh.comm
    stats = memory_stats(device_index)
    cuda = _cuda_index(device_index)
    row = (MPI.COMM_WORLD.rank, socket.gethostname(), "cpu" if cuda is None else f"cuda:{cuda}",
           [stats.get(key) for _, key in _COLUMNS])
    rows = watchdog.call("memory_summary: every rank's row (allgather)", comm, comm.allgather, row)
    head = ["rank", "host", "device", *(f"{name} MiB" for name, _ in _COLUMNS)]
    body = [[str(rank), host, device, *("-" if value is None else f"{value / 2**20:.2f}" for value in values)]
            for rank, host, device, values in rows]
    widths = [max(len(cell) for cell in column) for column in zip(head, *body)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in (head, *body)]
    table = "\n".join(lines)
    if comm.rank == 0:
        print(table, file=file, flush=True)
    return table
