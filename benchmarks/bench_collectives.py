"""Measure the collective choices of ``mpidtensor.comm.collectives`` on this machine.

    mpiexec -n 4 python benchmarks/bench_collectives.py

For each size per rank (float32, a tensor sharded on dim 0), times the public
``all_to_all`` (dim 0 -> dim 1) with ``Alltoallw`` and with pack + ``Alltoall(v)``, and
the uneven ``all_gather`` with ``Allgatherv`` and with padded ``Allgather``, by
switching the module's thresholds. A figure is the min of two interleaved medians of
the slowest rank, in µs; ratio > 1 means the regular (packed/padded) form wins. The
thresholds ``ALLTOALL_PACK_SEND_MIN`` (this all-to-all's pieces are strided in the input
only) and ``ALLGATHER_PADDED_MIN`` are set from this table; ``ALLTOALL_PACKED_MIN`` (received
pieces landing along a later dim) from redistributions the other way (docs/mpi-settings.md).
"""
import statistics
import time

import torch
from mpi4py import MPI

from mpidtensor.comm import base, collectives as c

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank
SIZES = {"4K": 4 << 10, "16K": 16 << 10, "64K": 64 << 10, "256K": 256 << 10, "1M": 1 << 20, "4M": 4 << 20,
         "32M": 32 << 20}
ALWAYS, NEVER = ((1, 0),), ((1, 1 << 62),)


def timed(fn, budget: float = 0.4) -> float:
    """Median over repetitions of the slowest rank's µs per call."""
    fn()
    COMM.Barrier()
    start = time.perf_counter()
    fn()
    one = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    reps = COMM.bcast(max(5, min(300, int(budget / max(one, 1e-6)))))
    samples = []
    for _ in range(reps):
        COMM.Barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return COMM.allreduce(statistics.median(samples), op=MPI.MAX) * 1e6


def versus(fn, const: str) -> tuple[float, float]:
    """(time with the irregular form, time with the regular one), interleaved twice."""
    got = {"irregular": [], "regular": []}
    for _ in range(2):
        for name, value in (("irregular", NEVER), ("regular", ALWAYS)):
            setattr(base, const, value)
            got[name].append(timed(fn))
    return min(got["irregular"]), min(got["regular"])


def chunks(total: int) -> list[int]:
    sizes = [len(p) for p in torch.arange(total).chunk(N)]
    return sizes + [0] * (N - len(sizes))


def main() -> None:
    saved = base.ALLTOALL_PACKED_MIN, base.ALLTOALL_PACK_SEND_MIN, base.ALLGATHER_PADDED_MIN
    if RANK == 0:
        print(f"{N} ranks, load average {open('/proc/loadavg').read().split()[:3]}, µs")
    for name, nbytes in SIZES.items():
        side = int((nbytes / 4) ** 0.5)
        side -= side % N
        for uneven in (False, True):
            split, concat = chunks(side + uneven), chunks(side * N + uneven)
            x = torch.randn(concat[RANK], side + uneven)
            w, p = versus(lambda: c.all_to_all(x, COMM, split_dim=1, concat_dim=0, split_sizes=split,
                                               concat_sizes=concat), "ALLTOALL_PACK_SEND_MIN")
            line = f"{name:5s} {'uneven' if uneven else 'even  '} Alltoallw {w:9.1f} packed {p:9.1f} ratio {w / p:5.2f}"
            if uneven:
                v, pd = versus(lambda: c.all_gather(x, COMM, dim=0, sizes=concat), "ALLGATHER_PADDED_MIN")
                line += f" | Allgatherv {v:9.1f} padded {pd:9.1f} ratio {v / pd:5.2f}"
            if RANK == 0:
                print(line, flush=True)
    base.ALLTOALL_PACKED_MIN, base.ALLTOALL_PACK_SEND_MIN, base.ALLGATHER_PADDED_MIN = saved


if __name__ == "__main__":
    main()
