"""The optimizer part of the FSDP step: torch.optim on DTensor parameters against the same
optimizer on plain tensors of the same local shapes, in one process per rank.

    mpiexec -n 2 python benchmarks/bench_fsdp_optim.py [--reps 40]

The parameters are those of the demo's Llama-style model (``examples/train_fsdp_tp.py``'s
sizes), each ``Shard(0)`` over a 1-D mesh of all ranks as ``fully_shard`` leaves them;
the plain ones are copies of the local shards. Modes: the single-tensor loop (torch's
default on CPU: one dispatch per op and parameter), ``foreach=True`` and ``fused=True``.
Steps alternate between DTensor and plain; a figure is the median over ``--reps`` of the
CPU time of one step (``time.thread_time``: it does not count time the rank spent
descheduled, so it means something on a loaded machine), the largest over ranks. Also
per mode: Python calls per step (cProfile), the DTensor step's overhead per dispatched
op, whether the local results are bit-equal, and the plan cache's growth after the
first step (it must be 0).
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from llama import LlamaConfig, build_model  # noqa: E402
from train_fsdp_tp import parse_args as demo_args  # noqa: E402

import mpidtensor as md  # noqa: E402
from mpidtensor import dispatch  # noqa: E402  (its plan cache's size)

COMM = MPI.COMM_WORLD
MODES = {"single-tensor": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def parameters() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(DTensor parameters with gradients, plain copies of their local shards and gradients)."""
    demo = demo_args([])
    cfg = LlamaConfig(vocab_size=demo.vocab, dim=demo.dim, n_layers=demo.layers, n_heads=demo.heads,
                      n_kv_heads=demo.kv_heads, hidden_dim=demo.hidden, max_seq_len=demo.seq)
    mesh = md.init_device_mesh("cpu", (COMM.size,))
    dist = [torch.nn.Parameter(md.distribute_tensor(p.detach(), mesh, [md.Shard(0)]))
            for p in build_model(cfg, 0).parameters()]
    gen = torch.Generator().manual_seed(1)
    plain = []
    for d in dist:
        d.grad = md.distribute_tensor(torch.randn(d.shape, generator=gen), mesh, [md.Shard(0)])
        p = torch.nn.Parameter(d._local_tensor.detach().clone())
        p.grad = d.grad._local_tensor.clone()
        plain.append(p)
    return dist, plain


def ops_per_step(opt: torch.optim.Optimizer) -> int:
    """Aten ops run on DTensors in one step (each is one DTensor dispatch)."""
    count = [0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += any(isinstance(t, md.DTensor) for t in tree_leaves((args, kwargs)))
            return func(*args, **(kwargs or {}))

    with Counting():
        opt.step()
    return count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    dist, plain = parameters()
    rows = []
    for mode, kwargs in MODES.items():
        opts = {"DTensor": torch.optim.AdamW(dist, lr=args.lr, **kwargs),
                "plain": torch.optim.AdamW(plain, lr=args.lr, **kwargs)}
        for opt in opts.values():
            opt.step()
        plans = len(dispatch._PLANS)
        samples = {k: [] for k in opts}
        for _ in range(args.reps):
            for k, opt in opts.items():
                start = time.thread_time()
                opt.step()
                samples[k].append(time.thread_time() - start)
        grown = len(dispatch._PLANS) - plans
        calls = {}
        for k, opt in opts.items():
            prof = cProfile.Profile()
            prof.enable()
            opt.step()
            prof.disable()
            calls[k] = pstats.Stats(prof).total_calls
        ops = ops_per_step(opts["DTensor"])
        opts["plain"].step()
        equal = all(torch.equal(d._local_tensor, p.detach()) for d, p in zip(dist, plain))
        ms = {k: COMM.allreduce(statistics.median(v), op=MPI.MAX) * 1e3 for k, v in samples.items()}
        equal = COMM.allreduce(equal, op=MPI.LAND)
        rows.append((mode, ms["DTensor"], ms["plain"], ops, (ms["DTensor"] - ms["plain"]) * 1e3 / max(ops, 1),
                     calls["DTensor"], calls["plain"], equal, grown))
    if COMM.rank == 0:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(f"AdamW on the demo Llama's {len(dist)} parameters, Shard(0) over {COMM.size} ranks; "
              f"CPU ms per step, median of {args.reps}, slowest rank; load average {load}")
        print("| mode | DTensor ms | plain ms | ops dispatched | µs per op over plain | Python calls DTensor / plain "
              "| bit-equal | plans added after step 1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for mode, d, p, ops, per_op, cd, cp, equal, grown in rows:
            print(f"| {mode} | {d:.2f} | {p:.2f} | {ops} | {per_op:.1f} | {cd} / {cp} | {equal} | {grown} |")


if __name__ == "__main__":
    main()
