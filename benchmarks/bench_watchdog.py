"""What the watchdog costs a wait: small collectives with it on (the default) and off.

    mpiexec -n 2 python benchmarks/bench_watchdog.py [--reps 7]

Each row times one call many times with ``settings.timeout`` at 600 s and at None (off),
alternating on and off ``--reps`` times; a figure is the least over those rounds of the
slowest rank's µs per call (the least: on shared cores other jobs only ever add time). The rows: a blocking ``all_reduce`` of 16 floats (the general
function), the same through a prepared collective (the redistribution plans' fast path),
a non-blocking ``iall_reduce(...).wait()``, a 4 KiB ``Shard(0) -> Replicate`` redistribute
of a DTensor, an agreement's pickled ``allgather`` (``agreement.exchange``, run through
``watchdog.call``), ``DTensor.from_local`` of a ``Shard(0)`` tensor whose global shape comes
from the ranks (a watched ``allgather`` of the local shapes), and the bookkeeping alone
(``watchdog.wait`` of a completed request).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.comm import collectives, nonblocking
from mpidtensor.runtime import agreement, watchdog
from mpidtensor.runtime.settings import settings

COMM = MPI.COMM_WORLD


def per_call(fn, calls: int) -> float:
    """The slowest rank's µs per call of ``fn`` over ``calls`` calls."""
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    mine = (time.perf_counter() - start) / calls * 1e6
    return COMM.allreduce(mine, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="on/off rounds per row")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    args = parser.parse_args()
    small = torch.ones(16)
    prepared = collectives.prepare_all_reduce((16,), torch.float32, COMM)
    mesh = init_device_mesh("cpu", (COMM.size,))
    sharded = distribute_tensor(torch.ones(1024 * COMM.size), mesh, [Shard(0)])
    done = COMM.Isend([b"", MPI.BYTE], COMM.rank, 1)
    COMM.Recv([bytearray(0), MPI.BYTE], COMM.rank, 1)
    rows = {
        "all_reduce, 16 floats": lambda: collectives.all_reduce(small, COMM),
        "prepared all_reduce, 16 floats": lambda: prepared(small),
        "iall_reduce(16 floats).wait()": lambda: nonblocking.iall_reduce(small, COMM).wait(),
        "redistribute S(0)->R, 4 KiB": lambda: sharded.redistribute(mesh, [Replicate()]),
        "agreement.exchange, small object": lambda: agreement.exchange(COMM, (COMM.rank, "ok")),
        "from_local S(0), shape from the ranks": lambda: DTensor.from_local(small, mesh, [Shard(0)]),
        "watchdog.wait, request done": lambda: watchdog.wait(done, "bench", COMM),
    }
    results = []
    for name, fn in rows.items():
        times = {600.0: [], None: []}
        for _ in range(args.reps):
            for timeout in (600.0, None):
                settings.update(timeout=timeout)
                per_call(fn, args.calls // 10)  # warm
                times[timeout].append(per_call(fn, args.calls))
        on, off = min(times[600.0]), min(times[None])
        spread = (statistics.median(times[None]) - off) / off * 100
        results.append((name, on, off, spread))
    settings.update(timeout=600.0)
    if COMM.rank == 0:
        print(f"{COMM.size} ranks, {MPI.Get_library_version().splitlines()[0]}; µs per call, least of {args.reps} "
              f"rounds of {args.calls} calls\n")
        print("| call | watchdog on (600 s) | off | on - off | off's median above its least |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, on, off, spread in results:
            print(f"| {name} | {on:.2f} | {off:.2f} | {on - off:+.2f} | {spread:.0f}% |")


if __name__ == "__main__":
    main()
