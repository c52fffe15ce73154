"""What MPI-4 persistent collectives and buffer reuse save, on bare mpi4py calls.

    mpiexec -n 2 python benchmarks/bench_persistent.py [--reps 15]

For an ``Allgather`` and an ``Allreduce`` of 4 KiB to 32 MiB per rank (float32), three
ways, interleaved in one job: a plain call into a reused output, the same call bound
once with ``Allgather_init`` / ``Allreduce_init`` and then only ``Start``-ed and
``Wait``-ed, and a plain call into a fresh ``torch.empty`` output each time (what the
library did before ``mesh.pool``). A figure is the median over ``--reps`` samples of
the slowest rank's time per call (a sample is a batch of calls of about 2 ms).
These figures decided the design: the buffer pool, yes; persistent requests, no
(``docs/performance.md``).
"""
import argparse
import statistics
import time

import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD
N = COMM.size


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    fn()
    calls = COMM.bcast(max(1, min(200, int(2e-3 / max(time.perf_counter() - start, 1e-7)))))
    samples = []
    for _ in range(reps):
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return COMM.allreduce(statistics.median(samples), op=MPI.MAX)


def addr(t: torch.Tensor):
    return MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)


def cases(nbytes: int):
    m = nbytes // 4
    piece, whole, out = torch.randn(m), torch.randn(m * N), torch.empty(m * N)
    gather = ([addr(piece), m, MPI.FLOAT], [addr(out), m, MPI.FLOAT])
    reduce = ([addr(whole), m * N, MPI.FLOAT], [addr(out), m * N, MPI.FLOAT])
    gather_req, reduce_req = COMM.Allgather_init(*gather), COMM.Allreduce_init(*reduce, MPI.SUM)

    def start_wait(req):
        return lambda: (req.Start(), req.Wait())

    def fresh_gather():
        o = torch.empty(m * N)
        COMM.Allgather(gather[0], [addr(o), m, MPI.FLOAT])

    def fresh_reduce():
        o = torch.empty(m * N)
        COMM.Allreduce(reduce[0], [addr(o), m * N, MPI.FLOAT], MPI.SUM)

    yield "Allgather", (lambda: COMM.Allgather(*gather), start_wait(gather_req), fresh_gather)
    yield "Allreduce", (lambda: COMM.Allreduce(*reduce, MPI.SUM), start_wait(reduce_req), fresh_reduce)
    gather_req.Free()
    reduce_req.Free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if COMM.rank == 0:
        print(f"{N} ranks, median of {args.reps}, µs per call")
        print(f"{'call':10s} {'size/rank':>9s} {'plain':>10s} {'persistent':>10s} {'fresh out':>10s}")
    for nbytes, label in ((4 << 10, "4K"), (256 << 10, "256K"), (4 << 20, "4M"), (32 << 20, "32M")):
        for name, fns in cases(nbytes):
            times = [timed(fn, args.reps) * 1e6 for fn in fns]
            if COMM.rank == 0:
                print(f"{name:10s} {label:>9s} " + " ".join(f"{t:10.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
