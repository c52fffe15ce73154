"""FSDP's all-gather under MPI progress "off": blocking ``Allgather`` vs persistent vs ``Iallgather`` + ``Wait``.

    mpiexec -n 4 python benchmarks/bench_fsdp_all_gather.py [--reps 21]

Bare mpi4py calls on uint8 buffers of 64 KiB to 4 MiB per rank, over all ranks (the FSDP
Llama's and stack's group) and, at 4 ranks, over pairs (FSDP x TP's data-parallel dim), three
ways interleaved: ``Allgather``; ``Allgather_init`` once, then ``Start`` + ``Wait``; and
``Iallgather`` + ``Wait``. Each is timed alone and with a chunk of compute (4 matmuls of
256x256, ~1.5 ms) between its start and its wait (for ``Allgather``: before it), which is what
FSDP's prefetch does. A figure is the median over ``--reps`` samples (5 calls each, after a
barrier) of the slowest rank's CPU (``process_time``, which counts MPICH's polling while it
waits) and wall time per call. The barrier puts every rank at the start together: a
training step does not, and these figures leave out what a rank then spins for its peers
(docs/performance.md, "FSDP step", round 5).
"""
import argparse
import statistics
import time
from typing import Callable

import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
torch.set_num_threads(1)
_A, _B = torch.randn(256, 256), torch.randn(256, 256)


def compute() -> None:
    for _ in range(4):
        torch.mm(_A, _B)


def ways(comm: MPI.Intracomm, nbytes: int) -> tuple[dict[str, Callable[[bool], None]], Callable[[], None]]:
    """The three ways of gathering ``nbytes`` per rank over ``comm`` (each with or without the
    compute between start and wait), and what frees the persistent request."""
    send = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out = torch.empty(nbytes * comm.size, dtype=torch.uint8)
    sb, rb = [send.numpy(), nbytes, MPI.BYTE], [out.numpy(), nbytes, MPI.BYTE]
    persistent = comm.Allgather_init(sb, rb)

    def blocking(work: bool) -> None:
        if work:
            compute()
        comm.Allgather(sb, rb)

    def started(work: bool) -> None:
        persistent.Start()
        if work:
            compute()
        persistent.Wait()

    def nonblocking(work: bool) -> None:
        request = comm.Iallgather(sb, rb)
        if work:
            compute()
        request.Wait()
    return {"Allgather": blocking, "persistent": started, "Iallgather": nonblocking}, persistent.Free


def measure(comm: MPI.Intracomm, nbytes: int, reps: int) -> dict[tuple[bool, str], tuple[float, float]]:
    """(with compute, way) -> (CPU µs, wall µs) per call, medians of the slowest rank."""
    kinds, free = ways(comm, nbytes)
    result = {}
    for work in (False, True):
        samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in kinds}
        for _ in range(reps):
            for name, way in kinds.items():
                WORLD.Barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(5):
                    way(work)
                cpu, wall = (time.process_time() - cpu) / 5, (time.perf_counter() - wall) / 5
                samples[name][0].append(WORLD.allreduce(cpu, MPI.MAX))
                samples[name][1].append(WORLD.allreduce(wall, MPI.MAX))
        for name, (cpus, walls) in samples.items():
            result[work, name] = (statistics.median(cpus) * 1e6, statistics.median(walls) * 1e6)
    free()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args()
    pairs = WORLD.Split(WORLD.rank // 2, WORLD.rank) if WORLD.size == 4 else None
    for label, comm in (("all ranks", WORLD), ("pairs", pairs)):
        if comm is None:
            continue
        for nbytes in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
            figures = measure(comm, nbytes, args.reps)
            if WORLD.rank == 0:
                for (work, name), (cpu, wall) in figures.items():
                    print(f"{label:9s} ({comm.size}) {nbytes >> 10:5d} KiB/rank {'compute' if work else 'alone  '} "
                          f"{name:10s} CPU {cpu:7.0f} us  wall {wall:7.0f} us", flush=True)


if __name__ == "__main__":
    main()
