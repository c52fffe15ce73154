"""Training-step time of the Llama-style model under FSDP and FSDP x TP: mpidtensor.fsdp
against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo, in one MPI job.

    mpiexec -n 4 python benchmarks/bench_fsdp.py [--dim 128] [--layers 2] [--reps 10]

Layouts: ``fsdp`` shards every block and the root over a 1-D mesh of all ranks; at 4
ranks ``fsdp x tp`` first applies the TP + SP plan of ``parallelize_llama`` over the
``tp`` dim of a 2x2 (dp, tp) mesh, then ``fully_shard`` over its ``dp`` dim. The dp ranks
train on disjoint slices of one global batch. A step is the forward, the cross entropy
(vocab-parallel under TP) and its backward, ``AdamW.step()``, ``zero_grad()`` and the loss
read back. Before timing, every (layout, library) pair trains ``--check-steps`` steps and
must match the single-process model (losses and ``full_tensor()`` of every parameter)
within ``--tol``, or it is left out. Timed steps alternate between all pairs (the same
machine load for each); a figure is the median over ``--reps`` of the slowest rank's
step time. Memory: the largest per-rank bytes of the local parameter shards, and of the
shards plus AdamW's state, against the unsharded model.
"""
import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from bench_llama_tp import comm_mode, short_counts, train_step  # noqa: E402
from bench_redistribute import init_gloo  # noqa: E402
from llama import LlamaConfig, build_model, parallelize_llama  # noqa: E402

warnings.filterwarnings("ignore", message="(FSDP2-wrapped module|Full backward hook)")
world = MPI.COMM_WORLD
n, rank = world.size, world.rank
MIB = 2 ** 20
TORCH_NAMES = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}  # FSDP2's ops


def say(*args) -> None:
    if rank == 0:
        print(*args, flush=True)


def shard(library: str, layout: str, mesh_factory, cfg: LlamaConfig, seed: int):
    """The model sharded by ``library`` in ``layout``; with its dp rank and dp size."""
    if library == "mpidtensor":
        from mpidtensor.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = build_model(cfg, seed)
    if layout == "fsdp x tp":
        mesh = mesh_factory("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_llama(model, mesh["tp"], backend=library)
        dp = mesh["dp"]
    else:
        dp = mesh_factory("cpu", (n,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dp.get_local_rank(), dp.size()


def local_nbytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def setup(library, layout, mesh_factory, cfg, args, tokens, ref_losses, ref_params):
    """Shard, check against one process, measure memory and collectives; None if left out."""
    name = f"{layout}, {library}"
    backend = library if layout == "fsdp x tp" else None  # loss_parallel only under TP
    try:
        model, dp_rank, dp_size = shard(library, layout, mesh_factory, cfg, args.seed)
        rows = slice(dp_rank * args.batch // dp_size, (dp_rank + 1) * args.batch // dp_size)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        losses = [world.allreduce(train_step(model, opt, tokens[rows], backend)) / n
                  for _ in range(args.check_steps)]
        errors = [f"loss {a} vs {b}" for a, b in zip(losses, ref_losses) if abs(a - b) > args.tol]
        for (pname, p), q in zip(model.named_parameters(), ref_params):
            diff = (p.full_tensor() - q).abs().max().item()
            if diff > args.tol:
                errors.append(f"{pname} differs by {diff:.1e}")
        with comm_mode(library) as comm:
            train_step(model, opt, tokens[rows], backend)
        params = local_nbytes(model.parameters())
        state = local_nbytes(t for s in opt.state.values() for t in s.values() if t.ndim > 0)
        memory = world.allreduce((params, params + state), op=MPI.MAX)
        counts = short_counts({TORCH_NAMES.get(str(k).rsplit(".", 1)[-1], k): v
                               for k, v in comm.get_comm_counts().items()})
    except Exception as err:  # a library that cannot run a layout is left out, not fatal
        errors = [f"{type(err).__name__}: {err}"]
    if world.allreduce(len(errors), op=MPI.MAX):
        say(f"{name}: left out ({(errors or ['on another rank'])[0]})")
        return None
    say(f"{name}: matches one process over {args.check_steps} steps (tol {args.tol})")
    return model, opt, backend, rows, memory, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384, help="SwiGLU width (even)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32, help="sequence length (even)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, a multiple of the dp size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check-steps", type=int, default=2)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.batch % n:
        parser.error(f"--batch {args.batch} must be a multiple of the rank count {n}")

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=args.seq)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    say(f"Llama-style model, {n} ranks, {cfg}, global batch {args.batch} x seq {args.seq}")

    ref = build_model(cfg, args.seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    ref_losses = [train_step(ref, ref_opt, tokens, None) for _ in range(args.check_steps)]
    ref_params = [p.detach() for p in ref.parameters()]
    full = local_nbytes(ref.parameters())

    import mpidtensor
    factories = {"mpidtensor": mpidtensor.init_device_mesh}
    gloo = init_gloo()
    if gloo is not None:
        factories["torch"] = gloo[1]
    layouts = ["fsdp"] + (["fsdp x tp"] if n == 4 else [])
    runs = {}
    for layout in layouts:
        for library, factory in factories.items():
            run = setup(library, layout, factory, cfg, args, tokens, ref_losses, ref_params)
            if run is not None:
                runs[(layout, library)] = run

    times = {key: [] for key in runs}
    for i in range(args.warmup + args.reps):
        for key, (model, opt, backend, rows, _, _) in runs.items():  # interleaved: the same load for all
            world.Barrier()
            start = MPI.Wtime()
            train_step(model, opt, tokens[rows], backend)
            elapsed = world.allreduce(MPI.Wtime() - start, op=MPI.MAX)
            if i >= args.warmup:
                times[key].append(elapsed)

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    say(f"\nmedian of {args.reps} steps (slowest rank); load average {load}; unsharded parameters "
        f"{full / MIB:.2f} MiB, with AdamW state {3 * full / MIB:.2f} MiB")
    say("| layout | library | step ms | tokens/s | params MiB/rank | + AdamW MiB/rank | collectives/step |")
    say("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for (layout, library), samples in times.items():
        ms = statistics.median(samples) * 1e3
        params, with_state = runs[(layout, library)][4]
        say(f"| {layout} | {library} | {ms:.1f} | {args.batch * args.seq / ms * 1e3:.0f} | "
            f"{params / MIB:.2f} | {with_state / MIB:.2f} | {runs[(layout, library)][5]} |")


if __name__ == "__main__":
    main()
