"""A small Llama-style transformer and its tensor-parallel plan (TP + sequence parallelism).

The model is plain torch: token embedding, pre-norm blocks of RMSNorm, attention with
rotary position embeddings and grouped KV heads (``n_kv_heads < n_heads``), a SwiGLU
feed-forward, a final RMSNorm and the output projection. ``parallelize_llama`` shards it
over a 1-D TP mesh with the Megatron-style sequence-parallel plan that torchtitan uses,
on mpidtensor or, with ``backend="torch"``, on ``torch.distributed.tensor`` (the same
plan object by object, for comparison):

* the residual stream between blocks is sharded over the sequence (``Shard(1)``) and
  stays a DTensor (the residual adds communicate nothing);
* each attention / feed-forward region all-gathers its input to ``Replicate`` once, runs
  column-parallel (wq, wk, wv, w1, w3: heads / hidden units sharded) then row-parallel
  (wo, w2) matmuls, and reduce-scatters the partial output back to ``Shard(1)``;
* the output projection is column-parallel over the vocabulary and keeps its output a
  ``Shard(-1)`` DTensor for ``loss_parallel`` (cross entropy without gathering logits).

Inside attention the tensors are local, so head counts come from the local width
(``view(..., -1, head_dim)``): ``n_heads // tp`` query heads and ``n_kv_heads // tp``
KV heads per rank, which is why both must divide by the TP size.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes; ``hidden_dim`` is the SwiGLU width."""

    vocab_size: int = 53
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 87
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of the rotary angles, shape ``(max_seq_len, head_dim // 2, 2)``."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (batch, seq, heads, head_dim) by the angles of
    ``table`` (seq, head_dim // 2, 2): Llama's complex rotation in real arithmetic."""
    pairs = x.unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = table[:, None, :, 0], table[:, None, :, 1]  # broadcast over batch and heads
    return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped KV heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.n_kv_heads}")
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1: the local head count, n_heads // tp once wq/wk/wv are column-sharded
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope[:seq]), apply_rope(k, rope[:seq])
        # query head h reads KV head h // n_rep; a rank's heads and KV heads are
        # contiguous blocks of the same groups, so the local repeat pairs them right
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) to logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-like init: small normal weights (depth-scaled for the residual outputs)."""
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            elif p.ndim == 2 and "tok_embeddings" not in name:
                nn.init.normal_(p, std=0.02 if "output" not in name else self.cfg.dim ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model-size and learning-rate options the training examples share."""
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384, help="SwiGLU width")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)


def config_from_args(args: argparse.Namespace) -> LlamaConfig:
    """The ``LlamaConfig`` of ``add_model_args``' options, for sequences of ``args.seq``."""
    return LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=args.seq)


def build_model(cfg: LlamaConfig, seed: int = 0) -> Transformer:
    """The model with its weights drawn from ``seed``: the same on every rank."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(cfg)


def _api(backend: str):
    """(placements module, parallel module) of the chosen DTensor implementation."""
    if backend == "mpidtensor":
        import mpidtensor as placements
        import mpidtensor.parallel as parallel
    elif backend == "torch":
        import torch.distributed.tensor as placements
        import torch.distributed.tensor.parallel as parallel
    else:
        raise ValueError(f"backend must be 'mpidtensor' or 'torch', got {backend!r}")
    return placements, parallel


def tp_plan(model: Transformer, loss_parallel: bool = True, backend: str = "mpidtensor") -> dict:
    """The TP + SP plan of ``model``: submodule name -> parallel style."""
    pl, par = _api(backend)
    plan = {
        # the residual stream's producers (the embedding, wo, w2) hand on DTensors, so
        # the residual adds are local DTensor adds and the norms need no from_local
        "tok_embeddings": par.RowwiseParallel(input_layouts=pl.Replicate(), output_layouts=pl.Shard(1),
                                              use_local_output=False),
        "norm": par.SequenceParallel(),
        "output": par.ColwiseParallel(input_layouts=pl.Shard(1),
                                      output_layouts=pl.Shard(-1) if loss_parallel else pl.Replicate(),
                                      use_local_output=not loss_parallel),
    }
    for i in range(len(model.layers)):
        plan.update({
            f"layers.{i}.attention_norm": par.SequenceParallel(),
            f"layers.{i}.attention": par.PrepareModuleInput(input_layouts=(pl.Shard(1), None),
                                                           desired_input_layouts=(pl.Replicate(), None)),
            f"layers.{i}.attention.wq": par.ColwiseParallel(),
            f"layers.{i}.attention.wk": par.ColwiseParallel(),
            f"layers.{i}.attention.wv": par.ColwiseParallel(),
            f"layers.{i}.attention.wo": par.RowwiseParallel(output_layouts=pl.Shard(1), use_local_output=False),
            f"layers.{i}.ffn_norm": par.SequenceParallel(),
            f"layers.{i}.feed_forward": par.PrepareModuleInput(input_layouts=(pl.Shard(1),),
                                                              desired_input_layouts=(pl.Replicate(),)),
            f"layers.{i}.feed_forward.w1": par.ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": par.RowwiseParallel(output_layouts=pl.Shard(1),
                                                               use_local_output=False),
            f"layers.{i}.feed_forward.w3": par.ColwiseParallel(),
        })
    return plan


def parallelize_llama(model: Transformer, tp_mesh, loss_parallel: bool = True,
                      backend: str = "mpidtensor") -> Transformer:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` with the TP + SP plan.

    With ``loss_parallel`` the logits stay a vocab-sharded DTensor: compute the cross
    entropy (forward and backward) under the backend's ``loss_parallel()`` context.
    Raises ValueError (on every rank: the sizes are global) when the head counts do
    not divide by the TP size.
    """
    tp = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(f"n_heads {cfg.n_heads} and n_kv_heads {cfg.n_kv_heads} must be multiples of "
                         f"the TP size {tp}")
    _, par = _api(backend)
    return par.parallelize_module(model, tp_mesh, tp_plan(model, loss_parallel, backend))


def loss_parallel_context(backend: str = "mpidtensor"):
    """The backend's ``loss_parallel()`` context manager."""
    return _api(backend)[1].loss_parallel()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def batches(cfg: LlamaConfig, batch: int, seq: int, seed: int):
    """Endless global batches (batch, seq + 1): random starts following a fixed random
    successor table, so the loss falls as the model learns it. The same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(cfg.vocab_size, generator=gen)
    while True:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = table[tokens[:, t]]
        yield tokens
