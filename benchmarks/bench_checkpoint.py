"""Checkpoint save/load throughput: mpidtensor.checkpoint against torch.save/torch.load of
the full state dict from one process and torch.distributed.checkpoint on gloo.

    mpiexec -n 4 python benchmarks/bench_checkpoint.py [--mib 1024] [--tensors 16] [--reps 3] [--dir DIR]

The state dict: ``--tensors`` float32 matrices of 4096 columns, ``--mib`` MiB in all,
row-sharded over the ranks (``Shard(0)`` on a 1-D mesh), plus as many replicated
4096-element vectors. A time is the median over ``--reps`` of the slowest rank's
time (barrier before), after one untimed run (a VM's first touch of fresh memory
for the page cache is slow); GB/s = state dict bytes / time. Every save first removes
the previous checkpoint, inside the timed region (DCP refuses nothing but would mix
files otherwise; the same for all), and includes the fsync (mpidtensor and DCP sync
their files; torch.save an explicit ``os.fsync``). mpidtensor is also timed saving
over its previous checkpoint (the atomic replace: the old files go after the commit).
Loads read what the save just wrote, most likely from the page cache for every
column alike. mpidtensor also loads into ``Shard(1)`` (a resharded load).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
from contextlib import contextmanager

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_redistribute import init_gloo  # noqa: E402
from text_table import print_table, time_and_rate  # noqa: E402

world = MPI.COMM_WORLD
n, rank = world.size, world.rank


def timed(fn, reps, comm=world):
    """Median over reps of the slowest rank's seconds for ``fn()``, after one untimed call."""
    comm.Barrier()
    fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        start = MPI.Wtime()
        fn()
        times.append(comm.allreduce(MPI.Wtime() - start, op=MPI.MAX))
    return statistics.median(times)


def remove(path, comm=world):
    """The previous checkpoint at ``path`` removed (by rank 0 of ``comm``; the others wait)."""
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.Barrier()


@contextmanager
def scratch_directory(prefix: str, parent: str | None):
    """A new directory under ``parent`` (default: the temporary one), made by rank 0 and
    known to every rank; removed once every rank is done with it."""
    directory = world.bcast(tempfile.mkdtemp(prefix=prefix, dir=parent) if rank == 0 else None)
    try:
        yield directory
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def state_args(doc: str) -> argparse.Namespace:
    """The command line of the checkpoint benchmarks: the state dict's size and shape,
    repetitions, and where to write."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1024.0, help="MiB of matrices in the state dict")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return parser.parse_args()


def state_bytes(args) -> int:
    """Bytes of the state dict: the matrices plus one 4096-element vector each."""
    return sum(r * c * 4 for r, c in shapes(args)) + args.tensors * 4096 * 4


def shapes(args):
    rows = int(args.mib * 2**20 / 4 / 4096 / args.tensors)
    rows -= rows % n
    return [(rows, 4096)] * args.tensors


def local_blocks(args):
    return {f"layer{i}.weight": torch.randn(s[0] // n, s[1]) for i, s in enumerate(shapes(args))}


def vectors(args):
    return {f"layer{i}.bias": torch.randn(4096) for i in range(args.tensors)}


def bench_mpidtensor(args, directory):
    import mpidtensor
    import mpidtensor.checkpoint as dcp

    mesh = mpidtensor.init_device_mesh("cpu", (n,))
    state = {k: mpidtensor.DTensor.from_local(v, mesh, [mpidtensor.Shard(0)]) for k, v in local_blocks(args).items()}
    state.update(vectors(args))
    path = os.path.join(directory, "mpidtensor")

    def save():
        remove(path)
        dcp.save(state, path)

    save_time = timed(save, args.reps)
    overwrite = timed(lambda: dcp.save(state, path), args.reps)
    load = timed(lambda: dcp.load(state, path), args.reps)
    target = {k: mpidtensor.zeros(v.shape, device_mesh=mesh, placements=[mpidtensor.Shard(1)])
              if isinstance(v, mpidtensor.DTensor) else torch.zeros_like(v) for k, v in state.items()}
    reshard = timed(lambda: dcp.load(target, path), args.reps)
    return save_time, load, reshard, overwrite


def bench_torch_save(args, directory):
    path = os.path.join(directory, "full.pt")
    state = None
    if rank == 0:
        state = {f"layer{i}.weight": torch.randn(s) for i, s in enumerate(shapes(args))}
        state.update(vectors(args))

    def save():
        if rank == 0:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def load():
        if rank == 0:
            torch.load(path)

    return timed(save, args.reps), timed(load, args.reps)


def bench_dcp(args, directory):
    gloo = init_gloo()
    if gloo is None:
        return None, None
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.tensor import DTensor, Shard

    mesh = gloo[1]("cpu", (n,))
    state = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in local_blocks(args).items()}
    state.update(vectors(args))
    path = os.path.join(directory, "dcp")

    def save():
        remove(path)
        tdcp.save(state, checkpoint_id=path)

    return timed(save, args.reps), timed(lambda: tdcp.load(state, checkpoint_id=path), args.reps)


def main():
    args = state_args(__doc__)
    nbytes = state_bytes(args)
    with scratch_directory("bench-ckpt-", args.dir) as directory:
        md = bench_mpidtensor(args, directory)
        ts = bench_torch_save(args, directory)
        tg = bench_dcp(args, directory)
    if rank == 0:
        rows = [("mpidtensor.checkpoint", md[0], md[1]), ("  save over the previous one", md[3], None),
                ("  load into Shard(1)", None, md[2]),
                ("torch.save / torch.load (rank 0)", *ts), ("torch DCP on gloo", *tg)]
        print(f"\ncheckpoint of {nbytes / 2**30:.2f} GiB on {n} ranks ({args.tensors} matrices + vectors), "
              f"median of {args.reps}, slowest rank")
        print_table(["", "save s", "GB/s", "load s", "GB/s"],
                    [[name, *time_and_rate(save, nbytes, 1e9, "{:.2f}"), *time_and_rate(load, nbytes, 1e9, "{:.2f}")]
                     for name, save, load in rows])


if __name__ == "__main__":
    main()
