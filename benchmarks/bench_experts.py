"""Expert parallelism: one mixture-of-experts layer's forward and backward, experts split
over the ranks, each rank routing its own tokens (``ExpertParallel(dispatch="all_to_all")``),
side by side with its peers in one MPI job:

* **mpidtensor**: transformers' ``MixtralExperts`` under ``ExpertParallel``;
* **mpi4py**: the same dispatch written by hand on numpy views of the tensors (one
  ``Alltoall`` of the counts, ``Alltoallv`` of the rows out and back, reversed in backward),
  the experts' own forward on the rank's weights: the floor;
* **torch gloo**: transformers' own expert parallelism (``EpDispatchExpertsParallel``,
  ``AllToAllEP``: torch's ``all_to_all_single``) on torch's DTensor over gloo.

    mpiexec -n 4 python benchmarks/bench_experts.py [--tokens 256] [--hidden 512] [--reps 15] [--check-only]

Every variant is first checked against one process (the whole batch through the unsplit
experts): the rank's outputs and the experts' gradients. Then the variants take turns,
``--reps`` times; a step's time is the slowest rank's, the figure the median.
``--check-only`` stops after the checks (``tests/test_bench.py`` runs it).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import transformers
from mpi4py import MPI
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_redistribute import init_gloo  # noqa: E402
from text_table import print_table  # noqa: E402

import mpidtensor as md  # noqa: E402
from mpidtensor.parallel import ExpertParallel, parallelize_module  # noqa: E402

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank


def experts_module(args) -> MixtralExperts:
    config = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                        num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = MixtralExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, args.hidden ** -0.5)
    return module


def batch(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's tokens, routes and routing weights (the same on every rank; each takes its rows)."""
    gen = torch.Generator().manual_seed(1)
    rows = args.tokens * N
    hidden = torch.randn(rows, args.hidden, generator=gen)
    index = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(rows)])
    weights = torch.rand(rows, args.top_k, generator=gen).softmax(-1)
    return hidden, index, weights


# --- the hand-written floor ----------------------------------------------------------------------
class _Alltoallv(torch.autograd.Function):
    """Rows out by counts, back the other way in backward: mpi4py on the tensors' memory."""

    @staticmethod
    def forward(ctx, x, send, recv):
        ctx.send, ctx.recv = send, recv
        return _alltoallv(x.contiguous(), send, recv)

    @staticmethod
    def backward(ctx, grad):
        return _alltoallv(grad.contiguous(), ctx.recv, ctx.send), None, None


def _alltoallv(x: torch.Tensor, send: np.ndarray, recv: np.ndarray) -> torch.Tensor:
    width = x[0].numel() if x.shape[0] else int(np.prod(x.shape[1:]))
    out = torch.empty(int(recv.sum()), *x.shape[1:], dtype=x.dtype)
    s, r = send * width, recv * width
    COMM.Alltoallv([x.numpy(), (s, np.cumsum(s) - s), MPI.FLOAT], [out.numpy(), (r, np.cumsum(r) - r), MPI.FLOAT])
    return out


def hand_written(module: MixtralExperts, local: int) -> Callable:
    """The rank's experts (a module holding its weights) behind a hand-written dispatch."""
    def forward(hidden, index, weights):
        tokens, top_k = index.shape
        routes = index.reshape(-1)
        order = torch.argsort(routes, stable=True)
        counts = torch.bincount(routes, minlength=local * N).view(N, local).numpy()
        arriving = np.empty_like(counts)
        COMM.Alltoall(counts, arriving)
        send, recv = counts.sum(1), arriving.sum(1)
        received = _Alltoallv.apply(hidden[order // top_k], send, recv)
        ids = torch.arange(local).repeat(N).repeat_interleave(torch.from_numpy(arriving.reshape(-1)))
        out = module(received, ids.unsqueeze(-1), received.new_ones(received.shape[0], 1))
        back = _Alltoallv.apply(out, recv, send)
        return (back[torch.argsort(order)].view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1)
    return forward


def rank_experts(whole: MixtralExperts, local: int) -> MixtralExperts:
    """A module holding this rank's experts (``local`` of them) of ``whole``."""
    mine = copy.deepcopy(whole)
    rows = slice(RANK * local, (RANK + 1) * local)
    for name, p in list(mine.named_parameters()):
        mine.register_parameter(name, torch.nn.Parameter(p.detach()[rows].clone()))
    mine.num_experts = local
    return mine


# --- torch ---------------------------------------------------------------------------------------
def torch_experts(whole: MixtralExperts, init_device_mesh) -> Callable:
    """transformers' expert parallelism on torch's DTensor (gloo)."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, MoEParamShard

    module = copy.deepcopy(whole)
    mesh = init_device_mesh("cpu", (N, 1), mesh_dim_names=("ep", "tp"))
    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for name, _ in list(module.named_parameters()):
        shard.shard_param(module, name, mesh["ep"])
    EpDispatchExpertsParallel().install_forward(module, mesh["ep"], tp_mesh=mesh["tp"], ep_implementation="all_to_all")
    return module


# --- checks and timing ---------------------------------------------------------------------------
def run(forward: Callable, params: list, hidden, index, weights) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = forward(hidden, index, weights)
    out.pow(2).mean().backward()
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return out.detach(), grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(argv: list[str] | None = None) -> list[str]:
    """Check, then time unless ``--check-only``; the names of the variants checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--check-only", action="store_true", help="check every variant, time nothing")
    args = parser.parse_args(argv)
    if args.experts % N:
        raise SystemExit(f"--experts {args.experts} must divide by the {N} ranks")
    local = args.experts // N
    whole = experts_module(args)
    hidden, index, weights = batch(args)
    mine = slice(RANK * args.tokens, (RANK + 1) * args.tokens)
    ref_out, ref_grads = run(whole, list(whole.parameters()), hidden, index, weights)
    ref_grads = [g * N for g in ref_grads]  # the sum of the ranks' losses, each a mean over its rows

    ours = parallelize_module(copy.deepcopy(whole), md.init_device_mesh("cpu", (N,)), ExpertParallel())
    floor = rank_experts(whole, local)
    variants = {"mpidtensor": (ours, list(ours.parameters())),
                "mpi4py": (hand_written(floor, local), list(floor.parameters()))}
    gloo = init_gloo()
    if gloo is not None:
        theirs = torch_experts(whole, gloo[1])
        variants["torch gloo"] = (theirs, list(theirs.parameters()))
    x, i, w = hidden[mine].clone(), index[mine].clone(), weights[mine].clone()
    rows = slice(RANK * local, (RANK + 1) * local)
    for name, (forward, params) in variants.items():
        out, grads = run(forward, params, x, i, w)
        grads = [full(g) if name != "mpi4py" else g for g in grads]
        want = [g if name != "mpi4py" else g[rows] for g in ref_grads]
        ok = torch.allclose(out, ref_out[mine], atol=1e-5, rtol=1e-4) and all(
            torch.allclose(g, r, atol=1e-6, rtol=1e-3) for g, r in zip(grads, want))
        if not all(COMM.allgather(ok)):
            raise SystemExit(f"{name}: outputs or gradients differ from one process")
    if not args.check_only:
        _time(variants, args, local, x, i, w)
    if gloo is not None:
        gloo[0].destroy_process_group()
    return list(variants)


def _time(variants: dict, args, local: int, x, i, w) -> None:
    """The variants in turns, ``args.reps`` times after two warm-up rounds; rank 0 prints."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 2):  # two warm-up rounds
        for name, (forward, params) in variants.items():
            COMM.Barrier()
            start = time.perf_counter()
            run(forward, params, x, i, w)
            elapsed = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if rep >= 2:
                samples[name].append(elapsed * 1e3)
    if RANK == 0:
        median = {name: statistics.median(s) for name, s in samples.items()}
        print(f"{N} ranks, {args.experts} experts ({local} per rank), top-{args.top_k}, {args.tokens} tokens "
              f"per rank, hidden {args.hidden}, intermediate {2 * args.hidden}; forward + backward, "
              f"median of {args.reps} (slowest rank), load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
        rows_ = [[name, f"{m:.2f}", f"{m / median['mpi4py']:.2f}"] for name, m in median.items()]
        print_table(["step", "ms", "/ mpi4py"], rows_)


if __name__ == "__main__":
    main()
