"""Where the time of ``Shard(0) -> Shard(1)`` at 256 KiB per rank goes (issue 40, item 4).

``mpiexec -n 4 python benchmarks/bench_alltoall_phases.py [--reps R]``: the record's
all-to-all cell (``record_general.alltoall_row``) taken apart, one layer added per row, each
row timed interleaved with the others (shuffled order per repetition, a barrier before
each batch of calls), checked against the bare call's result first:

* ``bare``: ``Alltoall`` of pieces packed once beforehand (the record's floor);
* ``pack + Alltoall``: the same with this rank's strided pack copied on every call;
* ``pack + persistent``: the pack, then ``Start``/``Wait`` of an ``Alltoall_init`` request;
* ``prepared runner``: the prepared collective's runner: where the ranks share a node, the
  all-to-all through shared-memory windows (``comm/shared_memory.py``: a copy in, a barrier,
  one strided copy out of every rank's window into a pooled
  output), else the pack into its own buffer and ``Alltoall``;
* ``Prepared call``: the same through ``Prepared.__call__`` (signature checks, watchdog);
* ``redistribute_local``: the plan cache's look-up before it;
* ``public``: ``redistribute(...).to_local()``, the record's row.

Printed per row: the median over repetitions of the slowest rank's wall time per call, its
ratio to ``bare``, and the median thread CPU time per call (a waiting rank's polling included).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

import mpidtensor as md
from mpidtensor.tensor import redistribute as rd

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank
ROWS = COLS = 256  # this rank's (256, 256) float32 rows: 256 KiB, the record's cell at 4 ranks


def rows_of_cell() -> tuple[dict[str, Callable[[], object]], MPI.Prequest]:
    """The rows above as zero-argument calls, each returning this rank's result, and the
    persistent request (freed by the caller once timed)."""
    piece = COLS // N
    count = ROWS * piece
    full = torch.randn(ROWS * N, COLS, generator=torch.Generator().manual_seed(2))
    mine = full.chunk(N, 0)[RANK].contiguous()
    packed = np.ascontiguousarray(mine.numpy().reshape(ROWS, N, piece).transpose(1, 0, 2))
    out = np.empty((N * ROWS, piece), np.float32)
    send, held = torch.empty(ROWS * COLS), torch.empty(N * ROWS, piece)
    blocks = mine.as_strided((N, ROWS, piece), (piece, COLS, 1))  # the pieces, rank after rank

    def buf(t: torch.Tensor) -> list:
        return [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), count, MPI.FLOAT]
    persistent = COMM.Alltoall_init(buf(send), buf(held))
    mesh = md.init_device_mesh("cpu", (N,))
    src = md.DTensor.from_local(mine, mesh, [md.Shard(0)], shape=full.shape, stride=full.stride())
    dst = [md.Shard(1)]
    spec = src.redistribute(mesh, dst)._spec
    prepared = rd._PREPARED[(src._spec, spec)]

    def bare():
        COMM.Alltoall(packed, out)
        return torch.from_numpy(out)

    def pack_alltoall():
        send.view(N, ROWS, piece).copy_(blocks)
        result = torch.empty(N * ROWS, piece)
        COMM.Alltoall(buf(send), buf(result))
        return result

    def pack_persistent():
        send.view(N, ROWS, piece).copy_(blocks)
        persistent.Start()
        persistent.Wait()
        return held

    rows = {"bare": bare, "pack + Alltoall": pack_alltoall, "pack + persistent": pack_persistent,
            "prepared runner": lambda: prepared.fast(mine), "Prepared call": lambda: prepared(mine),
            "redistribute_local": lambda: rd.redistribute_local(mine, src._spec, spec),
            "public": lambda: src.redistribute(mesh, dst).to_local()}
    return rows, persistent


def main(argv: list[str] | None = None) -> None:
    """Check every row against the bare call, time them interleaved, print rank 0's table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="repetitions (each times every row once)")
    parser.add_argument("--batch", type=int, default=4, help="calls per timed batch")
    args = parser.parse_args(argv)
    if COLS % N:
        raise SystemExit(f"{COLS} columns do not split evenly over {N} ranks (the bare call needs even pieces)")
    rows, persistent = rows_of_cell()
    want = rows["bare"]().clone()
    ok = all(torch.equal(torch.as_tensor(f()), want) for f in rows.values())
    if not COMM.allreduce(ok, op=MPI.LAND):
        raise SystemExit("a row's result differs from the bare Alltoall's")
    wall: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    order = random.Random(1)
    for _ in range(args.reps):
        for name in order.sample(list(rows), len(rows)):
            fn = rows[name]
            COMM.Barrier()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(args.batch):
                fn()
            wall[name].append((time.perf_counter_ns() - t0) / 1e3 / args.batch)
            cpu[name].append((time.thread_time_ns() - c0) / 1e3 / args.batch)
    persistent.Free()
    medians = {k: COMM.allreduce(statistics.median(v), op=MPI.MAX) for k, v in wall.items()}
    cpus = COMM.gather({k: statistics.median(v) for k, v in cpu.items()}, root=0)
    if RANK == 0:
        import os
        print(f"Shard(0) -> Shard(1), {ROWS * COLS * 4 >> 10} KiB per rank, {N} ranks, "
              f"load average {os.getloadavg()[0]:.2f}")
        for name, t in medians.items():
            print(f"{name:20s} {t:8.1f} us  {t / medians['bare']:5.2f}x bare  "
                  f"cpu {statistics.median(c[name] for c in cpus):7.1f} us")


if __name__ == "__main__":
    main()
