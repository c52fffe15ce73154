"""Train the Llama-style model of llama.py on a 4-D ("pp", "dp", "cp", "tp") mesh:
pipeline x FSDP x context x tensor parallelism.

    mpiexec -n 4 python examples/train_4d.py                     # pp 2 x tp 2
    mpiexec -n 8 python examples/train_4d.py --pp 2 --dp 2 --tp 2 [--cp 1]
    mpiexec -n 8 python examples/train_4d.py --pp 2 --cp 2 --tp 2 --check

* **pp**: the model cut into stages (examples/llama_pp.py: the embedding on the first,
  the output on the last, blocks spread evenly), run by ``mpidtensor.pipelining``'s
  schedule ``--schedule`` (1F1B by default) over ``mesh["pp"]`` with ``--microbatches``
  micro-batches per step; ``--virtual 2`` gives each rank two stages (looped), for the
  interleaved schedules.
* **dp** and **cp**: ``fully_shard`` per block and per stage over ``mesh["dp", "cp"]``
  flattened (torchtitan's recipe); FSDP reduces the gradients once per step, at each
  stage's last backward. The dp ranks read disjoint rows of the global batch.
* **cp**: ``context_parallel`` over ``mesh["cp"]`` around each step: the tokens (first
  stage), the labels (last stage) and the rotary table are sharded along the sequence,
  and attention is ring attention.
* **tp**: the TP + sequence-parallel plan of ``parallelize_llama`` over ``mesh["tp"]``,
  restricted to each stage's modules; the sequence-sharded residual crosses stages as a
  plain local tensor.

Rank 0 prints per step the loss (global mean), the step time (slowest rank), the bubble
fraction (the share of the step a rank did not compute, from per-rank timelines of each
stage's forward and backward: mean and largest over the ranks, and the theoretical
``(p - 1) / (v m + p - 1)``) and per stage the peak memory (``mpidtensor.tools.memory``:
allocated DTensor and library bytes, and the resident set, largest over the stage's
ranks). ``--check`` also trains the model in one process from the same seed and prints
the largest difference of the losses and parameters; exits 1 above ``--tol``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import add_model_args, batches, build_model, config_from_args, cross_entropy  # noqa: E402
from llama_pp import Timeline, shard_stage, split_stages, theoretical_bubble  # noqa: E402

import mpidtensor.pipelining as pipelining  # noqa: E402
from mpidtensor import DTensor, init_device_mesh  # noqa: E402
from mpidtensor.experimental import context_parallel  # noqa: E402
from mpidtensor.tools import memory  # noqa: E402

world = MPI.COMM_WORLD
MIB = 2 ** 20


@dataclass
class Result:
    """Per step: the global loss, the slowest rank's seconds, the mean and largest bubble
    fraction over the ranks; the theoretical bubble; the largest difference from one
    process (``--check``; 0 otherwise)."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    bubble_mean: list[float] = field(default_factory=list)
    bubble_max: list[float] = field(default_factory=list)
    bubble_theory: float = 0.0
    max_diff: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for dim in ("pp", "dp", "cp", "tp"):
        p.add_argument(f"--{dim}", type=int, default=None, help=f"size of the {dim} dim (default: from the world size)")
    p.add_argument("--schedule", default="Schedule1F1B", help="a schedule class of mpidtensor.pipelining")
    p.add_argument("--virtual", type=int, default=1, help="stages per rank (2 for the interleaved schedules)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--mb-size", type=int, default=2, help="rows per micro-batch per dp rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--double", action="store_true", help="train in float64 (the tests compare exactly)")
    p.add_argument("--check", action="store_true", help="compare with one process")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--no-memory", action="store_true", help="skip the per-stage memory figures")
    add_model_args(p)
    p.set_defaults(layers=4)
    return p.parse_args(argv)


def layout_of(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp): the given sizes; the missing ones pp 2, tp 2 where the world
    size allows, cp 1 and dp the rest. ValueError (on every rank) if they do not multiply
    to the world size."""
    n = world.size
    pp = args.pp or (2 if n % 2 == 0 else 1)
    tp = args.tp or (2 if n % (2 * pp) == 0 and args.dp is None else 1)
    cp = args.cp or 1
    dp = args.dp or max(1, n // (pp * tp * cp))
    if pp * dp * cp * tp != n:
        raise ValueError(f"pp {pp} x dp {dp} x cp {cp} x tp {tp} must equal the world size {n}")
    return pp, dp, cp, tp


def check_sizes(args: argparse.Namespace, layout: tuple[int, int, int, int]) -> None:
    """The sizes the parallelisms need (ValueError on every rank: all are global)."""
    pp, dp, cp, tp = layout
    if args.heads % tp or args.kv_heads % tp or args.hidden % tp:
        raise ValueError(f"--heads {args.heads}, --kv-heads {args.kv_heads} and --hidden {args.hidden} "
                         f"must divide by tp {tp}")
    if args.seq % (2 * cp * tp):
        raise ValueError(f"--seq {args.seq} must divide by 2 * cp * tp = {2 * cp * tp}")
    if pp * args.virtual > args.layers:
        raise ValueError(f"{pp * args.virtual} stages need at least as many layers (--layers {args.layers})")


def run(args: argparse.Namespace, say=print) -> Result:
    """Train ``args.steps`` steps; the measurements. Collective."""
    layout = layout_of(args)
    check_sizes(args, layout)
    pp, dp, cp, tp = layout
    cfg = config_from_args(args)
    dtype = torch.float64 if args.double else torch.float32
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("pp", "dp", "cp", "tp"))
    # FSDP x TP need sub-meshes of one mesh that together cover it: this pipeline rank's
    stage_mesh = mesh["dp", "cp", "tp"]  # ("dp", "cp", "tp") of the ranks that hold this rank's stages
    fsdp_mesh = stage_mesh["dp", "cp"]._flatten("dp_cp") if dp * cp > 1 else None
    pp_rank, num_stages = mesh.get_local_rank("pp"), pp * args.virtual
    indices = [pp_rank + v * pp for v in range(args.virtual)]
    ref = build_model(cfg, seed=0).to(dtype)
    stages = split_stages(copy.deepcopy(ref), num_stages, indices)
    timeline = Timeline()
    for stage in stages:
        shard_stage(stage, tp_mesh=stage_mesh["tp"], fsdp_mesh=fsdp_mesh)
        stage.timeline = timeline
    pipe = [pipelining.PipelineStage(s, i, num_stages, "cpu", group=mesh["pp"]) for s, i in zip(stages, indices)]
    schedule = getattr(pipelining, args.schedule)(pipe if args.virtual > 1 else pipe[0],
                                                  n_microbatches=args.microbatches, loss_fn=cross_entropy)
    first, last = 0 in indices, num_stages - 1 in indices
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr) if args.check else None
    result = Result(bubble_theory=theoretical_bubble(pp, args.microbatches, args.virtual))
    batch = dp * args.microbatches * args.mb_size
    say(f"mesh (pp, dp, cp, tp) = {layout}, {args.schedule}, {num_stages} stages, {args.microbatches} "
        f"micro-batches of {args.mb_size} x {args.seq} tokens per dp rank, {world.size} ranks")
    for step, tokens in zip(range(args.steps), batches(cfg, batch, args.seq, seed=1)):
        rows = tokens.chunk(dp)[mesh.get_local_rank("dp")]
        inputs, labels = rows[:, :-1].clone(), rows[:, 1:].clone()
        if not args.no_memory:
            memory.reset_peak_memory_stats()
        sharded = [t for t, here in ((inputs, first), (labels, last)) if here]
        buffers = sharded + [s.rope for s in stages]
        world.Barrier()
        start = time.perf_counter()
        timeline.start_step()
        losses: list[torch.Tensor] = []
        with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * len(sharded) + [0] * len(stages),
                              no_restore_buffers=set(sharded)) if cp > 1 else nullcontext():
            schedule.step(*((inputs,) if first else ()), target=labels if last else None,
                          losses=losses if last else None)
        timeline.end_step()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        mine = torch.stack(losses).mean().item() if last and mesh.get_local_rank("tp") == 0 else 0.0
        result.losses.append(world.allreduce(mine) / (dp * cp))
        result.step_s.append(world.allreduce(elapsed, op=MPI.MAX))
        bubbles = world.allgather(timeline.bubble_fraction)
        result.bubble_mean.append(sum(bubbles) / len(bubbles))
        result.bubble_max.append(max(bubbles))
        if args.check:
            loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            result.max_diff = max(result.max_diff, abs(loss.item() - result.losses[-1]))
        say(f"step {step}: loss {result.losses[-1]:.4f}  {result.step_s[-1] * 1e3:.1f} ms  bubble "
            f"{result.bubble_mean[-1]:.2f} mean, {result.bubble_max[-1]:.2f} max "
            f"(theory {result.bubble_theory:.2f})" + _memory_line(args, pp_rank))
    if args.check:
        result.max_diff = max(result.max_diff, _param_diff(stages, ref))
        say(f"largest difference from one process: {result.max_diff:.3g} (tol {args.tol})")
    return result


def _memory_line(args: argparse.Namespace, pp_rank: int) -> str:
    """Per pipeline rank (its stages): the largest peak allocated and peak resident MiB
    over the ranks holding them."""
    if args.no_memory:
        return ""
    figures = world.allgather((pp_rank, memory.max_memory_allocated() / MIB, memory.max_memory_reserved() / MIB))
    per_stage: dict[int, tuple[float, float]] = {}
    for stage, alloc, rss in figures:
        old = per_stage.get(stage, (0.0, 0.0))
        per_stage[stage] = (max(old[0], alloc), max(old[1], rss))
    return "  memory MiB (alloc/rss) " + ", ".join(
        f"pp {s}: {a:.1f}/{r:.0f}" for s, (a, r) in sorted(per_stage.items()))


def _param_diff(stages, ref) -> float:
    """The largest difference of any parameter from the one-process model (all ranks)."""
    ref_params = dict(ref.named_parameters())
    diff = 0.0
    for stage in stages:
        for name, p in stage.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            diff = max(diff, (full.detach() - ref_params[name].detach()).abs().max().item())
    return world.allreduce(diff, op=MPI.MAX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args, say=print if world.rank == 0 else (lambda *a: None))
    return 0 if not args.check or result.max_diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
