"""The MPI library mpi4py loaded: where it is, what it is, whether it is CUDA-aware.

mpi4py 4.1 has no binding for ``MPIX_Query_cuda_support``, but MPICH (and its
derivatives) and Open MPI export it from ``libmpi`` itself, so it is called
through ``ctypes``. mpi4py loads ``libmpi`` privately (``RTLD_LOCAL``), so the
library is found in this process's memory map (``/proc/self/maps``) and reopened
with ``RTLD_NOLOAD``: the handle is the copy already in use, already initialised.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from functools import cache

from mpi4py import MPI

_ANCHOR = "MPI_Get_library_version"  # every libmpi exports it; its helpers (libmpifort...) do not


@dataclass(frozen=True)
class MPILibrary:
    """What ``describe()`` reports about the MPI library in use."""

    vendor: str  # mpi4py's reading: "MPICH", "Open MPI", "Intel MPI"...
    vendor_version: str
    standard: str  # the MPI standard version it implements, e.g. "4.1"
    version_text: str  # ``MPI_Get_library_version``, first line
    path: str | None  # the shared library file, None if not found
    cuda_support: bool | None  # ``MPIX_Query_cuda_support()``; None: the library does not say


def _candidates() -> list[str]:
    """Shared objects mapped into this process whose file name starts with ``libmpi``."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(maxsplit=5)[-1].strip() for line in maps]
    except OSError:
        return []
    seen: dict[str, None] = {}
    for path in paths:
        name = os.path.basename(path)
        if name.startswith("libmpi") and ".so" in name:
            seen.setdefault(path, None)
    return list(seen)


def _open(path: str | None) -> ctypes.CDLL | None:
    """A handle on ``path`` if it is already loaded (``None``: the global namespace)."""
    mode = os.RTLD_NOLOAD | os.RTLD_LAZY if path is not None and hasattr(os, "RTLD_NOLOAD") else ctypes.DEFAULT_MODE
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError:
        return None


@cache  # not cleared: fixed for the process
def library_path() -> str | None:
    """The file of the ``libmpi`` mpi4py loaded, or None where it cannot be found."""
    for path in _candidates():
        handle = _open(path)
        if handle is not None and hasattr(handle, _ANCHOR):
            return path
    return None


def query_cuda_support(path: str | None = None) -> bool | None:
    """``MPIX_Query_cuda_support()`` of the library at ``path`` (default: the one in use).

    True or False as the library answers at run time (MPICH: built with CUDA and
    GPU support enabled; Open MPI: built with CUDA and running with it); None
    when the library exports no such function (it cannot tell).
    """
    handle = _open(path if path is not None else library_path())
    query = getattr(handle, "MPIX_Query_cuda_support", None) if handle is not None else None
    if query is None:
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


@cache  # not cleared: fixed for the process
def describe() -> MPILibrary:
    """The MPI library in use (computed once per process)."""
    vendor, version = MPI.get_vendor()
    major, minor = MPI.Get_version()
    text = MPI.Get_library_version().strip()
    return MPILibrary(
        vendor=vendor,
        vendor_version=".".join(map(str, version)),
        standard=f"{major}.{minor}",
        version_text=" ".join(text.splitlines()[0].split()) if text else "",
        path=library_path(),
        cuda_support=query_cuda_support(),
    )


# Where a collective's regular form beats its irregular one, per MPI library: for each choice
# of ``comm.collectives``, the ``(ranks, global bytes / ranks)`` pairs from which the regular
# form is taken (any pair reached). Measured with benchmarks/bench_collectives.py on both
# wheels (docs/mpi-settings.md): MPICH's Alltoallw and Allgatherv fall far behind a packed
# Alltoall and a padded Allgather at large sizes; Open MPI's do not.
_NEVER = ()  # the irregular form at every size
_COLLECTIVE_THRESHOLDS: dict[str, dict[str, tuple[tuple[int, int], ...]]] = {
    # alltoall_packed from 256 KiB at 2 ranks and more (was 4 ranks only; 4 MiB before that):
    # S(0) -> S(1), 2026-12-02 (docs/performance.md, "Collective choices"): Alltoallw / packed
    # 1.5-2.2x at 256K and 3.0x at 1M at 4 ranks; 2.2-2.6 / 1.3-1.9 (even / uneven) at 256K and
    # 4.3-7.2 / 1.3-7.0 at 1M at 2 ranks, 1.0-1.9 below 256K.
    # alltoall_pack_send: pieces strided in the send buffer only (S(0) -> S(1)), packed from
    # 64 KiB (2026-12-02, three runs through redistribute: Alltoallw / packed 1.18-1.39 at 64K
    # and 1.23-1.92 at 128K even, 0.84-1.23 uneven; 0.61-1.13 at 32K).
    "MPICH": {"alltoall_packed": ((2, 256 << 10),), "alltoall_pack_send": ((2, 64 << 10),),
              "allgather_padded": ((2, 1 << 20), (4, 256 << 10))},
    "Open MPI": {"alltoall_packed": _NEVER, "alltoall_pack_send": _NEVER, "allgather_padded": _NEVER},
}


def collective_thresholds(vendor: str | None = None) -> dict[str, tuple[tuple[int, int], ...]]:
    """The thresholds for ``vendor`` (default: the library in use); MPICH's for a library
    not measured (Intel MPI, Cray MPICH and MVAPICH derive from MPICH)."""
    return _COLLECTIVE_THRESHOLDS.get(vendor or MPI.get_vendor()[0], _COLLECTIVE_THRESHOLDS["MPICH"])


def mpi4py_build() -> dict[str, str]:
    """How mpi4py was built: version, the MPI ABI its extension targets, the compiler config."""
    import mpi4py

    ext = os.path.basename(MPI.__file__)  # e.g. MPI.mpich.cpython-311-x86_64-linux-gnu.so
    parts = ext.split(".")
    abi = parts[1] if len(parts) > 3 else "native"
    config = mpi4py.get_config()  # empty for a binary wheel
    return {
        "version": mpi4py.__version__,
        "abi": abi,
        "config": ", ".join(f"{k}={v}" for k, v in config.items()) or "binary wheel",
        "extension": MPI.__file__,
        "python": sys.version.split()[0],
    }
