"""How long ``async_save`` blocks the caller, against a synchronous ``save`` of the same state.

    mpiexec -n 4 python benchmarks/bench_async_save.py [--mib 1024] [--tensors 16] [--reps 3] [--dir DIR]

The state dict is bench_checkpoint.py's: ``--tensors`` float32 matrices of 4096 columns,
``--mib`` MiB in all, row-sharded over the ranks, plus as many replicated 4096-element
vectors. Rows (each the median over ``--reps`` of the slowest rank, barrier before, each
save into a fresh directory):

* ``save``: the synchronous save, fsync and commit included;
* ``async_save, first call``: the time until ``async_save`` returns when its stager has
  no buffers yet (fresh host memory: its page faults are part of the copy), then the
  time until ``result()``;
* ``async_save, later calls``: the same with the default stager's buffers kept from the
  previous call (the steady state of a training loop that checkpoints regularly).

The caller waits for nothing else meanwhile (no training runs), so "to result()" is
the whole save as seen from the caller. Blocked / save is the figure of merit.
"""
import os
import shutil
import statistics
import sys
import tempfile

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import local_blocks, remove, state_args, state_bytes, vectors  # noqa: E402

world = MPI.COMM_WORLD
n, rank = world.size, world.rank


def slowest(seconds: float) -> float:
    return world.allreduce(seconds, op=MPI.MAX)


def bench(args, directory):
    import mpidtensor
    import mpidtensor.checkpoint as dcp

    mesh = mpidtensor.init_device_mesh("cpu", (n,))
    state = {k: mpidtensor.DTensor.from_local(v, mesh, [mpidtensor.Shard(0)]) for k, v in local_blocks(args).items()}
    state.update(vectors(args))
    path = os.path.join(directory, "ckpt")
    sync, first, later = [], [], []
    for rep in range(args.reps + 1):  # the first repetition warms the page cache and is not counted
        remove(path)
        world.Barrier()
        start = MPI.Wtime()
        dcp.save(state, path)
        sync.append(slowest(MPI.Wtime() - start))
        for kind, times in (("first", first), ("later", later)):
            if kind == "first":
                stager = dcp.HostStager()  # no buffers yet
            remove(path)
            world.Barrier()
            start = MPI.Wtime()
            future = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            blocked = MPI.Wtime() - start
            future.result()
            total = MPI.Wtime() - start
            times.append((slowest(blocked), slowest(total)))
        stager.close()
    return statistics.median(sync[1:]), [tuple(statistics.median(x) for x in zip(*t[1:])) for t in (first, later)]


def main():
    args = state_args(__doc__)
    directory = world.bcast(tempfile.mkdtemp(prefix="bench-async-", dir=args.dir) if rank == 0 else None)
    nbytes = state_bytes(args)
    try:
        sync, (first, later) = bench(args, directory)
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if rank == 0:
        print(f"\nasync_save of {nbytes / 2**30:.2f} GiB on {n} ranks ({args.tensors} matrices + vectors), "
              f"median of {args.reps}, slowest rank; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'':28} {'blocked s':>10} {'/ save':>7} {'to result() s':>14}")
        print(f"{'save (synchronous)':28} {sync:10.3f} {1:7.0%} {sync:14.3f}")
        for name, (blocked, total) in (("async_save, first call", first), ("async_save, later calls", later)):
            print(f"{name:28} {blocked:10.3f} {blocked / sync:7.1%} {total:14.3f}")


if __name__ == "__main__":
    main()
