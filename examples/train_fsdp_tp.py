"""Train the Llama-style model of llama.py with FSDP x TP on a 2x2 (dp, tp) mesh.

    mpiexec -n 4 python examples/train_fsdp_tp.py [--steps 5] [--batch 8] [--seq 32]

At 4 ranks the model is sharded with the TP + SP plan of ``parallelize_llama`` over the
mesh's ``tp`` dim, then ``fully_shard`` (per block, then the root) over its ``dp`` dim;
on any other rank count it falls back to FSDP alone on a 1-D mesh of all ranks. Every
rank of a tp group reads the same tokens; the dp ranks read disjoint slices of the
batch, so the global batch is the single-process batch (FSDP averages the gradients).

Rank 0 prints per AdamW step the loss, the throughput (global tokens per second of the
slowest rank) and the collectives of the step (``CommDebugMode``); then the per-rank
memory table (``mpidtensor.tools.memory.memory_summary``) after training with FSDP, and after
one step of the same model without FSDP (TP only over the same ``tp`` dim, of size 1 on
the fallback: replicated); then the largest difference of the losses and of every
parameter (``full_tensor()``) from the same model trained in one process from the same
seed. Exits 1 if that difference exceeds ``--tol``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import (LlamaConfig, add_model_args, batches, build_model, config_from_args,  # noqa: E402
                   cross_entropy, parallelize_llama)

from mpidtensor import DTensor, init_device_mesh  # noqa: E402
from mpidtensor.debug import CommDebugMode  # noqa: E402
from mpidtensor.fsdp import fully_shard  # noqa: E402
from mpidtensor.tools.memory import memory_summary, reset_peak_memory_stats  # noqa: E402
from mpidtensor.parallel import loss_parallel  # noqa: E402

world = MPI.COMM_WORLD


@dataclass
class Result:
    """What one run measured: per-step losses (global mean), step seconds (slowest rank)
    and the largest difference from the single-process run."""

    losses: list[float]
    step_s: list[float]
    max_diff: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tol


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 4 per dp rank)")
    parser.add_argument("--seq", type=int, default=32)
    add_model_args(parser)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--no-tp", action="store_true", help="FSDP alone on a 1-D mesh even at 4 ranks")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory tables")
    return parser.parse_args(argv)


def make_mesh(no_tp: bool = False):
    """(dp, tp) mesh: 2x2 at 4 ranks, else (world, 1) for the fallback."""
    tp = 2 if world.size == 4 and not no_tp else 1
    return init_device_mesh("cpu", (world.size // tp, tp), mesh_dim_names=("dp", "tp"))


def shard_model(model, mesh):
    """FSDP x TP (tp > 1) or FSDP alone over the 1-D dp mesh (tp == 1)."""
    if mesh.size("tp") > 1:
        parallelize_llama(model, mesh["tp"])
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world.size,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp)


def train_step(model, opt, tokens: torch.Tensor, tp: bool) -> torch.Tensor:
    """Forward, cross entropy (vocab-parallel under TP), backward, AdamW; the local loss."""
    logits = model(tokens[:, :-1])
    if tp:
        with loss_parallel():
            loss = cross_entropy(logits, tokens[:, 1:])
            loss.backward()
    else:
        loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def run(args: argparse.Namespace, say=print) -> Result:
    """Train sharded and in one process; ``say`` prints on rank 0. Collective."""
    mesh = make_mesh(args.no_tp)
    dp_size, tp_size = mesh.size("dp"), mesh.size("tp")
    batch = 4 * dp_size if args.batch is None else args.batch
    if batch % dp_size or args.seq % tp_size or args.hidden % tp_size:
        raise ValueError(f"--batch must divide by dp {dp_size}, --seq and --hidden by tp {tp_size}")
    cfg = config_from_args(args)
    dp_comm, dp_rank = mesh.get_group("dp"), mesh.get_local_rank("dp")
    rows = slice(dp_rank * batch // dp_size, (dp_rank + 1) * batch // dp_size)
    tp = tp_size > 1
    say(f"{world.size} ranks, {'FSDP x TP' if tp else 'FSDP'} on {mesh}\n{cfg}\nglobal batch {batch} x seq {args.seq}")

    ref = build_model(cfg, seed=0)
    model = shard_model(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    reset_peak_memory_stats()
    losses, ref_losses, times = [], [], []
    for step, tokens in zip(range(args.steps), batches(cfg, batch, args.seq, seed=1)):
        world.Barrier()
        start = MPI.Wtime()
        with CommDebugMode() as comm:
            local = train_step(model, opt, tokens[rows], tp).item()
        times.append(world.allreduce(MPI.Wtime() - start, op=MPI.MAX))
        losses.append(dp_comm.allreduce(local) / dp_size)
        ref_losses.append(train_step(ref, ref_opt, tokens, tp=False).item())
        counts = ", ".join(f"{k} {v}" for k, v in sorted(Counter(comm.get_comm_counts()).items()))
        say(f"step {step}  loss {losses[-1]:.4f}  {batch * args.seq / times[-1]:7.0f} tokens/s  "
            f"{times[-1] * 1e3:6.1f} ms  [{counts}]")

    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    ref_params = dict(ref.named_parameters())
    param_diff = max((p.full_tensor() - ref_params[name]).abs().max().item() for name, p in model.named_parameters())
    if not args.no_memory:
        say("\nper-rank memory after training, with FSDP:")
        memory_summary(file=sys.stdout)
        del model, opt
        gc.collect()
        _memory_without_fsdp(cfg, mesh, tokens[rows], args.lr, say)
    result = Result(losses, times, max(loss_diff, param_diff), args.tol)
    say(f"\nlargest difference from one process: loss {loss_diff:.1e}, parameters {param_diff:.1e} "
        f"({'ok' if result.ok else 'ABOVE'} --tol {args.tol})")
    return result


def _memory_without_fsdp(cfg: LlamaConfig, mesh, tokens: torch.Tensor, lr: float, say) -> None:
    """The memory table after one AdamW step of the model without FSDP: TP over ``tp``
    (replicated DTensors where it has size 1). Memory only: no gradient sync over dp."""
    reset_peak_memory_stats()
    model = parallelize_llama(build_model(cfg, seed=0), mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    train_step(model, opt, tokens, tp=True)
    what = "TP only" if mesh.size("tp") > 1 else "replicated"
    say(f"\nper-rank memory after one step without FSDP ({what}):")
    memory_summary(file=sys.stdout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    result = run(args, say=lambda *a: world.rank == 0 and print(*a, flush=True))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
