"""The hand-written FSDP x TP step of the benchmark of record (``record_steps.py``).

The demo's Llama-style model (``examples/llama.py``) on the (dp, tp) grid of
``examples/train_fsdp_tp.py``, with mpi4py on local torch tensors and no mpidtensor:

* over ``tp``, Megatron tensor and sequence parallelism as the demo's plan: the residual
  stream holds this rank's ``seq / tp`` positions; each attention / feed-forward region
  all-gathers its input over the sequence (backward: reduce-scatter), runs the column
  blocks (wq, wk, wv, w1, w3: ``torch.chunk`` rows) and the row blocks (wo, w2: columns)
  and reduce-scatters the partial output (backward: all-gather); the embedding holds a
  vocabulary block (masked lookup, reduce-scatter); the norms' weight gradients are
  all-reduced; the output projection holds a vocabulary block and the cross entropy is
  computed on the vocabulary-sharded logits (three all-reduces of one number per position);
* over ``dp``, ZeRO-3 (``record_steps.Zero3`` on the dp communicator) of these local blocks.

``zero3_tp_step`` checks the step against one process (losses and every parameter) and
returns it; ``zero3_tp`` returns its parts (``benchmarks/profile_fsdp_rows.py``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from llama import LlamaConfig, Transformer, build_model  # examples/, on sys.path via record_steps

COMM = MPI.COMM_WORLD


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


def gather_seq(x: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
    """(batch, seq / tp, ...) -> (batch, seq, ...): one Allgather of the sequence-major blocks."""
    send = _seq_first(x)
    out = torch.empty((send.shape[0] * comm.size, *send.shape[1:]), dtype=x.dtype)
    comm.Allgather(send.numpy(), out.numpy())
    return out.transpose(0, 1)


def scatter_seq(x: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
    """(batch, seq, ...) partial sums -> this rank's (batch, seq / tp, ...) of their sum."""
    send = _seq_first(x)
    out = torch.empty((send.shape[0] // comm.size, *send.shape[1:]), dtype=x.dtype)
    comm.Reduce_scatter_block(send.numpy(), out.numpy())
    return out.transpose(0, 1)


class _GatherSeq(torch.autograd.Function):
    """All-gather over the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return scatter_seq(grad, ctx.comm), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter over the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.comm), None


class VocabEmbedding(nn.Module):
    """This rank's block of the embedding rows; other tokens look up zeros."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight, self.start = nn.Parameter(weight), start

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        return F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)


class _VocabCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits sharded over the vocabulary (``start``: this rank's first)."""

    @staticmethod
    def forward(ctx, logits, target, start, comm):
        top = logits.max(-1).values
        comm.Allreduce(MPI.IN_PLACE, top.numpy(), op=MPI.MAX)
        exp = (logits - top.unsqueeze(-1)).exp()
        total = exp.sum(-1)
        comm.Allreduce(MPI.IN_PLACE, total.numpy())
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = (logits.gather(-1, index).squeeze(-1) - top) * mine
        comm.Allreduce(MPI.IN_PLACE, picked.numpy())
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine = ctx.saved_tensors
        out = softmax.scatter_add(-1, index, -mine.unsqueeze(-1).to(softmax.dtype))
        return out * (grad / mine.numel()), None, None, None


def _block(weight: torch.Tensor, dim: int, comm: MPI.Intracomm) -> nn.Parameter:
    return nn.Parameter(weight.detach().chunk(comm.size, dim)[comm.rank].clone())


COLUMN = ("wq", "wk", "wv", "w1", "w3")  # Linear weights sharded on their rows
ROW = ("wo", "w2")  # ... on their columns


def megatron_sp(model: Transformer, tp: MPI.Intracomm) -> Transformer:
    """``model`` cut to this rank's TP blocks, with the sequence-parallel collectives as hooks."""
    vocab = model.tok_embeddings.weight.shape[0]
    model.tok_embeddings = VocabEmbedding(_block(model.tok_embeddings.weight, 0, tp).data,
                                          sum(len(c) for c in torch.arange(vocab).chunk(tp.size)[:tp.rank]))
    model.tok_embeddings.register_forward_hook(lambda _m, _i, out: _ScatterSeq.apply(out, tp))
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN or name == "output":
            module.weight = _block(module.weight, 0, tp)
        elif leaf in ROW:
            module.weight = _block(module.weight, 1, tp)
            module.register_forward_hook(lambda _m, _i, out: _ScatterSeq.apply(out, tp))
        if leaf in ("attention", "feed_forward", "output"):
            module.register_forward_pre_hook(lambda _m, args: (_GatherSeq.apply(args[0], tp), *args[1:]))
        if isinstance(module, nn.RMSNorm):  # its gradient sums over this rank's positions only
            module.weight.register_hook(lambda g: (tp.Allreduce(MPI.IN_PLACE, g.numpy()), g)[1])
    return model


def split_grid(dp: int, tp: int) -> tuple[MPI.Intracomm, MPI.Intracomm]:
    """(dp comm, tp comm) of the (dp, tp) row-major grid, as ``init_device_mesh`` lays it out."""
    rank = COMM.rank
    return COMM.Split(rank % tp, rank), COMM.Split(rank // tp, rank)


def full_parameter(name: str, local: torch.Tensor, tp: MPI.Intracomm) -> torch.Tensor:
    """A parameter's whole value from this rank's TP block of it."""
    leaf = name.split(".")[-2] if name.endswith(".weight") else ""
    dim = 0 if leaf in COLUMN + ("output", "tok_embeddings") else 1 if leaf in ROW else None
    if dim is None:
        return local
    return torch.cat([torch.as_tensor(b) for b in tp.allgather(local.contiguous().numpy())], dim)


def zero3_tp(cfg: LlamaConfig, args, tokens: torch.Tensor, ref_losses: list[float], ref: nn.Module,
             check_steps: int, dp: int, tp: int, zero3: type, agreed: Callable,
             close: Callable) -> tuple[object, torch.Tensor, Callable]:
    """The hand-written FSDP x TP step on this rank's rows, checked against one process:
    (its ``zero3`` object, this rank's rows, ``loss_of(logits, rows)``, the loss of the
    model's output), for a profiler that splits the step."""
    dp_comm, tp_comm = split_grid(dp, tp)
    rows = args.batch // dp
    mine = tokens[dp_comm.rank * rows:(dp_comm.rank + 1) * rows]
    model = megatron_sp(build_model(cfg, args.seed), tp_comm)
    start = sum(len(c) for c in torch.arange(cfg.vocab_size).chunk(tp)[:tp_comm.rank])

    def loss_of(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return _VocabCrossEntropy.apply(logits, batch[:, 1:], start, tp_comm)

    zero = zero3(model, args.lr, lambda m, batch: loss_of(m(batch[:, :-1]), batch), comm=dp_comm)
    losses = [dp_comm.allreduce(zero.step(mine)) / dp for _ in range(check_steps)]
    names = [n for n, _ in model.named_parameters()]
    params = [full_parameter(n, p, tp_comm) for n, p in zip(names, zero.full_parameters())]
    ok = all(abs(a - b) <= args.tol for a, b in zip(losses, ref_losses))
    agreed(ok and all(close(p, q.detach(), args.tol) for p, q in zip(params, ref.parameters())),
           "fsdp x tp, mpi4py ZeRO-3 x Megatron-SP")
    return zero, mine, loss_of


def zero3_tp_step(cfg: LlamaConfig, args, tokens: torch.Tensor, ref_losses: list[float], ref: nn.Module,
                  check_steps: int, dp: int, tp: int, zero3: type, agreed: Callable, close: Callable) -> Callable:
    """The hand-written FSDP x TP step on this rank's rows, checked against one process."""
    zero, mine, _ = zero3_tp(cfg, args, tokens, ref_losses, ref, check_steps, dp, tp, zero3, agreed, close)
    return lambda: zero.step(mine)
