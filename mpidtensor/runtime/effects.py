"""Every process-wide effect mpidtensor can have on Python or torch, listed in one place.

``import mpidtensor`` changes nothing in Python or torch. It has one effect outside them,
:data:`AT_IMPORT`: MPI starts (mpi4py's default, when the package first imports
``mpi4py.MPI``). Starting it later, at the first mesh, would need ``mpi4py.rc.initialize =
False``, a process-wide mpi4py setting: a program that imports mpidtensor and then calls
mpi4py itself before building a mesh (to read its rank, say) would meet an uninitialized
MPI, which MPICH answers by aborting the process. Each other effect (a hook, a patch of a
torch table, a kernel, a custom op) is registered here with the moment a user opts into
it, and installed then, once:

- ``"first mesh"``: when the first :class:`~mpidtensor.DeviceMesh` is built (a program
  that builds one runs distributed tensors; :func:`first_mesh` is called by the mesh);
- ``"explicit"``: only when the user calls :func:`install` with its name.

An installer that returns ``False`` had nothing to do (the abort hook in a job of one
rank, or switched off) and is not counted as installed.

:func:`describe` lists them (name, when, what it does, whether installed): the README's
table of process-wide effects and ``python -m mpidtensor`` print it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["AT_IMPORT", "Effect", "describe", "effect", "first_mesh", "install", "installed"]

WHEN = ("first mesh", "explicit")


@dataclass
class Effect:
    name: str
    when: str
    what: str
    setup: Callable[[], object]
    installed: bool = False


# The one effect of ``import mpidtensor`` (name, what it does and what follows from it).
AT_IMPORT = ("MPI start-up",
             "MPI is initialized when mpidtensor first imports mpi4py.MPI (mpi4py's default, unless the program "
             "imported it before: then mpi4py.rc decided), at MPI_THREAD_MULTIPLE, and mpi4py adds its finder to "
             "sys.meta_path; the thread level is fixed from "
             "then on, and a process forked afterwards (DataLoader workers, multiprocessing's default start method "
             "on Linux) is a copy of an initialized MPI process, which MPI libraries do not support: use the "
             "'spawn' or 'forkserver' start method")
_EFFECTS: dict[str, Effect] = {}
_MESH_BUILT = False


def effect(name: str, when: str, what: str) -> Callable[[Callable[[], object]], Callable[[], object]]:
    """Register the decorated function as the installer of effect ``name``; it runs once,
    at ``when`` (one of ``WHEN``), or at once if that moment has passed."""
    if when not in WHEN:
        raise ValueError(f"an effect's moment must be one of {WHEN}, got {when!r}")

    def register(setup: Callable[[], object]) -> Callable[[], object]:
        _EFFECTS[name] = Effect(name, when, what, setup)
        if when == "first mesh" and _MESH_BUILT:
            install(name)
        return setup

    return register


def install(name: str) -> None:
    """Install effect ``name`` now (once)."""
    try:
        found = _EFFECTS[name]
    except KeyError:
        raise ValueError(f"no process-wide effect {name!r}; known: {sorted(_EFFECTS)}") from None
    if not found.installed:
        found.installed = found.setup() is not False


def first_mesh() -> None:
    """Install every effect due at the first mesh (called by ``DeviceMesh``; cheap after)."""
    global _MESH_BUILT
    if _MESH_BUILT:
        return
    _MESH_BUILT = True
    for found in list(_EFFECTS.values()):
        if found.when == "first mesh":
            install(found.name)


def installed() -> list[str]:
    """The names of the effects installed so far."""
    return [name for name, found in _EFFECTS.items() if found.installed]


def describe() -> list[tuple[str, str, str, bool]]:
    """(name, when, what, installed) for the effect of the import and every registered one."""
    return [(AT_IMPORT[0], "import", AT_IMPORT[1], True)] + [(e.name, e.when, e.what, e.installed)
                                                             for e in _EFFECTS.values()]
