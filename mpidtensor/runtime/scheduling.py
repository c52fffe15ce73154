"""Ranks that outnumber their CPUs, each in a CPU scheduling group of its own.

MPICH's launcher (Hydra) starts every rank in a session of its own. With the kernel's
autogroup on (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
distributions), every session is a scheduling group, and a core is shared fairly between
groups. A rank waiting in MPI polls and calls ``sched_yield``, which yields only inside its
own group: it keeps its group's half of the core while the rank it waits for needs all of it.
Measured on 2 cores (docs/mpi-settings.md): one busy process beside three yielding ones
finished its work in 2.55 s with each in its own session and in 1.27 s in one session
(alone: 1.25 s); the quick test tier at 4 ranks took 97-406 s with autogroup on and 78-83 s
with it off. Open MPI's ``mpiexec`` keeps the ranks in its own session.
"""
from __future__ import annotations

from collections.abc import Iterable

AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"


def autogroup_enabled(path: str = AUTOGROUP) -> bool | None:
    """Whether the kernel groups processes by session for CPU time (None: not Linux, or unreadable)."""
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def contention_message(host: str, ranks: Iterable[tuple[frozenset[int], int]], autogroup: bool | None) -> str | None:
    """The warning for ``host`` whose ranks are ``(CPUs the rank may run on, its session id)``,
    or None when the ranks have a CPU each, share one session, or autogroup is off."""
    ranks = list(ranks)
    cpus = frozenset().union(*(allowed for allowed, _ in ranks))
    sessions = {session for _, session in ranks}
    if not autogroup or len(ranks) <= len(cpus) or len(sessions) < 2:
        return None
    return (
        f"{len(ranks)} ranks share {len(cpus)} CPU(s) on {host}, each in a session of its own while the "
        f"kernel's autogroup is on: a rank waiting in MPI keeps its CPU share from the rank it waits for "
        f"(a busy rank ran at half speed beside waiting ones, and tests stalled for minutes). Fix: `sysctl -w kernel.sched_autogroup_enabled=0` (root), "
        f"as many ranks as CPUs, or Open MPI's mpiexec, which keeps one session (docs/mpi-settings.md)."
    )
