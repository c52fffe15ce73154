"""Training-step rows of the benchmark of record (``bench_record.py``).

Each row is one training step in three implementations: mpidtensor, torch's DTensor
(``torch.distributed.tensor`` / FSDP2) on gloo, and a hand-written mpi4py program doing
the same collectives on local tensors. Every implementation is first checked against
one process (same seed, same data); a step that differs stops every rank. The rows:

* ``TP MLP``: ``Linear(1024, 4096) -> GELU -> Linear(4096, 1024)`` on x of 32 x 1024,
  ``ColwiseParallel`` then ``RowwiseParallel``, forward and backward of a summed squared
  error. mpi4py: Megatron's step, local matmuls on the torch.chunk blocks of the weights,
  one ``Allreduce`` of the output forward and one of the input gradient backward.
* ``FSDP, 4 x Linear(1024, 1024)``: the issue's stack of bias-free layers, 64 rows per
  rank, every layer and the root ``fully_shard``-ed, AdamW. mpi4py: ``Zero3`` below.
* ``FSDP``: the demo's Llama-style model (``examples/train_fsdp_tp.py``'s sizes), every
  block and the root ``fully_shard``-ed over all ranks, AdamW. mpi4py: ``Zero3`` below.
* ``FSDP x TP``, 4 ranks only: the demo's own training step (TP + SP over ``tp`` of a 2x2
  mesh, then FSDP over ``dp``). mpi4py: ``record_2d.py``, ZeRO-3 over dp of Megatron-SP
  blocks over tp.
* ``FSDP`` and ``FSDP x TP`` again on the demo's model four times wider (``WIDE``: dim 512,
  hidden 1536): the same modules, parameters and collectives, 16x the matmul work. What
  mpidtensor adds per module and collective is the same at both widths, so the two pairs
  of rows show how much of a ratio is that fixed work (docs/performance.md, "Round 13").

The model, sharding and step functions come from ``bench_fsdp.py``, ``bench_llama_tp.py``
and ``examples/``; this module adds the MLP and the hand-written programs.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
import bench_fsdp  # noqa: E402
import record_2d  # noqa: E402
from bench_llama_tp import train_step  # noqa: E402
from llama import LlamaConfig, build_model, cross_entropy  # noqa: E402
from train_fsdp_tp import parse_args as demo_args  # noqa: E402

import mpidtensor as md  # noqa: E402

COMM = MPI.COMM_WORLD
N, RANK = COMM.size, COMM.rank
MLP_SIZES = (32, 1024, 4096)  # batch, model dim, hidden dim


@dataclass
class StepRow:
    """One checked step: ``fns`` maps a library to a zero-argument step (None: no column)."""

    name: str
    fns: dict[str, Callable[[], object] | None]


def python_calls(fn: Callable[[], object]) -> int:
    """Python-level calls (functions and builtins, as cProfile counts them) of one ``fn()`` on
    this rank: a figure of a step's CPU work that machine load does not move."""
    count = 0

    def counter(frame, event, arg) -> None:
        nonlocal count
        if event == "call" or event == "c_call":
            count += 1
    sys.setprofile(counter)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # setprofile(None) itself


def agreed(ok: bool, what: str) -> None:
    """Stop every rank if any rank's step differs from the single-process reference."""
    if not COMM.allreduce(bool(ok), op=MPI.LAND):
        raise SystemExit(f"benchmark check failed: {what}")


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> bool:
    """Equal within ``rtol`` of the reference's largest magnitude (summation order differs)."""
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    got = got.wait() if hasattr(got, "wait") else got  # torch's AsyncCollectiveTensor
    return got.shape == want.shape and bool((got - want).abs().max() <= rtol * (1 + want.abs().max()))


# --- the TP MLP ------------------------------------------------------------------------
def mlp_model() -> nn.Sequential:
    batch, dim, hidden = MLP_SIZES
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def mlp_step(forward: Callable, params: list, x: torch.Tensor, target: torch.Tensor) -> Callable:
    """Forward + backward of the summed squared error; returns the output (grads stay set)."""
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        y = forward(x)
        F.mse_loss(y, target, reduction="sum").backward()
        return y
    return step


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        COMM.Allreduce(MPI.IN_PLACE, grad.numpy())
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (in place on the fresh partial sum), identity backward."""

    @staticmethod
    def forward(ctx, partial):
        COMM.Allreduce(MPI.IN_PLACE, partial.numpy())
        ctx.mark_dirty(partial)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad


def megatron_mlp(ref: nn.Sequential):
    """(forward, params, [(local grad, slicer of the reference grad)]) of the hand-written step."""
    w1, b1 = (t.detach().chunk(N, 0)[RANK].clone().requires_grad_() for t in (ref[0].weight, ref[0].bias))
    w2 = ref[2].weight.detach().chunk(N, 1)[RANK].clone().requires_grad_()
    b2 = ref[2].bias.detach().clone().requires_grad_()

    def forward(x):
        h = F.gelu(F.linear(_CopyToTP.apply(x), w1, b1))
        return _ReduceFromTP.apply(F.linear(h, w2)) + b2
    blocks = [(w1, lambda g: g.chunk(N, 0)[RANK]), (b1, lambda g: g.chunk(N, 0)[RANK]),
              (w2, lambda g: g.chunk(N, 1)[RANK]), (b2, lambda g: g)]
    return forward, [w1, b1, w2, b2], blocks


def mlp_reference():
    """The TP MLP rows' one-process reference: the input, the target, the model after one
    step, its input (with its gradient) and its output."""
    batch, dim, _ = MLP_SIZES
    gen = torch.Generator().manual_seed(1)
    x0, target = torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)
    ref = mlp_model()
    ref_x = x0.clone().requires_grad_()
    ref_y = mlp_step(ref, list(ref.parameters()), ref_x, target)().detach()
    return x0, target, ref, ref_x, ref_y


def tp_mlp_row(gloo) -> StepRow:
    batch, dim, _ = MLP_SIZES
    x0, target, ref, ref_x, ref_y = mlp_reference()
    ref_grads = [p.grad for p in (ref[0].weight, ref[0].bias, ref[2].weight, ref[2].bias)]

    fns = {"torch": None}
    apis = {"mpidtensor": ("mpidtensor.parallel", md.init_device_mesh)}
    if gloo and MLP_SIZES[2] % N == 0:  # torch reads the local hidden block handed to w2 as an even shard
        apis["torch"] = ("torch.distributed.tensor.parallel", gloo[1])
    elif gloo and RANK == 0:
        print(f"TP MLP: no torch column at {N} ranks (hidden {MLP_SIZES[2]} does not split evenly)")
    for lib, (module, mesh_factory) in apis.items():
        par = importlib.import_module(module)
        mesh = mesh_factory("cpu", (N,))
        model = par.parallelize_module(mlp_model(), mesh, {"0": par.ColwiseParallel(), "2": par.RowwiseParallel()})
        x = x0.clone().requires_grad_()
        step = mlp_step(model, list(model.parameters()), x, target)
        y = step()
        grads = [p.grad for p in (model[0].weight, model[0].bias, model[2].weight, model[2].bias)]
        agreed(close(y, ref_y) and close(x.grad, ref_x.grad) and all(map(close, grads, ref_grads)), f"TP MLP, {lib}")
        fns[lib] = step
    forward, params, blocks = megatron_mlp(ref)
    x = x0.clone().requires_grad_()
    step = mlp_step(forward, params, x, target)
    y = step()
    agreed(close(y, ref_y) and close(x.grad, ref_x.grad)
           and all(close(p.grad, cut(g)) for (p, cut), g in zip(blocks, ref_grads)), "TP MLP, mpi4py")
    fns["mpi4py"] = step
    return StepRow(f"TP MLP {batch}x{dim}, hidden {MLP_SIZES[2]}, fwd+bwd", fns)


# --- FSDP: the demo's model ------------------------------------------------------------
class Zero3:
    """Hand-written ZeRO-3 with mpi4py: every block of ``model.layers`` and the root (the
    other parameters, if any) keep a padded 1/n slice of their flat parameters. A block is all-gathered before its
    forward, freed after it, and gathered again when its output's gradient arrives; the
    root stays gathered from the step's start to its end. After backward each group's flat
    gradient is averaged with one Reduce_scatter_block; AdamW steps the local slices.
    ``loss(model, batch)``: the step's loss (default: the demo's next-token loss);
    ``comm``: the ranks that shard (the dp communicator of a 2-D step)."""

    def __init__(self, model: nn.Module, lr: float, loss: Callable[[nn.Module, object], torch.Tensor] | None = None,
                 comm: MPI.Intracomm = COMM) -> None:
        self.model, self.comm = model, comm
        self.loss = loss or lm_loss
        blocks = [list(layer.parameters()) for layer in model.layers]
        inner = {id(p) for b in blocks for p in b}
        rest = [p for p in model.parameters() if id(p) not in inner]
        self.groups = [self._group(ps) for ps in blocks + ([rest] if rest else [])]
        self.root = self.groups[-1] if rest else None
        self.opt = torch.optim.AdamW([g[1] for g in self.groups], lr=lr)
        for layer, group in zip(model.layers, self.groups):
            layer.register_forward_pre_hook(lambda *_, g=group: self._gather(g))
            layer.register_forward_hook(lambda _m, _i, out, g=group: self._after_forward(g, out))

    def _group(self, params):
        """(params, local slice, full flat buffer): the params become views of the buffer."""
        total, n, rank = sum(p.numel() for p in params), self.comm.size, self.comm.rank
        per = -(-total // n)
        full = torch.zeros(per * n)
        full[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        shard = nn.Parameter(full[rank * per:(rank + 1) * per].clone())
        offset = 0
        for p in params:
            p.data = full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        full.untyped_storage().resize_(0)
        return params, shard, full

    def _gather(self, group) -> None:
        _, shard, full = group
        full.untyped_storage().resize_(full.numel() * full.element_size())
        # an address, not full.numpy(): numpy() would pin the storage's size
        self.comm.Allgather(shard.detach().numpy(), [MPI.buffer.fromaddress(full.data_ptr(), full.nbytes), MPI.FLOAT])

    def _after_forward(self, group, out: torch.Tensor) -> None:
        group[2].untyped_storage().resize_(0)
        if out.requires_grad:
            out.register_hook(lambda _grad: self._gather(group))

    def step(self, batch) -> float:
        """One AdamW step on this rank's rows; returns the local loss."""
        if self.root is not None:
            self._gather(self.root)
        loss = self.loss(self.model, batch)
        loss.backward()
        self.reduce_gradients()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def reduce_gradients(self) -> None:
        """Average every group's flat gradient into its shard's ``.grad`` (one
        ``Reduce_scatter_block`` each) and free the gathered parameters."""
        for params, shard, full in self.groups:
            flat = torch.zeros(full.numel())
            torch.cat([p.grad.reshape(-1) for p in params], out=flat[:sum(p.numel() for p in params)])
            shard.grad = torch.empty_like(shard)
            self.comm.Reduce_scatter_block(flat.numpy(), shard.grad.numpy())
            shard.grad /= self.comm.size
            for p in params:
                p.grad = None
            full.untyped_storage().resize_(0)

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, gathered, in ``model.parameters()`` order."""
        for group in self.groups:
            self._gather(group)
        out = [p.detach().clone() for p in self.model.parameters()]
        for group in self.groups:
            group[2].untyped_storage().resize_(0)
        return out


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of the demo's model."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


# --- FSDP: the stack of bias-free Linear layers ---------------------------------
STACK = (4, 1024, 64)  # layers, width, rows per rank


class LinearStack(nn.Module):
    """``layers`` bias-free ``Linear(width, width)`` applied in turn (seeded init)."""

    def __init__(self, layers: int, width: int, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def stack_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error: with equal rows per rank, averaging gradients over ranks
    gives the gradient of the whole batch's mean."""
    x, target = batch
    return F.mse_loss(model(x), target)


def sharded_stack(lib: str, mesh_factory: Callable, layers: int, width: int) -> nn.Module:
    """The stack with every layer and the root ``fully_shard``-ed over all ranks by ``lib``."""
    fully_shard = importlib.import_module("mpidtensor.fsdp" if lib == "mpidtensor" else "torch.distributed.fsdp").fully_shard
    model, mesh = LinearStack(layers, width), mesh_factory("cpu", (N,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def adam_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> float:
    loss = stack_loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def stack_row(gloo, check_steps: int = 2, sizes: tuple[int, int, int] = STACK) -> StepRow:
    """FSDP of the Linear stack, fwd + bwd + AdamW: mpidtensor, torch's FSDP2 and ``Zero3``,
    each checked against one process (losses and every parameter)."""
    layers, width, rows = sizes
    lr, tol = 1e-3, 1e-4
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(rows * N, width, generator=gen), torch.randn(rows * N, width, generator=gen)
    mine = (x[RANK * rows:(RANK + 1) * rows], target[RANK * rows:(RANK + 1) * rows])
    ref = LinearStack(layers, width)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses = [adam_step(ref, ref_opt, (x, target)) for _ in range(check_steps)]
    fns = {"torch": None}
    for lib, factory in {"mpidtensor": md.init_device_mesh, **({"torch": gloo[1]} if gloo else {})}.items():
        model = sharded_stack(lib, factory, layers, width)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = [COMM.allreduce(adam_step(model, opt, mine)) / N for _ in range(check_steps)]
        agreed(all(abs(a - b) <= tol for a, b in zip(losses, ref_losses))
               and all(close(p, q.detach(), tol) for p, q in zip(model.parameters(), ref.parameters())),
               f"FSDP Linear stack, {lib}")
        fns[lib] = lambda model=model, opt=opt: adam_step(model, opt, mine)
    zero = Zero3(LinearStack(layers, width), lr, stack_loss)
    losses = [COMM.allreduce(zero.step(mine)) / N for _ in range(check_steps)]
    agreed(all(abs(a - b) <= tol for a, b in zip(losses, ref_losses))
           and all(close(p, q.detach(), tol) for p, q in zip(zero.full_parameters(), ref.parameters())),
           "FSDP Linear stack, mpi4py ZeRO-3")
    fns["mpi4py"] = lambda: zero.step(mine)
    return StepRow(f"FSDP, {layers} x Linear({width}, {width}), {rows} rows/rank, fwd+bwd+AdamW", fns)


WIDE = ("--dim", "512", "--hidden", "1536")  # the demo's model 4x wider (examples/train_fsdp_tp.py's flags)


def fsdp_rows(gloo, check_steps: int = 2) -> list[StepRow]:
    """FSDP over all ranks, and at 4 ranks FSDP x TP (the demo's step), on the demo's model
    and on it ``WIDE``, each checked by ``bench_fsdp.setup`` (losses and every parameter
    against one process)."""
    factories = {"mpidtensor": md.init_device_mesh, **({"torch": gloo[1]} if gloo else {})}
    rows = []
    for wide in (False, True):
        demo = demo_args(list(WIDE) if wide else [])
        cfg = LlamaConfig(vocab_size=demo.vocab, dim=demo.dim, n_layers=demo.layers, n_heads=demo.heads,
                          n_kv_heads=demo.kv_heads, hidden_dim=demo.hidden, max_seq_len=demo.seq)
        for layout, dp in [("fsdp", N)] + ([("fsdp x tp", 2)] if N == 4 else []):
            args = argparse.Namespace(seed=0, batch=4 * dp, lr=demo.lr, check_steps=check_steps, tol=demo.tol)
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, demo.seq + 1),
                                   generator=torch.Generator().manual_seed(1))
            ref = build_model(cfg, args.seed)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
            ref_losses = [train_step(ref, ref_opt, tokens, None) for _ in range(check_steps)]
            ref_params = [p.detach() for p in ref.parameters()]
            fns = {"torch": None}
            for lib, factory in factories.items():
                run = bench_fsdp.setup(lib, layout, factory, cfg, args, tokens, ref_losses, ref_params)
                agreed(run is not None, f"{layout}, dim {cfg.dim}, {lib}")
                model, opt, backend, mine = run[0], run[1], run[2], tokens[run[3]]
                fns[lib] = lambda model=model, opt=opt, backend=backend, mine=mine: train_step(model, opt, mine,
                                                                                               backend)
            fns["mpi4py"] = (zero3_step(cfg, args, tokens, ref_losses, ref, check_steps) if layout == "fsdp" else
                             record_2d.zero3_tp_step(cfg, args, tokens, ref_losses, ref, check_steps, dp, N // dp,
                                                     Zero3, agreed, close))
            batch = f"batch {args.batch}x{demo.seq}"
            name = (f"FSDP, dim {cfg.dim}, {cfg.n_layers} layers, {batch}" if layout == "fsdp"
                    else f"FSDP x TP, dim {cfg.dim}, 2x2, {batch}" if wide
                    else f"FSDP x TP 2x2 (the demo's step), {batch}")
            rows.append(StepRow(name, fns))
    return rows


def zero3_step(cfg, args, tokens, ref_losses, ref, check_steps: int) -> Callable:
    """The hand-written ZeRO-3 step, checked against one process like the others."""
    mine = tokens[RANK * args.batch // N:(RANK + 1) * args.batch // N]
    zero = Zero3(build_model(cfg, args.seed), args.lr)
    losses = [COMM.allreduce(zero.step(mine)) / N for _ in range(check_steps)]
    ok = all(abs(a - b) <= args.tol for a, b in zip(losses, ref_losses))
    agreed(ok and all(close(p, q.detach(), args.tol) for p, q in zip(zero.full_parameters(), ref.parameters())),
           "fsdp, mpi4py ZeRO-3")
    return lambda: zero.step(mine)


def step_rows(gloo) -> list[StepRow]:
    """Every step row, checked; ``gloo`` is (torch.distributed, its init_device_mesh) or None."""
    return [tp_mlp_row(gloo), stack_row(gloo)] + fsdp_rows(gloo)
