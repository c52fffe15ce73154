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
import statistics
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import local_blocks, remove, scratch_directory, state_args, state_bytes, vectors  # noqa: E402
from text_table import print_table  # noqa: E402

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
    nbytes = state_bytes(args)
    with scratch_directory("bench-async-", args.dir) as directory:
        sync, (first, later) = bench(args, directory)
    if rank == 0:
        print(f"\nasync_save of {nbytes / 2**30:.2f} GiB on {n} ranks ({args.tensors} matrices + vectors), "
              f"median of {args.reps}, slowest rank; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rows = [("save (synchronous)", sync, sync), ("async_save, first call", *first),
                ("async_save, later calls", *later)]
        print_table(["", "blocked s", "/ save", "to result() s"],
                    [[name, f"{blocked:.3f}", f"{blocked / sync:.1%}", f"{total:.3f}"] for name, blocked, total in rows])


if __name__ == "__main__":
    main()
