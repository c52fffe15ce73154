"""Memory statistics with the names and meanings of ``torch.accelerator``'s.

On a CUDA device every function reads torch's caching allocator. On the CPU,
where torch keeps no statistics, they count what mpidtensor holds:

* **allocated**: the bytes of distinct CPU storages that are either buffers the
  library allocated for communication (``mesh.buffers.empty``: collective
  outputs and staging buffers) or the storage of a live DTensor's local tensor.
  A storage is counted once however many tensors view it, from the moment it is
  registered until it is freed (a weak reference to the storage tells when), so a
  shard stays counted while anything (``to_local()``, autograd) still holds it.
  Library buffers are registered when allocated (``track_buffer``) and re-measured
  after an in-place ``resize_`` (``track_resize``: FSDP's unsharded buffers).
  DTensors are found at query time by a scan of the garbage collector's objects
  (10-20 ms per 100k objects here), so that making a DTensor costs the dispatch
  hot path nothing.
* **peak allocated**: the highest *allocated* figure at any library allocation
  or query. The peak over communication is exact for library buffers and for
  the DTensors found by the last query that are still alive; a DTensor made
  after the last query is in the peak from the next query on.
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
import weakref
from collections import OrderedDict
from functools import cache
from typing import TYPE_CHECKING, Any, Union

import torch

if TYPE_CHECKING:
    from .mesh import DeviceMesh

Device = Union[torch.device, str, int, None]

_storages: dict[int, tuple[weakref.ref, int, str]] = {}  # id(storage) -> (ref, nbytes, kind)
_KINDS = ("library", "dtensor")
_current = {kind: 0 for kind in _KINDS}
_peak = {kind: 0 for kind in (*_KINDS, "all")}
_counts = {"allocated": 0, "freed": 0, "allocated_bytes": 0, "freed_bytes": 0}


# --- registration -------------------------------------------------------------------------
def track_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Register a buffer the library allocated (returned unchanged) and update the peaks."""
    if _is_host_tensor(tensor):
        _register(tensor.untyped_storage(), "library")
        _update_peaks()
    return tensor


def track_resize(tensor: torch.Tensor) -> None:
    """Re-read the size of ``tensor``'s storage after an in-place ``resize_`` (FSDP frees and
    refills its unsharded buffers so), registering it if new, and update the peaks."""
    if not _is_host_tensor(tensor):
        return
    storage = tensor.untyped_storage()
    entry = _storages.get(id(storage))
    if entry is None:
        _register(storage, "library")
    else:
        ref, old, kind = entry
        new = storage.nbytes()
        _storages[id(storage)] = (ref, new, kind)
        _current[kind] += new - old
        _counts["allocated_bytes" if new > old else "freed_bytes"] += abs(new - old)
    _update_peaks()


def _scan_dtensors() -> None:
    """Register the local storages of all live DTensors (found through the gc)."""
    from .dtensor import DTensor

    for obj in gc.get_objects():
        if type(obj) is DTensor:  # not isinstance: it would wake lazy objects
            local = obj._local_tensor
            if _is_host_tensor(local):
                _register(local.untyped_storage(), "dtensor")


def _is_host_tensor(tensor: torch.Tensor) -> bool:
    """A real CPU tensor (not a fake, meta or functional one made while tracing)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"


def _register(storage: torch.UntypedStorage, kind: str) -> None:
    key = id(storage)
    if key in _storages:
        return
    nbytes = storage.nbytes()
    _storages[key] = (weakref.ref(storage, lambda _, key=key: _release(key)), nbytes, kind)
    _current[kind] += nbytes
    _counts["allocated"] += 1
    _counts["allocated_bytes"] += nbytes


def _release(key: int) -> None:
    _, nbytes, kind = _storages.pop(key)
    _current[kind] -= nbytes
    _counts["freed"] += 1
    _counts["freed_bytes"] += nbytes


def _update_peaks() -> None:
    for kind in _KINDS:
        _peak[kind] = max(_peak[kind], _current[kind])
    _peak["all"] = max(_peak["all"], sum(_current.values()))


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
    _scan_dtensors()
    _update_peaks()
    rss = _proc_status()
    stats = {
        "allocated_bytes.all.current": sum(_current.values()),
        "allocated_bytes.all.peak": _peak["all"],
        "allocated_bytes.all.allocated": _counts["allocated_bytes"],
        "allocated_bytes.all.freed": _counts["freed_bytes"],
        "allocation.all.current": len(_storages),
        "allocation.all.allocated": _counts["allocated"],
        "allocation.all.freed": _counts["freed"],
        "reserved_bytes.all.current": rss.get("VmRSS", 0),
        "reserved_bytes.all.peak": rss.get("VmHWM", 0),
    }
    for kind in _KINDS:
        stats[f"allocated_bytes.{kind}.current"] = _current[kind]
        stats[f"allocated_bytes.{kind}.peak"] = _peak[kind]
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
    _scan_dtensors()
    for kind in _KINDS:
        _peak[kind] = _current[kind]
    _peak["all"] = sum(_current.values())
    _reset_peak_rss()


def reset_accumulated_memory_stats(device_index: Device = None, /) -> None:
    """Zero the historical counters (``*.allocated``, ``*.freed``)."""
    cuda = _cuda_index(device_index)
    if cuda is not None:
        torch.cuda.reset_accumulated_memory_stats(cuda)
        return
    for name in _counts:
        _counts[name] = 0


def empty_cache() -> None:
    """Release unused cached memory: torch's CUDA cache, and on the CPU the C
    library's free heap pages (glibc ``malloc_trim``), which lowers the RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
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
    rows = comm.allgather(row)
    head = ["rank", "host", "device", *(f"{name} MiB" for name, _ in _COLUMNS)]
    body = [[str(rank), host, device, *("-" if value is None else f"{value / 2**20:.2f}" for value in values)]
            for rank, host, device, values in rows]
    widths = [max(len(cell) for cell in column) for column in zip(head, *body)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in (head, *body)]
    table = "\n".join(lines)
    if comm.rank == 0:
        print(table, file=file, flush=True)
    return table
