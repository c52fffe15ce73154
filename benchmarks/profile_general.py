"""Where the record's TP MLP in DTensor ops (``record_general``) spends a step beyond Megatron's.

    mpiexec -n 4 python benchmarks/profile_general.py [--reps 41]

Four steps of this rank's TP MLP, run in turn (interleaved) ``--reps`` times after a warm-up,
CPU per phase by ``time.process_time`` (time descheduled is not counted, which makes it usable
on a loaded machine; time spinning in an MPI wait is), median of the slowest rank:

* ``mpidtensor``: the record's DTensor-op step (``record_general.dtensor_mlp``), checked
  against one process first;
* ``mpi4py``: the record's Megatron step (``record_steps.megatron_mlp``), checked likewise;
* ``local ops of mpidtensor``: the local ops the dispatcher runs for the first (``mm`` on this
  rank's ``[in, out]`` weight shards, a separate bias ``add``), on plain tensors, no collective:
  what the DTensor program's own math costs on this rank;
* ``local ops of mpi4py``: Megatron's (``F.linear`` on ``[out, in]`` shards), no collective.

The two differences split the step's extra CPU into the program's local math (its ops and
layouts, which no dispatcher changes) and the library (dispatch, autograd Functions, the
collectives); the CPU inside each step's two all-reduces (mpidtensor's prepared all-reduce
from its output buffer on, Megatron's ``Allreduce`` calls; wrapped in this script only) splits
the library's part further. Python calls per step (``record_steps.python_calls``, rank 0)
are printed too.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_general import dtensor_mlp  # noqa: E402
from record_steps import COMM, N, RANK, agreed, close, megatron_mlp, mlp_reference, python_calls  # noqa: E402

import mpidtensor as md  # noqa: E402
import record_steps  # noqa: E402
from mpidtensor.comm import reduce as md_reduce  # noqa: E402

PHASES = ("forward", "backward")
IN_MPI = [0.0]  # CPU seconds inside the all-reduces since the last reset


def timed(fn: Callable) -> Callable:
    """``fn`` adding its CPU seconds to ``IN_MPI``."""
    def call(*args, **kwargs):
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            IN_MPI[0] += time.process_time() - t0
    return call


class _TimedComm:
    """``record_steps.COMM`` with its ``Allreduce`` timed (Megatron's two calls)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm, self.Allreduce = comm, timed(comm.Allreduce)

    def __getattr__(self, name: str):
        return getattr(self.comm, name)


@contextlib.contextmanager
def all_reduces_timed() -> Iterator[None]:
    """Both steps' all-reduces timed while inside (mpidtensor's runners are made when a
    redistribution is first prepared: the steps must first run inside). A runner made
    inside stays timed on its prepared collective: the same all-reduce, timed."""
    runner, comm = md_reduce._all_reduce_runner, record_steps.COMM
    md_reduce._all_reduce_runner = lambda *args, **kwargs: timed(runner(*args, **kwargs))
    record_steps.COMM = _TimedComm(comm)
    try:
        yield
    finally:
        md_reduce._all_reduce_runner, record_steps.COMM = runner, comm


def local_programs(ref) -> dict[str, tuple[Callable, list]]:
    """(forward, leaves) of both programs' local ops on this rank's shards, no collective."""
    w1 = ref[0].weight.detach().chunk(N, 0)[RANK]  # [hidden / N, dim]: nn.Linear's layout
    b1 = ref[0].bias.detach().chunk(N, 0)[RANK]
    w2 = ref[2].weight.detach().chunk(N, 1)[RANK]  # [dim, hidden / N]
    b2 = ref[2].bias.detach()
    leaf = lambda t: t.clone().contiguous().requires_grad_()  # noqa: E731
    dt = [leaf(w1.t()), leaf(b1), leaf(w2.t()), leaf(b2)]  # the DTensor program's [in, out] shards
    mg = [leaf(w1), leaf(b1), leaf(w2), leaf(b2)]

    def dtensor_ops(x):
        return torch.mm(F.gelu(torch.mm(x, dt[0]) + dt[1]), dt[2]) + dt[3]

    def megatron_ops(x):
        return F.linear(F.gelu(F.linear(x, mg[0], mg[1])), mg[2]) + mg[3]
    return {"local ops of mpidtensor": (dtensor_ops, dt), "local ops of mpi4py": (megatron_ops, mg)}


def phased(forward: Callable, leaves: list, x0: torch.Tensor, target: torch.Tensor) -> Callable[[], list[float]]:
    """One step as the record runs it, returning its CPU seconds per phase."""
    def step() -> list[float]:
        for p in leaves:
            p.grad = None
        x = x0.clone().requires_grad_()
        IN_MPI[0] = 0.0
        t0 = time.process_time()
        y = forward(x)
        loss = F.mse_loss(y, target, reduction="sum")
        t1 = time.process_time()
        loss.backward()
        return [t1 - t0, time.process_time() - t1, IN_MPI[0]]
    return step


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Profile and print; returns ``{step: {"phases": [forward, backward, in all-reduce] CPU
    ms of the slowest rank, "calls": Python calls on this rank}}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=41)
    args = parser.parse_args(argv)
    with all_reduces_timed():
        return _profile(args.reps)


def _profile(reps: int) -> dict[str, dict]:
    x0, target, ref, ref_x, ref_y = mlp_reference()
    forward, params = dtensor_mlp(md, md.init_device_mesh("cpu", (N,)), ref)
    hand, hand_params, _ = megatron_mlp(ref)
    programs = {"mpidtensor": (forward, params), "mpi4py": (hand, hand_params), **local_programs(ref)}
    for name in ("mpidtensor", "mpi4py"):
        fn, leaves = programs[name]
        x = x0.clone().requires_grad_()
        y = fn(x)
        F.mse_loss(y, target, reduction="sum").backward()
        agreed(close(y.detach(), ref_y) and close(x.grad, ref_x.grad), f"TP MLP (DTensor ops) profile, {name}")
    steps = {name: phased(fn, leaves, x0, target) for name, (fn, leaves) in programs.items()}
    calls = {name: python_calls(step) for name, step in steps.items()}
    samples: dict[str, list[list[float]]] = {name: [] for name in steps}
    for rep in range(reps + 3):  # three warm-up repetitions
        for name, step in steps.items():
            COMM.Barrier()
            phases = step()
            if rep >= 3:
                samples[name].append(phases)
    medians = {name: [statistics.median(s[i] for s in runs) for i in range(len(PHASES) + 1)]
               for name, runs in samples.items()}
    slowest = {name: [COMM.allreduce(v, op=MPI.MAX) * 1e3 for v in values] for name, values in medians.items()}
    if RANK == 0:
        print(f"TP MLP (DTensor ops) at {N} ranks: CPU ms per phase, median of {reps} interleaved "
              f"repetitions, slowest rank; Python calls per step (rank 0, the phases' own calls included)")
        print(f"| {'step':26s} | " + " | ".join(f"{p:>8s}" for p in PHASES) + " |    total | in all-reduce | calls |")
        for name, values in slowest.items():
            print(f"| {name:26s} | " + " | ".join(f"{v:8.3f}" for v in values[:-1])
                  + f" | {sum(values[:-1]):8.3f} | {values[-1]:13.3f} | {calls[name]:5d} |")
        total = {name: sum(values[:-1]) for name, values in slowest.items()}
        mpi = slowest["mpidtensor"][-1] - slowest["mpi4py"][-1]
        math = total["local ops of mpidtensor"] - total["local ops of mpi4py"]
        print(f"mpidtensor - mpi4py: {total['mpidtensor'] - total['mpi4py']:+.3f} ms, of which the programs' local "
              f"math {math:+.3f} ms, the all-reduces {mpi:+.3f} ms")
    return {name: {"phases": slowest[name], "calls": calls[name]} for name in steps}


if __name__ == "__main__":
    main()
