"""FSDP's cost per module: many small modules, mpidtensor against torch's FSDP2 on gloo.

    mpiexec -n 4 python benchmarks/bench_fsdp_overhead.py [--modules 64] [--width 64] [--rows 8] [--reps 15]

The model is ``--modules`` bias-free ``Linear(width, width)`` in a row, each one
``fully_shard``-ed (and the root), so the step is almost all FSDP machinery: hooks,
tiny all-gathers and reduce-scatters. A step is forward, backward of the squared sum
and ``zero_grad``. Every library's step is checked against one process first (loss and
gradients), then the steps run interleaved (the same load for each); a figure is the
median over ``--reps`` of the slowest rank. Per module per step:

* ``us/module``: (FSDP step - the same model's plain local step) / modules;
* ``calls/module``: Python function calls per module per step (``cProfile``), a count
  that machine load does not change.

``measure`` returns the figures (``main`` prints them), for a row of the benchmark of record.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_redistribute import init_gloo  # noqa: E402

warnings.filterwarnings("ignore", message="(FSDP2-wrapped module|Full backward hook)")
COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank


def chain(modules: int, width: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(modules)))


def sharded(lib: str, mesh_factory: Callable, modules: int, width: int) -> nn.Sequential:
    fully_shard = importlib.import_module("mpidtensor.fsdp" if lib == "mpidtensor" else "torch.distributed.fsdp").fully_shard
    model, mesh = chain(modules, width), mesh_factory("cpu", (N,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step_of(model: nn.Module, x: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        loss = model(x).square().sum()
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item()
    return step


def checked(model: nn.Module, x: torch.Tensor, ref: nn.Module, xs: torch.Tensor) -> bool:
    """Sharded loss (summed over ranks) and gradients equal one process's on the whole batch."""
    loss = model(x).square().sum()
    loss.backward()
    ref_loss = ref(xs).square().sum()
    ref_loss.backward()
    ok = abs(COMM.allreduce(loss.item()) - ref_loss.item()) <= 1e-4 * (1 + abs(ref_loss.item()))
    for p, q in zip(model.parameters(), ref.parameters()):
        g = p.grad.full_tensor() * N  # FSDP averages over ranks; the reference sums the batch
        ok = ok and bool((g - q.grad).abs().max() <= 1e-4 * (1 + q.grad.abs().max()))
        p.grad = q.grad = None
    return COMM.allreduce(ok, op=MPI.LAND)


def calls_per_step(step: Callable[[], float], steps: int = 3) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return sum(v[1] for v in pstats.Stats(profile).stats.values()) / steps


def measure(modules: int = 64, width: int = 64, rows: int = 8, reps: int = 15, gloo=None) -> dict[str, dict]:
    """Per library: median step seconds, µs per module over the plain step, calls per module."""
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(rows * N, width, generator=gen)
    x = xs[RANK * rows:(RANK + 1) * rows]
    factories = {"mpidtensor": importlib.import_module("mpidtensor").init_device_mesh}
    if gloo:
        factories["torch"] = gloo[1]
    steps = {"plain": step_of(chain(modules, width), x)}
    for lib, factory in factories.items():
        model = sharded(lib, factory, modules, width)
        if not checked(model, x, chain(modules, width), xs):
            raise SystemExit(f"{lib}: FSDP step differs from one process")
        steps[lib] = step_of(model, x)
    for step in steps.values():  # warm-up (lazy init, recorded order)
        step()
    calls = {k: COMM.allreduce(calls_per_step(f), op=MPI.MAX) for k, f in steps.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, f in steps.items():
            COMM.Barrier()
            start = time.perf_counter()
            f()
            times[k].append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    plain = statistics.median(times["plain"])
    out = {}
    for k in steps:
        t = statistics.median(times[k])
        out[k] = {"step_s": t, "us_per_module": (t - plain) / modules * 1e6,
                  "calls_per_module": (calls[k] - calls["plain"]) / modules}
    return out


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8, help="batch rows per rank")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    gloo = None if args.no_torch else init_gloo()
    rows = measure(args.modules, args.width, args.rows, args.reps, gloo)
    if RANK == 0:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(f"{N} ranks, {args.modules} x Linear({args.width}, {args.width}), {args.rows} rows/rank, "
              f"median of {args.reps}, load average {load}")
        print("| library | step ms | us/module over plain | Python calls/module |")
        print("| --- | ---: | ---: | ---: |")
        for k, r in rows.items():
            print(f"| {k} | {r['step_s'] * 1e3:.2f} | {r['us_per_module']:.1f} | {r['calls_per_module']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
