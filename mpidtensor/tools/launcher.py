"""How to start a new MPI job with the MPI library mpi4py loaded: its ``mpiexec``,
the flags that library needs on a shared node, and an environment fit for a job
started from inside another (tests that must watch a job abort or hang).

MPICH's Hydra and Open MPI's PRRTE differ in three ways that matter here: Open MPI
refuses more ranks than cores (``--oversubscribe``) and refuses to run as root
unless told twice (``OMPI_ALLOW_RUN_AS_ROOT`` and ``..._CONFIRM``); and a process
started by a launcher carries that launcher's variables (``PMI_*``, ``PMIX_*``,
``OMPI_*``, ``PRTE_*``, ...), which would make a nested job's ranks join the outer
job, so they are removed.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

from mpi4py import MPI

# Variables a launcher sets in the processes it starts (MPICH/Hydra, Open MPI/PRRTE, PMIx, Slurm).
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "PRTE_", "SLURM_")
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpi_family() -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH and its derivatives: Intel MPI, Cray MPICH,
    MVAPICH) or ``"other"``, from the library mpi4py loaded."""
    vendor = MPI.get_vendor()[0]
    if vendor == "Open MPI":
        return "openmpi"
    if vendor in ("MPICH", "Intel MPI", "MVAPICH", "MVAPICH2") or "MPICH" in MPI.Get_library_version():
        return "mpich"
    return "other"


def mpiexec() -> str:
    """The ``mpiexec`` beside this Python (a PyPI MPI wheel's), else the one on ``PATH``."""
    beside = Path(sys.executable).with_name("mpiexec")
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec beside this Python or on PATH")
    return found


def launcher_flags(family: str | None = None) -> list[str]:
    """Flags ``mpiexec`` needs to run more ranks than cores (Open MPI only: allowed to,
    and a waiting rank yields its core)."""
    return ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"] if (family or mpi_family()) == "openmpi" else []


def nested_env(extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (``os.environ``) without the outer launcher's variables, plus what Open
    MPI needs to start as root, plus ``extra``."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if not k.startswith(LAUNCHER_PREFIXES)}
    if mpi_family() == "openmpi" and os.geteuid() == 0:
        env.update(ROOT_OK)
    env.update(extra or {})
    return env


def command(ranks: int, argv: list[str]) -> list[str]:
    """``mpiexec -n ranks [flags] argv...`` for the MPI library mpi4py loaded."""
    return [mpiexec(), "-n", str(ranks), *launcher_flags(), *argv]
