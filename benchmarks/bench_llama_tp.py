"""Training-step time of the Llama-style model with TP + SP + loss_parallel: mpidtensor
against torch.distributed.tensor on gloo, in one job over the same ranks.

    mpiexec -n 4 python benchmarks/bench_llama_tp.py [--dim 256] [--layers 2] [--seq 64] [--reps 20]

One step: forward of ``examples/llama.py``'s Transformer sharded by ``parallelize_llama``
(the same plan on both libraries), the vocab-parallel cross entropy and its backward
under ``loss_parallel()``, ``AdamW.step()`` and ``zero_grad()``, and the loss read back
(a sync point). Synthetic tokens from a fixed seed; every rank of the 1-D TP mesh sees
the same batch. Before timing, each library trains ``--check-steps`` steps from the same
initial weights as a single-process model; its losses and parameters (``full_tensor()``)
must match that reference, or the library is left out of the timing. The timed steps
then alternate between the libraries (so both see the same machine load); a figure is
the median over ``--reps`` of the slowest rank's step time, after ``--warmup`` steps.
The collectives of one step (CommDebugMode) are printed beside it.
"""
import argparse
import contextlib
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from bench_redistribute import init_gloo  # noqa: E402
from llama import LlamaConfig, build_model, cross_entropy, loss_parallel_context, parallelize_llama  # noqa: E402

world = MPI.COMM_WORLD
n, rank = world.size, world.rank


def say(*args) -> None:
    if rank == 0:
        print(*args, flush=True)


def train_step(model, opt, tokens, backend):
    """One optimizer step; returns the loss as a float (every rank)."""
    logits = model(tokens[:, :-1])
    with loss_parallel_context(backend) if backend else contextlib.nullcontext():
        loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def comm_mode(backend):
    if backend == "mpidtensor":
        from mpidtensor.debug import CommDebugMode
    else:
        from torch.distributed.tensor.debug import CommDebugMode
    return CommDebugMode()


def short_counts(counts) -> str:
    """'all_gather 5, reduce_scatter 5' from either library's CommDebugMode counts."""
    named = Counter()
    for kind, count in counts.items():
        name = str(kind).rsplit(".", 1)[-1].removesuffix("_into_tensor").removesuffix("_tensor")
        named[name] += count
    return ", ".join(f"{k} {v}" for k, v in sorted(named.items())) or "none"


def setup(backend, mesh_factory, cfg, args, tokens, ref_losses, ref_params):
    """Build and check one library's model; (model, optimizer, counts, max errors) or None."""
    try:
        mesh = mesh_factory("cpu", (n,))
        model = parallelize_llama(build_model(cfg, args.seed), mesh, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        losses = [train_step(model, opt, tokens, backend) for _ in range(args.check_steps)]
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_err = max((p.full_tensor() - q).abs().max().item()
                        for p, q in zip(model.parameters(), ref_params))
        with comm_mode(backend) as comm:
            train_step(model, opt, tokens, backend)
        counts = short_counts(comm.get_comm_counts())
        ok = loss_err <= args.tol and param_err <= args.tol
        error = None if ok else f"differs from one process: loss {loss_err:.2e}, params {param_err:.2e}"
    except Exception as err:  # a missing feature: leave this library out on every rank
        error = f"{type(err).__name__}: {err}"
    errors = [e for e in world.allgather(error) if e]
    if errors:
        say(f"{backend}: left out ({errors[0]})")
        return None
    say(f"{backend}: matches one process over {args.check_steps} steps "
        f"(max |loss diff| {loss_err:.1e}, max |param diff| {param_err:.1e}); per step: {counts}")
    return model, opt, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768, help="SwiGLU width (a multiple of the rank count)")
    parser.add_argument("--vocab", type=int, default=1001)
    parser.add_argument("--seq", type=int, default=64, help="sequence length (a multiple of the rank count)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.seq % n or args.hidden % n:
        parser.error(f"--seq {args.seq} and --hidden {args.hidden} must be multiples of the rank count {n}")

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=args.seq)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    say(f"Llama-style model, {n} ranks (1-D TP mesh), {cfg}, batch {args.batch} x seq {args.seq}")

    ref = build_model(cfg, args.seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    ref_losses = [train_step(ref, ref_opt, tokens, None) for _ in range(args.check_steps)]
    ref_params = [p.detach() for p in ref.parameters()]

    runs = {}
    try:
        import mpidtensor
        runs["mpidtensor"] = setup("mpidtensor", mpidtensor.init_device_mesh, cfg, args, tokens,
                                   ref_losses, ref_params)
    except ImportError as err:
        say(f"mpidtensor: left out ({err})")
    gloo = init_gloo()
    if gloo is not None:
        runs["torch gloo"] = setup("torch", gloo[1], cfg, args, tokens, ref_losses, ref_params)
    runs = {name: run for name, run in runs.items() if run is not None}

    times = {name: [] for name in runs}
    for i in range(args.warmup + args.reps):
        for name, (model, opt, _) in runs.items():  # interleaved: the same load for both
            world.Barrier()
            start = MPI.Wtime()
            train_step(model, opt, tokens, "torch" if name == "torch gloo" else name)
            elapsed = world.allreduce(MPI.Wtime() - start, op=MPI.MAX)
            if i >= args.warmup:
                times[name].append(elapsed)

    say(f"\nstep time, median of {args.reps} (slowest rank), ms")
    for name, samples in times.items():
        say(f"  {name:<11} {statistics.median(samples) * 1e3:9.2f}   collectives per step: {runs[name][2]}")
    if len(times) == 2:
        md, tg = (statistics.median(times[k]) for k in ("mpidtensor", "torch gloo"))
        say(f"  mpidtensor / torch gloo = {md / tg:.2f}")


if __name__ == "__main__":
    main()
