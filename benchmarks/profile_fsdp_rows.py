"""Where the FSDP rows of the benchmark of record spend a step beyond the hand-written ZeRO-3.

    mpiexec -n 4 python benchmarks/profile_fsdp_rows.py [--reps 31] [--top 30] [--rows llama,stack,tp]

The rows are ``record_steps``' FSDP Llama (the demo's model, every block and the root
``fully_shard``-ed), FSDP stack (4 x ``Linear(1024)``) and, at 4 ranks only, FSDP x TP (the
demo's own 2x2 step against ``record_2d``'s ZeRO-3 over dp of Megatron-SP blocks over tp),
each mpidtensor step and its ``record_steps.Zero3`` step checked against one process first.
Rank 0 prints, per row:

1. Python calls of one step (``sys.setprofile``, rank 0), mpidtensor minus ``Zero3`` per
   function: a figure machine load does not move (the step split into phases below, so
   about ten calls more than ``record_steps.python_calls`` counts for the record's step).
2. CPU per phase (``time.process_time``: time descheduled is not counted, which makes it
   usable on a loaded machine; time spinning in an MPI wait is), the two steps interleaved,
   median / min over ``--reps`` of the slowest rank: forward, loss, backward (mpidtensor's
   reduce-scatters run inside it), ``Zero3``'s reduce-scatters after it, optimizer.
3. CPU per step inside FSDP's group methods, median of the slowest rank (the all-gather's
   start and wait, the copy out of a multi-parameter group, the unsharded storage, the
   gradient pack and reduce-scatter); nested, so the lines overlap. The methods are wrapped in this script only.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fsdp  # noqa: E402
import record_steps as rs  # noqa: E402
import record_2d  # noqa: E402
from bench_llama_tp import train_step  # noqa: E402
from llama import LlamaConfig, build_model, cross_entropy, loss_parallel_context  # noqa: E402
from train_fsdp_tp import parse_args as demo_args  # noqa: E402

import mpidtensor as md  # noqa: E402
from mpidtensor.comm import nonblocking  # noqa: E402
from mpidtensor.fsdp import group as fsdp_group  # noqa: E402
from mpidtensor.fsdp import packing  # noqa: E402

COMM, N, RANK = rs.COMM, rs.N, rs.RANK
PHASES = ("forward", "loss", "backward", "Zero3 reduce-scatters", "optimizer")


class Row:
    """One row's two steps, each split into PHASES: ``inputs``/``loss_of`` make the
    forward's input and the loss of its output for a batch (``zero_loss_of`` the hand-written
    step's, if it differs); mpidtensor's loss and backward run inside ``md_context()``."""

    def __init__(self, name: str, model, opt, batch, zero: rs.Zero3, zero_batch,
                 inputs: Callable, loss_of: Callable, zero_loss_of: Callable | None = None,
                 md_context: Callable = contextlib.nullcontext) -> None:
        self.name, self.model, self.opt, self.batch = name, model, opt, batch
        self.zero, self.zero_batch, self.inputs, self.loss_of = zero, zero_batch, inputs, loss_of
        self.zero_loss_of, self.md_context = zero_loss_of or loss_of, md_context

    def md_step(self) -> list[float]:
        t = [time.process_time()]
        out = self.model(self.inputs(self.batch))
        t.append(time.process_time())
        with self.md_context():
            loss = self.loss_of(out, self.batch)
            t.append(time.process_time())
            loss.backward()
        t.append(time.process_time())
        t.append(time.process_time())
        self.opt.step()
        self.opt.zero_grad()
        t.append(time.process_time())
        return [b - a for a, b in zip(t, t[1:])]

    def zero_step(self) -> list[float]:
        zero = self.zero
        t = [time.process_time()]
        if zero.root is not None:
            zero._gather(zero.root)
        out = zero.model(self.inputs(self.zero_batch))
        t.append(time.process_time())
        loss = self.zero_loss_of(out, self.zero_batch)
        t.append(time.process_time())
        loss.backward()
        t.append(time.process_time())
        zero.reduce_gradients()
        t.append(time.process_time())
        zero.opt.step()
        zero.opt.zero_grad()
        t.append(time.process_time())
        return [b - a for a, b in zip(t, t[1:])]


def demo_reference(dp: int):
    """The demo's config, run arguments (batch 4 rows per data-parallel rank), tokens, and one
    process's model and losses over two steps: what both demo-model rows check against."""
    demo = demo_args([])
    cfg = LlamaConfig(vocab_size=demo.vocab, dim=demo.dim, n_layers=demo.layers, n_heads=demo.heads,
                      n_kv_heads=demo.kv_heads, hidden_dim=demo.hidden, max_seq_len=demo.seq)
    args = argparse.Namespace(seed=0, batch=4 * dp, lr=demo.lr, check_steps=2, tol=demo.tol)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, demo.seq + 1), generator=torch.Generator().manual_seed(1))
    ref = build_model(cfg, args.seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    ref_losses = [train_step(ref, ref_opt, tokens, None) for _ in range(args.check_steps)]
    return cfg, args, tokens, ref, ref_losses


def llama_row() -> Row:
    """The FSDP Llama row of ``record_steps.fsdp_rows``, both steps checked."""
    cfg, args, tokens, ref, ref_losses = demo_reference(N)
    run = bench_fsdp.setup("mpidtensor", "fsdp", md.init_device_mesh, cfg, args, tokens, ref_losses,
                           [p.detach() for p in ref.parameters()])
    rs.agreed(run is not None, "fsdp, mpidtensor")
    zero = rs.Zero3(build_model(cfg, args.seed), args.lr)
    mine = tokens[RANK * args.batch // N:(RANK + 1) * args.batch // N]
    losses = [COMM.allreduce(zero.step(mine)) / N for _ in range(args.check_steps)]
    rs.agreed(all(abs(a - b) <= args.tol for a, b in zip(losses, ref_losses)), "fsdp, mpi4py ZeRO-3")
    return Row("FSDP Llama", run[0], run[1], tokens[run[3]], zero, mine,
               lambda b: b[:, :-1], lambda logits, b: cross_entropy(logits, b[:, 1:]))


def tp_row() -> Row:
    """The FSDP x TP row of ``record_steps.fsdp_rows`` (4 ranks: dp 2 x tp 2), both steps
    checked; the hand-written one is ``record_2d``'s."""
    if N != 4:
        raise SystemExit("the FSDP x TP row runs on 4 ranks (a 2x2 mesh)")
    dp = 2
    cfg, args, tokens, ref, ref_losses = demo_reference(dp)
    run = bench_fsdp.setup("mpidtensor", "fsdp x tp", md.init_device_mesh, cfg, args, tokens, ref_losses,
                           [p.detach() for p in ref.parameters()])
    rs.agreed(run is not None, "fsdp x tp, mpidtensor")
    zero, mine, zero_loss_of = record_2d.zero3_tp(cfg, args, tokens, ref_losses, ref, args.check_steps, dp, N // dp,
                                                  rs.Zero3, rs.agreed, rs.close)
    return Row("FSDP x TP", run[0], run[1], tokens[run[3]], zero, mine, lambda b: b[:, :-1],
               lambda logits, b: cross_entropy(logits, b[:, 1:]), zero_loss_of,
               lambda: loss_parallel_context(run[2]))


def stack_row() -> Row:
    """The FSDP stack row of ``record_steps.stack_row``, both steps checked."""
    layers, width, rows = rs.STACK
    lr, tol = 1e-3, 1e-4
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(rows * N, width, generator=gen), torch.randn(rows * N, width, generator=gen)
    mine = (x[RANK * rows:(RANK + 1) * rows], target[RANK * rows:(RANK + 1) * rows])
    ref = rs.LinearStack(layers, width)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses = [rs.adam_step(ref, ref_opt, (x, target)) for _ in range(2)]
    model = rs.sharded_stack("mpidtensor", md.init_device_mesh, layers, width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    zero = rs.Zero3(rs.LinearStack(layers, width), lr, rs.stack_loss)
    for what, step in (("mpidtensor", lambda: rs.adam_step(model, opt, mine)), ("mpi4py ZeRO-3", lambda: zero.step(mine))):
        losses = [COMM.allreduce(step()) / N for _ in range(2)]
        rs.agreed(all(abs(a - b) <= tol for a, b in zip(losses, ref_losses)), f"FSDP Linear stack, {what}")
    return Row("FSDP stack", model, opt, mine, zero, mine, lambda b: b[0], lambda out, b: F.mse_loss(out, b[1]))


def calls_by_function(fn: Callable[[], object]) -> collections.Counter:
    """Python calls (functions and builtins) of one ``fn()``, by function."""
    counts: collections.Counter = collections.Counter()
    root = str(Path(__file__).resolve().parent.parent) + "/"

    def profile(frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            name = code.co_filename.replace(root, "").split("site-packages/")[-1]
            counts[f"{name}:{code.co_firstlineno} {code.co_name}"] += 1
        elif event == "c_call":
            counts[f"C {getattr(arg, '__qualname__', arg)}"] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def group_method_cpu(row: Row, steps: int) -> dict[str, float]:
    """CPU seconds per mpidtensor step inside FSDP's group methods (wrapped for the run):
    per method the median over ``steps`` of the slowest rank."""
    spent: collections.Counter = collections.Counter()
    targets = [(fsdp_group.ParamGroup, n) for n in ("start_unshard", "finish_unshard", "_ensure_unsharded_storage",
                                                    "_free_unsharded_storage", "post_backward", "_start_reduce",
                                                    "finish_reduce")]
    targets += [(nonblocking.Handle, "wait"), (nonblocking.Posted, "wait"), (packing, "pack_ranks"),
                (torch, "split_with_sizes_copy")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def timed(label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            begun = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.process_time() - begun
        return run
    for owner, name, fn in saved:
        setattr(owner, name, timed(f"{getattr(owner, '__name__', owner)}.{name}", fn))
    per_step: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for _ in range(steps):
            COMM.Barrier()
            spent.clear()
            row.md_step()
            for label in sorted(spent):  # (the same labels on every rank: the same step)
                per_step[label].append(COMM.allreduce(spent[label], op=MPI.MAX))
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {label: statistics.median(seconds) for label, seconds in per_step.items()}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Profile the rows, print on rank 0; returns per row its call counts, its phase
    samples (CPU seconds, per repetition and phase) and the group methods' CPU per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--rows", default="llama,stack", help="of llama, stack, tp (4 ranks)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    builders = {"llama": llama_row, "stack": stack_row, "tp": tp_row}
    results = {}
    for row in [builders[name]() for name in args.rows.split(",")]:
        for _ in range(2):
            row.md_step(), row.zero_step()
        mine, zero = calls_by_function(row.md_step), calls_by_function(row.zero_step)
        samples: dict[str, list[list[float]]] = {"mpidtensor": [], "Zero3": []}
        for rep in range(args.reps):
            for lib, step in ((("mpidtensor", row.md_step), ("Zero3", row.zero_step))[::1 if rep % 2 else -1]):
                COMM.Barrier()
                phases = step()
                samples[lib].append([COMM.allreduce(t, op=MPI.MAX) for t in phases])
        groups = group_method_cpu(row, max(5, args.reps // 3))
        results[row.name] = {"calls": {"mpidtensor": mine, "Zero3": zero}, "phases": samples, "groups": groups}
        if RANK == 0:
            report(row.name, mine, zero, samples, groups, args.top)
    return results


def report(name: str, mine: collections.Counter, zero: collections.Counter, samples: dict[str, list[list[float]]],
           groups: dict[str, float], top: int) -> None:
    diff = mine.copy()
    diff.subtract(zero)
    print(f"\n== {name}, {N} ranks: Python calls per step, rank 0: mpidtensor {sum(mine.values())}, "
          f"Zero3 {sum(zero.values())}; mpidtensor minus Zero3 by function:")
    for function, count in diff.most_common(top):
        print(f"  {count:6d}  {function}")
    print(f"-- CPU ms per phase, median / min of {len(samples['Zero3'])}, slowest rank (process_time)")
    for lib, rows in samples.items():
        parts = [f"{p} {statistics.median(c) * 1e3:.2f} / {min(c) * 1e3:.2f}" for p, c in zip(PHASES, zip(*rows))]
        totals = [sum(r) for r in rows]
        print(f"  {lib:10s} " + ", ".join(parts) + f"; step {statistics.median(totals) * 1e3:.2f} / {min(totals) * 1e3:.2f}")
    print("-- CPU ms per mpidtensor step in FSDP group methods (nested; median of the slowest rank)")
    for method, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds * 1e3:7.3f}  {method}")


if __name__ == "__main__":
    main()
