"""Latency of tiny collectives between bits of torch compute, the pattern of the
test suite. Used to choose the MPI settings in docs/mpi-settings.md.

    mpiexec -n 4 python benchmarks/mpi_progress.py [iterations]

Each iteration is one Allreduce, one Allgatherv and one Alltoallv of a few
floats plus a 64x64 matmul. Prints microseconds per collective: the loop's
wall time (slowest rank) and its CPU time (all ranks together) divided by the
number of collectives. CPU time shows how much a setting busy-waits.
"""
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
size, rank = comm.size, comm.rank
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000

small = np.full(16, rank, np.float32)
summed = np.empty_like(small)

counts = np.arange(1, size + 1)  # rank k contributes k + 1 floats
displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
mine = np.full(rank + 1, rank, np.float32)
gathered = np.empty(counts.sum(), np.float32)

send = np.full(counts.sum(), rank, np.float32)  # k + 1 floats to rank k
recv = np.empty(size * (rank + 1), np.float32)
rcounts = np.full(size, rank + 1)
rdispls = np.arange(size) * (rank + 1)

x = torch.randn(64, 64)
comm.Barrier()
start, cpu_start = MPI.Wtime(), time.process_time()
for _ in range(iters):
    comm.Allreduce(small, summed)
    x = torch.tanh(x @ x)
    comm.Allgatherv(mine, [gathered, counts, displs, MPI.FLOAT])
    comm.Alltoallv([send, counts, displs, MPI.FLOAT], [recv, rcounts, rdispls, MPI.FLOAT])
elapsed = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
cpu = comm.allreduce(time.process_time() - cpu_start, op=MPI.SUM)
if rank == 0:
    per = 1e6 / (3 * iters)
    print(f"{size} ranks: {elapsed * per:.1f} us per collective, cpu {cpu * per:.1f} us")
