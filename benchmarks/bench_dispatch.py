"""Dispatch overhead per op on a plan-cache hit: mpidtensor vs torch.distributed.tensor (gloo).

Run under MPI, e.g. ``mpiexec -n 4 python benchmarks/bench_dispatch.py``. Both
libraries run in the same job: torch's DTensor gets a gloo process group whose
TCP rendezvous port is chosen by rank 0 and broadcast over MPI. Tensors are
small (64x64 per op) so the time is the library's, not the kernel's. The
"torch local" column is the plain op on a local tensor of the same shape: the floor.
Each figure is the median over repeats of the mean time per call, max over ranks.
"""
from __future__ import annotations

import statistics
import time

import torch
from mpi4py import MPI

import mpidtensor as md
from mpidtensor.testing.gloo import init_gloo_process_group

COMM = MPI.COMM_WORLD
REPEATS, CALLS = 7, 300


def timed(fn) -> float:
    """Median over REPEATS of the mean µs per call, the slowest rank's."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(REPEATS):
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - start) / CALLS * 1e6)
    return COMM.allreduce(statistics.median(samples), op=MPI.MAX)


def ops(x, w):
    return {
        "add": lambda: x + x,
        "mm (S(0) @ R)": lambda: torch.mm(x, w),
        "view": lambda: x.view(-1),
        "sum (-> Partial)": lambda: x.sum(),
    }


def gloo_dtensor():
    """torch.distributed.tensor on gloo in this MPI job, or None if it cannot start."""
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    except ImportError:
        return None
    init_gloo_process_group(COMM)
    mesh = init_device_mesh("cpu", (COMM.size,))
    return lambda t, w: (distribute_tensor(t, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()]))


def main() -> None:
    n = 64 * COMM.size
    full, weight = torch.randn(n, 64), torch.randn(64, 64)
    mesh = md.init_device_mesh("cpu", (COMM.size,))
    ours = ops(md.distribute_tensor(full, mesh, [md.Shard(0)]), md.distribute_tensor(weight, mesh, [md.Replicate()]))
    local = ops(full[:64].clone(), weight)
    theirs = None
    make = gloo_dtensor()
    if make is not None:
        theirs = ops(*make(full, weight))
    if COMM.rank == 0:
        print(f"dispatch time per call on a cache hit, {COMM.size} ranks, 64x64 per rank (µs)")
        print(f"{'op':<18}{'mpidtensor':>12}{'torch DTensor':>15}{'torch local':>13}{'ratio':>8}")
    for name in ours:
        a = timed(ours[name])
        b = timed(theirs[name]) if theirs else float("nan")
        c = timed(local[name])
        if COMM.rank == 0:
            print(f"{name:<18}{a:>12.1f}{b:>15.1f}{c:>13.1f}{a / b:>8.2f}")
    if theirs is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
