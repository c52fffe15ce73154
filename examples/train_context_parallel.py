"""Train the Llama-style model of llama.py on a 3-D (dp, cp, tp) mesh: FSDP x CP x TP.

    mpiexec -n 4 python examples/train_context_parallel.py [--dp 1 --cp 2 --tp 2] [--seq 8192] [--check]
    mpiexec -n 8 python examples/train_context_parallel.py --dp 2 --cp 2 --tp 2

* **tp**: the TP + sequence-parallel plan of ``parallelize_llama`` over ``mesh["tp"]``.
* **cp**: ``mpidtensor.experimental.context_parallel`` over ``mesh["cp"]``: the inputs,
  the (pre-shifted) labels and the rotary table are cut into ``2 * cp`` chunks along the
  sequence, rank ``r`` of the cp group keeping chunks ``r`` and ``2 cp - 1 - r``, and
  ``scaled_dot_product_attention`` runs ring attention over the cp group.
* **dp**: the dp groups read disjoint rows of the batch. The ranks along cp hold the same
  parameters but different tokens, so FSDP shards (and averages the gradients) over dp
  and cp together, as torchtitan does.

The loss of a rank is the mean over its tokens; every rank of the dp x cp group holds as
many tokens, so their average is the mean over the whole batch, the loss of one process.

**Memory budget.** A rank's activation memory grows with the tokens it holds. The
example measures, per rank, the bytes autograd keeps for backward during a step (the
distinct storages ``saved_tensors_hooks`` see, the gathered weights included), the peak
resident set size (``mpidtensor.tools.memory.max_memory_reserved``) and its growth during the
step, then (rank 0 alone, ``--skip-cp1`` skips it) the saved bytes of one dp group's
whole sequence on one rank without any parallelism, and compares both with
``--budget-mib`` of activations per rank. The defaults (8192 tokens, 128 MiB) do not fit
one rank (~210 MiB) and fit with cp = 2 x tp = 2 (~60 MiB per rank).

``--check`` also trains the same model in one process from the same seed and prints the
largest difference of the losses and parameters (exits 1 above ``--tol``).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import (LlamaConfig, Transformer, add_model_args, batches, build_model,  # noqa: E402
                   config_from_args, cross_entropy, parallelize_llama)

from mpidtensor import DTensor, DeviceMesh, init_device_mesh  # noqa: E402
from mpidtensor.experimental import context_parallel  # noqa: E402
from mpidtensor.fsdp import fully_shard  # noqa: E402
from mpidtensor.tools.memory import max_memory_reserved, memory_reserved, reset_peak_memory_stats  # noqa: E402
from mpidtensor.parallel import loss_parallel  # noqa: E402

world = MPI.COMM_WORLD
MIB = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@dataclass(frozen=True)
class Layout:
    """Sizes of the (dp, cp, tp) mesh."""

    dp: int
    cp: int
    tp: int

    @classmethod
    def default(cls, world_size: int) -> "Layout":
        """(world / 4, 2, 2) on multiples of 4 ranks, else CP over all ranks."""
        if world_size % 4 == 0:
            return cls(world_size // 4, 2, 2)
        return cls(1, world_size, 1)


@dataclass
class Meshes:
    """The 3-D mesh and the meshes each parallelism runs on (see :func:`make_meshes`)."""

    mesh: DeviceMesh  # ("dp", "cp", "tp")
    fsdp: DeviceMesh  # dp and cp flattened: "dp_cp"
    tp: DeviceMesh | None  # None when tp == 1 (no TP)
    cp: DeviceMesh

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")


def make_meshes(layout: Layout) -> Meshes:
    """The ("dp", "cp", "tp") mesh over all ranks and its sub-meshes. Collective.

    FSDP runs on ``mesh["dp", "cp"]._flatten("dp_cp")`` (torchtitan's recipe: the cp ranks
    hold the same parameters and see different tokens, so their gradients are reduced
    together with the dp ranks'), TP on ``mesh["tp"]``, CP on ``mesh["cp"]``.
    """
    if layout.dp * layout.cp * layout.tp != world.size:
        raise ValueError(f"dp x cp x tp = {layout.dp} x {layout.cp} x {layout.tp} must equal the "
                         f"{world.size} ranks")
    mesh = init_device_mesh("cpu", (layout.dp, layout.cp, layout.tp), mesh_dim_names=("dp", "cp", "tp"))
    return Meshes(mesh, mesh["dp", "cp"]._flatten("dp_cp"), mesh["tp"] if layout.tp > 1 else None, mesh["cp"])


def shard_model(model: Transformer, meshes: Meshes) -> Transformer:
    """TP + SP over ``meshes.tp`` (if any), then ``fully_shard`` per block and the root
    over ``meshes.fsdp``. In place; returns ``model``."""
    if meshes.tp is not None:
        parallelize_llama(model, meshes.tp)
    for layer in model.layers:
        fully_shard(layer, mesh=meshes.fsdp)
    return fully_shard(model, mesh=meshes.fsdp)


def check_sizes(layout: Layout, cfg: LlamaConfig, batch: int, seq: int) -> None:
    """ValueError (on every rank: the arguments are the same everywhere) unless the batch
    splits over dp, the sequence into 2 * cp chunks whose per-rank share splits over tp,
    and the heads over tp."""
    if batch % layout.dp:
        raise ValueError(f"the batch {batch} must divide by dp {layout.dp}")
    if seq % (2 * layout.cp * layout.tp):
        raise ValueError(f"the sequence {seq} must divide by 2 * cp * tp = {2 * layout.cp * layout.tp}")
    if cfg.n_heads % layout.tp or cfg.n_kv_heads % layout.tp or cfg.hidden_dim % layout.tp:
        raise ValueError(f"the heads ({cfg.n_heads}, KV {cfg.n_kv_heads}) and the SwiGLU width "
                         f"{cfg.hidden_dim} must divide by tp {layout.tp}")


def split_batch(tokens: torch.Tensor, meshes: Meshes) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp group's rows of a (batch, seq + 1) token batch as (inputs, labels), the
    labels pre-shifted by one: fresh contiguous tensors that ``context_parallel`` may
    shard in place."""
    dp = meshes.mesh.size("dp")
    rows = tokens.chunk(dp)[meshes.dp_rank]
    return rows[:, :-1].clone(), rows[:, 1:].clone()


def forward_backward(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor, meshes: Meshes) -> float:
    """One forward and backward under context parallelism; the loss of the whole batch
    (the mean of the dp x cp ranks' local means). Collective."""
    with context_parallel(meshes.cp, buffers=[inputs, labels, model.rope], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={inputs, labels}):
        logits = model(inputs)
        with loss_parallel() if meshes.tp is not None else nullcontext():
            loss = cross_entropy(logits, labels)
            loss.backward()
    loss = loss.detach()
    local = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
    comm = meshes.fsdp.get_group()
    return comm.allreduce(local) / comm.size


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward inside the ``with``
    block: the activation memory of a forward pass (the weights it saves included)."""

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    @contextmanager
    def __call__(self) -> Iterator["SavedBytes"]:
        self._storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self


def fix_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Make glibc serve every allocation of ``nbytes`` or more by its own ``mmap`` and return
    it to the system when freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc from
    raising the threshold as large blocks are freed), so that the resident set size follows
    the live tensors and its peak measures a step. False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def one_rank_saved_bytes(cfg: LlamaConfig, inputs: torch.Tensor, labels: torch.Tensor) -> int:
    """Saved bytes of one forward of the plain model (no FSDP, CP or TP) on ``inputs``."""
    model = build_model(cfg, seed=0)
    counter = SavedBytes()
    with counter():
        loss = cross_entropy(model(inputs), labels)
    del loss
    return counter.nbytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=None, help="default: world / 4 on multiples of 4, else 1")
    parser.add_argument("--cp", type=int, default=None, help="default: 2 on multiples of 4, else the world size")
    parser.add_argument("--tp", type=int, default=None, help="default: 2 on multiples of 4, else 1")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: 1 per dp group)")
    parser.add_argument("--steps", type=int, default=3)
    add_model_args(parser)
    parser.add_argument("--budget-mib", type=float, default=128.0, help="activation budget of one rank")
    parser.add_argument("--skip-cp1", action="store_true", help="do not measure the whole sequence on one rank")
    parser.add_argument("--check", action="store_true", help="also train in one process and compare")
    parser.add_argument("--tol", type=float, default=1e-4)
    return parser.parse_args(argv)


def layout_of(args: argparse.Namespace) -> Layout:
    """The layout of ``--dp/--cp/--tp``: none given, the default; otherwise those left out
    are 1, except that a single one left out takes the remaining factor of the world."""
    given = [args.dp, args.cp, args.tp]
    if given == [None, None, None]:
        return Layout.default(world.size)
    missing = [i for i, n in enumerate(given) if n is None]
    sizes = [1 if n is None else n for n in given]
    if len(missing) == 1:
        sizes[missing[0]] = world.size // (sizes[0] * sizes[1] * sizes[2])
    return Layout(*sizes)


def run(args: argparse.Namespace, say: Callable[..., None] = print) -> float:
    """Train, report, and return the largest difference from one process (0 without
    ``--check``). Collective."""
    layout = layout_of(args)
    cfg = config_from_args(args)
    batch = layout.dp if args.batch is None else args.batch
    check_sizes(layout, cfg, batch, args.seq)
    meshes = make_meshes(layout)
    say(f"{world.size} ranks: dp {layout.dp} x cp {layout.cp} x tp {layout.tp}; global batch {batch} x "
        f"seq {args.seq} ({args.seq // layout.cp} tokens per rank of a cp group)\n{cfg}")

    ref = build_model(cfg, seed=0)
    model = shard_model(copy.deepcopy(ref) if args.check else build_model(cfg, seed=0), meshes)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr) if args.check else None
    counter = SavedBytes()
    losses, ref_losses = [], []
    for step, tokens in zip(range(args.steps), batches(cfg, batch, args.seq, seed=1)):
        inputs, labels = split_batch(tokens, meshes)
        world.Barrier()
        reset_peak_memory_stats()
        before = memory_reserved()
        start = MPI.Wtime()
        with counter():
            losses.append(forward_backward(model, inputs, labels, meshes))
        opt.step()
        opt.zero_grad()
        seconds = world.allreduce(MPI.Wtime() - start, op=MPI.MAX)
        saved = world.gather(counter.nbytes)
        peak = world.gather(max_memory_reserved())
        growth = world.gather(max_memory_reserved() - before)
        say(f"step {step}  loss {losses[-1]:.4f}  {seconds:6.2f} s  {batch * args.seq / seconds:7.0f} tokens/s")
        if args.check:
            loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
    say("\nper rank, last step: saved activations (MiB) | peak RSS (MiB) | RSS growth in the step (MiB)")
    if world.rank == 0:
        for rank, (s, p, g) in enumerate(zip(saved, peak, growth)):
            say(f"  rank {rank}: {s / MIB:9.1f} | {p / MIB:9.1f} | {g / MIB:9.1f}")
    _report_budget(args, cfg, meshes, saved, say)
    if not args.check:
        return 0.0
    ref_params = dict(ref.named_parameters())
    param_diff = max((p.full_tensor() - ref_params[name]).abs().max().item() for name, p in model.named_parameters())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    say(f"\nlargest difference from one process: loss {loss_diff:.1e}, parameters {param_diff:.1e}")
    return max(loss_diff, param_diff)


def _report_budget(args, cfg: LlamaConfig, meshes: Meshes, saved: list[int] | None, say) -> None:
    """Compare the per-rank saved bytes with those of the whole sequence on one rank."""
    if args.skip_cp1:
        return
    one_rank = None
    if world.rank == 0:  # the others wait: only one rank pays for the unsharded sequence
        tokens = next(batches(cfg, meshes.mesh.size("dp") if args.batch is None else args.batch, args.seq, seed=1))
        inputs, labels = split_batch(tokens, meshes)
        one_rank = one_rank_saved_bytes(cfg, inputs, labels)
    request = world.Ibarrier()  # the others sleep meanwhile instead of spinning in MPI
    while not request.Test():
        time.sleep(0.05)
    one_rank = world.bcast(one_rank)
    if world.rank != 0:
        return
    per_rank, budget, cp = max(saved), args.budget_mib * MIB, meshes.cp.size()
    fits = {True: "fits", False: "does NOT fit"}
    say(f"\nactivation budget per rank {budget / MIB:.1f} MiB: one dp group's sequence on one rank alone "
        f"saves {one_rank / MIB:.1f} MiB ({fits[one_rank <= budget]}); sharded (cp {cp}, tp {meshes.mesh.size('tp')}) "
        f"a rank saves at most {per_rank / MIB:.1f} MiB ({fits[per_rank <= budget]}), {one_rank / per_rank:.2f}x less")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fix_mmap_threshold()
    torch.manual_seed(0)
    diff = run(args, say=lambda *a: world.rank == 0 and print(*a, flush=True))
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
