"""``python -m mpidtensor``: what a cluster user needs to know before the first run.

The MPI library and mpi4py's build, whether MPI takes GPU buffers (and what
``MPIDTENSOR_CUDA_AWARE`` makes of it), torch and its devices, and, under
``mpiexec``/``srun``, one row per rank: host, node-local rank, and the GPU
``init_device_mesh("cuda", ...)`` would bind; then every setting with its current value
(rank 0's) and the process-wide effects mpidtensor has installed or would install.
Every rank contributes; rank 0 prints.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from typing import TextIO

import torch
from mpi4py import MPI

from ..comm import buffers
from ..mesh import launch
from ..runtime import mpi_library, scheduling
from ..runtime import effects
from ..runtime import watchdog
from ..runtime.settings import ENVIRONMENT, settings

_RANK_ENV = ("SLURM_PROCID", "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES")


def _allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _rank_row(comm: MPI.Intracomm) -> dict[str, str]:
    """This rank's placement. Collective (the node-local split)."""
    node = watchdog.call("the environment report: the node's ranks (Split_type)", comm, comm.Split_type,
                        MPI.COMM_TYPE_SHARED, comm.rank)
    local, per_node = node.rank, node.size
    node.Free()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpus = len(_allowed_cpus())
    row = {
        "rank": str(comm.rank),
        "host": socket.gethostname(),
        "local": f"{local}/{per_node}",
        "gpu": f"cuda:{local % gpus}" if gpus else "-",
        "cpus": str(cpus),
    }
    row.update({name: os.environ.get(name, "-") for name in _RANK_ENV})
    return row


def _scheduling_lines(rows: list[dict[str, str]], placement: list[tuple[frozenset[int], int]]) -> list[str]:
    """A warning per node whose ranks outnumber its CPUs in separate scheduling groups."""
    by_host: dict[str, list[tuple[frozenset[int], int]]] = {}
    for row, ranks in zip(rows, placement):
        by_host.setdefault(row["host"], []).append(ranks)
    autogroup = scheduling.autogroup_enabled()
    warnings = (scheduling.contention_message(host, ranks, autogroup) for host, ranks in by_host.items())
    return [f"  {w}" for w in warnings if w is not None]


def _cuda_aware_lines() -> list[str]:
    answer = mpi_library.query_cuda_support()
    said = {True: "yes", False: "no", None: "unknown (the library exports no MPIX_Query_cuda_support)"}[answer]
    lines = [
        f"  MPIX_Query_cuda_support: {said}",
        f"  MPIDTENSOR_CUDA_AWARE:   {_shown(settings.cuda_aware)}",
        f"  GPU buffers go to MPI:   {'directly' if buffers.cuda_aware() else 'staged through host memory'}",
    ]
    built = _ompi_built_with_cuda()
    if built is not None:
        lines.append(f"  ompi_info built with CUDA: {built}")
    return lines


def _shown(value: object) -> str:
    """A setting's value as its environment variable spells it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_lines() -> list[str]:
    """One row per ``MPIDTENSOR_*`` variable: its current value, its default, its meaning."""
    rows = [[env, _shown(getattr(settings, name)), _shown(default), doc] for env, name, default, doc in ENVIRONMENT]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [f"  {env.ljust(widths[0])}  {value.ljust(widths[1])}  (default {default}){' ' * (widths[2] - len(default))}  {doc}"
            for env, value, default, doc in rows]


def effects_lines() -> list[str]:
    """One row per process-wide effect: when it is installed, whether it is, what it does."""
    rows = effects.describe()
    width = max((len(name) for name, *_ in rows), default=0)
    return [f"  {name.ljust(width)}  {when}, {'installed' if done else 'not installed'}: {what}"
            for name, when, what, done in rows]


def _ompi_built_with_cuda() -> str | None:
    """Open MPI's build-time answer from ``ompi_info`` (None for other MPIs or without it)."""
    if MPI.get_vendor()[0] != "Open MPI" or shutil.which("ompi_info") is None:
        return None
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("mca:mpi:base:param:mpi_built_with_cuda_support:value:"):
            return line.rsplit(":", 1)[-1]
    return None


def _torch_lines() -> list[str]:
    lines = [f"  version {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"  {len(names)} CUDA device(s) on rank 0's node: {', '.join(names)}")
    else:
        lines.append("  no CUDA device visible")
    return lines


def _table(rows: list[dict[str, str]]) -> list[str]:
    head = list(rows[0])
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in head]
    fmt = lambda cells: ("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()  # noqa: E731
    return [fmt(head), *(fmt([r[h] for h in head]) for r in rows)]


def report(comm: MPI.Intracomm | None = None, file: TextIO | None = sys.stdout) -> str:
    """The environment report, printed to ``file`` on rank 0 and returned on every rank. Collective."""
    comm = MPI.COMM_WORLD if comm is None else comm
    gathered = watchdog.call("the environment report: every rank's row to rank 0 (gather)", comm, comm.gather,
                             (_rank_row(comm), (_allowed_cpus(), os.getsid(0))), 0)
    text = None
    if comm.rank == 0:
        rows, placement = [row for row, _ in gathered], [ranks for _, ranks in gathered]
        lib = mpi_library.describe()
        build = mpi_library.mpi4py_build()
        hosts = {}
        for row in rows:
            hosts[row["host"]] = hosts.get(row["host"], 0) + 1
        mislaunch = launch.mislaunch_message(MPI.COMM_WORLD.size, os.environ)
        lines = [
            "MPI library",
            f"  {lib.vendor} {lib.vendor_version} (MPI standard {lib.standard}): {lib.version_text}",
            f"  file {lib.path or 'not found in this process'}",
            "mpi4py",
            f"  version {build['version']}, ABI {build['abi']}, build {build['config']}",
            "CUDA-aware MPI",
            *_cuda_aware_lines(),
            "torch",
            *_torch_lines(),
            f"ranks: {comm.size} on {len(hosts)} node(s); per node: "
            + ", ".join(f"{host} {count}" for host, count in hosts.items()),
            *_table(rows),
            "settings (environment or mpidtensor.settings.update)",
            *settings_lines(),
            "process-wide effects",
            *effects_lines(),
        ]
        if mislaunch is not None:
            lines += ["LAUNCH PROBLEM", f"  {mislaunch}"]
        contention = _scheduling_lines(rows, placement)
        if contention:
            lines += ["OVERSUBSCRIBED", *contention]
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file, flush=True)
    return watchdog.call("the environment report from rank 0 (bcast)", comm, comm.bcast, text, 0)


def main() -> int:
    """Print the report; exit status 1 if the launch made single-rank jobs of a many-rank one."""
    report()
    return 0 if launch.mislaunch_message(MPI.COMM_WORLD.size, os.environ) is None else 1
