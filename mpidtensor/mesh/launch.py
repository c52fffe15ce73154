"""Stop a mis-launched job: N single-rank MPI jobs where one N-rank job was meant.

``srun`` with a PMI plugin the MPI library does not speak (Open MPI under
``--mpi=pmi2``, say), or an ``mpiexec`` from another MPI than the one mpi4py
was built with, does not fail: every process starts as its own one-rank MPI
job and the program runs N times over. The launcher still tells each process
how many it started, so a world size of 1 against a launcher's count above 1 is
caught when the first mesh is built. ``settings.launch_check`` (``MPIDTENSOR_LAUNCH_CHECK=0``)
turns it off.
"""
from __future__ import annotations

import os
from typing import Mapping

from mpi4py import MPI

from ..runtime.settings import settings

OPT_OUT = "MPIDTENSOR_LAUNCH_CHECK"  # named in the message; read as settings.launch_check

# Set by the process manager that started this process, most specific first:
# Open MPI's and MVAPICH's mpirun; PMI-1/PMI-2 (MPICH's Hydra, Intel MPI, srun --mpi=pmi2); any srun step.
# SLURM_NTASKS alone is not used: a batch script or an salloc shell has it without a step.
_LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")

_checked = False


def launched_size(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """How many processes the launcher started, and the variable that says so (None: no launcher)."""
    for name in _LAUNCHER_SIZES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None


def mislaunch_message(world_size: int, environ: Mapping[str, str]) -> str | None:
    """The error for a launch that made single-rank jobs, or None if the launch is sound
    (or ``settings.launch_check`` is off). ``environ`` holds the launcher's variables."""
    if world_size != 1 or not settings.launch_check:
        return None
    launched = launched_size(environ)
    if launched is None or launched[0] <= 1:
        return None
    count, name = launched
    ntasks = environ.get("SLURM_NTASKS")
    slurm = f", SLURM_NTASKS={ntasks}" if ntasks else ""
    return (
        f"mpidtensor: MPI world size is 1 but the launcher started {count} processes "
        f"({name}={count}{slurm}): each process is its own single-rank MPI job. "
        f"The MPI library ({MPI.get_vendor()[0]}) does not speak the launcher's process-management "
        "interface. Under srun pick the plugin it speaks (srun --mpi=pmix for Open MPI 5, "
        "--mpi=pmi2 for MPICH/MVAPICH/Intel MPI, --mpi=cray_shasta for Cray MPICH; `srun --mpi=list` "
        "lists them) or use the mpiexec of the MPI that mpi4py was built against. "
        f"Set {OPT_OUT}=0 if single-rank processes are intended."
    )


def check_launch(comm: MPI.Comm | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Raise ``RuntimeError`` if this process is a single-rank job its launcher meant as one of many."""
    comm = MPI.COMM_WORLD if comm is None else comm
    message = mislaunch_message(comm.size, os.environ if environ is None else environ)
    if message is not None:
        raise RuntimeError(message)


def check_launch_once() -> None:
    """``check_launch`` on ``COMM_WORLD`` the first time a mesh is built in this process."""
    global _checked
    if not _checked:
        check_launch()
        _checked = True
