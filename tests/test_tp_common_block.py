"""A Llama-style model written the common way (heads by ``view(b, s, -1, head_dim)`` and
``transpose(1, 2)``, attention by ``q @ k.transpose(-2, -1)``, the heads folded back by
``transpose(1, 2).reshape(b, s, -1)``, RMSNorm, a SwiGLU MLP) under TP + SequenceParallel
with the plan of torch's tutorial, and under FSDP x TP on a 2x2 mesh: several optimizer
steps give one process's losses and parameters.

With the default ``ColwiseParallel()`` on wq/wk/wv the attention runs on local tensors and
hands mpidtensor transposed layouts: a local head fold that is a view (one local head)
enters ``wo`` as a transposed block, and autograd hands ``to_local``'s backward transposed
gradients. The global strides of the DTensors made from them must follow those layouts,
else a later ``view`` accepted on the global strides fails on the local block (the failure
this file was written for). The last tests pin that cause down directly.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.tensor.layout import strides_like
from mpidtensor.fsdp import fully_shard
from mpidtensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                 parallelize_module)

WORLD = MPI.COMM_WORLD
HEAD_DIM, SEQ, BATCH, VOCAB, STEPS = 4, 12, 2, 40, 3
# AdamW moves a weight by about lr * m / sqrt(v): the rounding of sharded sums shifts that
# ratio for gradient entries near zero, so parameters agree to a small fraction of lr.
PARAM_ATOL, LOSS_TOL = 5e-5, dict(atol=1e-5, rtol=1e-5)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.head_dim, self.causal = dim // n_heads, causal
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        att = F.softmax(att.float(), dim=-1).type_as(q)
        return self.wo((att @ v).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, causal)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    def __init__(self, n_heads: int, causal: bool, n_layers: int = 2) -> None:
        super().__init__()
        dim = n_heads * HEAD_DIM
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, causal) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(n_heads: int, causal: bool) -> Model:
    torch.manual_seed(11)
    model = Model(n_heads, causal)
    with torch.no_grad():  # norm weights other than ones: their gradients must be right too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def tp_plan(model: Model, local_qkv: bool) -> dict:
    """torch's tutorial plan: the residual stream sequence-sharded between the blocks as
    local tensors; ``local_qkv`` keeps the default ``ColwiseParallel()`` on wq/wk/wv
    (attention on local tensors), else ``use_local_output=False`` (on DTensors)."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        plan.update({f"layers.{i}.{name}": style for name, style in {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(use_local_output=local_qkv),
            "attention.wk": ColwiseParallel(use_local_output=local_qkv),
            "attention.wv": ColwiseParallel(use_local_output=local_qkv),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }.items()})
    return plan


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))


def train(model: nn.Module, batch: torch.Tensor, optimizer: str, dp=None) -> torch.Tensor:
    """STEPS optimizer steps on ``batch``; the losses (averaged over ``dp`` when given)."""
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}
    opt = make[optimizer](model.parameters())
    losses = []
    for _ in range(STEPS):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().item()
        losses.append(value if dp is None else dp.allreduce(value) / dp.size)
    return torch.tensor(losses)


def assert_same_parameters(model: nn.Module, ref: nn.Module) -> None:
    differ = {}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if full.shape != p_ref.shape or not torch.allclose(full, p_ref.detach(), atol=PARAM_ATOL, rtol=1e-5):
            differ[name] = (full - p_ref.detach()).abs().max().item() if full.shape == p_ref.shape else "shape"
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


CASES = [  # (attention on local tensors, heads per rank, causal mask, optimizer)
    (True, 1, True, "adamw"),  # one local head: the head fold is a transposed view
    (True, 2, False, "sgd"),
    (False, 1, False, "adamw"),
    (False, 2, True, "sgd"),
]


@pytest.mark.parametrize("local_qkv,heads_per_rank,causal,optimizer", CASES)
def test_tp_sequence_parallel_trains_like_one_process(mesh1d, local_qkv, heads_per_rank, causal, optimizer):
    if WORLD.size == 1:
        pytest.skip("TP over one rank is one process")
    n_heads = heads_per_rank * WORLD.size  # the head counts divide by 2, 3 and 4 ranks
    ref = build(n_heads, causal)
    model = parallelize_module(copy.deepcopy(ref), mesh1d, tp_plan(ref, local_qkv))
    batch = tokens()
    ref_losses = train(ref, batch, optimizer)
    losses = train(model, batch, optimizer)
    assert_close(losses, ref_losses, **LOSS_TOL)
    assert_same_parameters(model, ref)


@pytest.mark.parametrize("local_qkv,optimizer", [(True, "adamw"), (False, "sgd")])
def test_fsdp_tp_trains_like_one_process(mesh2d, local_qkv, optimizer):
    """fully_shard over "dp" (per block, then the root), TP + SP over "tp"; each dp rank
    trains on its half of the batch."""
    ref = build(2, causal=True)
    model = parallelize_module(copy.deepcopy(ref), mesh2d["tp"], tp_plan(ref, local_qkv))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh2d["dp"])
    fully_shard(model, mesh=mesh2d["dp"])
    batch = tokens()
    ref_losses = train(ref, batch, optimizer)
    dp = mesh2d.get_group("dp")
    losses = train(model, batch[dp.rank:dp.rank + 1], optimizer, dp)
    assert_close(losses, ref_losses, **LOSS_TOL)
    assert_same_parameters(model, ref)


# --- the cause: DTensors made from transposed local tensors --------------------------------------


def test_from_local_global_strides_follow_the_local_layout(mesh1d):
    """A transposed local block (a head fold that is a view) gives transposed global
    strides, so ``reshape`` copies where the block cannot be viewed, as torch would."""
    x = global_tensor((2, 4, 3 * WORLD.size))  # (batch, seq, features): features sharded
    local_t = x.chunk(WORLD.size, -1)[WORLD.rank].transpose(1, 2).contiguous().transpose(1, 2)
    transposed = (4 * 3 * WORLD.size, 1, 4)
    for shape, stride in ((None, None), (x.shape, transposed)):  # gathered, or given (the cached path)
        d = DTensor.from_local(local_t, mesh1d, [Shard(2)], shape=shape, stride=stride)
        assert_all_ranks(d.stride() == transposed, f"global strides {d.stride()}")
        flat = d.reshape(8, -1)
        assert_close(flat.full_tensor(), x.reshape(8, -1))
        assert_all_ranks(flat.to_local().is_contiguous(), f"{flat.to_local().stride()}")
    again = DTensor.from_local(x.chunk(WORLD.size, -1)[WORLD.rank].contiguous(), mesh1d, [Shard(2)], shape=x.shape,
                              stride=x.stride())
    assert_all_ranks(again.stride() == (4 * 3 * WORLD.size, 3 * WORLD.size, 1), "the from_local cache mixed layouts")


def test_to_local_backward_keeps_gradient_layout(mesh1d):
    """Autograd hands ``to_local``'s backward a transposed or an expanded gradient; the
    DTensor gradient's global strides follow the transposed one (the expanded one is made
    whole), and the Linear backward that views it works."""
    torch.manual_seed(3)
    lin = nn.Linear(6, 4 * WORLD.size, bias=False)
    x = global_tensor((2, 5, 6))
    ref = copy.deepcopy(lin)
    model = parallelize_module(lin, mesh1d, ColwiseParallel())
    folds = (lambda y: y.transpose(1, 2), lambda y: y.transpose(1, 2).sum(-1), lambda y: y.sum(0))
    for fold in folds:  # the features land on dim 1 each time: a transposed, an expanded gradient
        fold(ref(x)).pow(2).sum().backward()
        full = DTensor.from_local(fold(model(x)), mesh1d, [Shard(1)])  # model(x): the local block
        full.full_tensor().pow(2).sum().backward()
        assert_close(model.weight.grad.full_tensor(), ref.weight.grad)
        model.zero_grad()
        ref.zero_grad()


def test_redistribute_keeps_transposed_layout(mesh1d):
    """Replicate -> Shard of a transposed DTensor: the local chunk stays transposed, as
    torch's result of an op on it would be."""
    x = global_tensor((4 * WORLD.size, 5))
    d = distribute_tensor(x, mesh1d, [Replicate()]).t()  # (5, 4n), strides (1, 5)
    s = d.redistribute(placements=[Shard(1)])
    local = s.to_local()
    assert_all_ranks(local.stride() == (1, 5), f"local strides {local.stride()} of {tuple(local.shape)}")
    assert_close(s.full_tensor(), x.t())
    flat = s.t().view(-1)  # the transpose back is contiguous, globally and locally
    assert_close(flat.full_tensor(), x.reshape(-1))


def test_strides_like_mirrors_dense_gapped_and_expanded_layouts():
    """``strides_like`` (global strides from a local block, and back): a permuted dense block
    gives a dense tensor in the same dim order, a gap keeps its ratio, an expanded dim stays
    expanded; a contiguous global tensor only ever comes from a contiguous block."""
    gen, bad = torch.Generator().manual_seed(0), []
    for _ in range(300):
        ndim = int(torch.randint(1, 5, (), generator=gen))
        block = [int(n) for n in torch.randint(1, 4, (ndim,), generator=gen)]
        local = torch.empty(block).permute(*torch.randperm(ndim, generator=gen).tolist())
        whole = [n * int(k) for n, k in zip(local.shape, torch.randint(1, 4, (ndim,), generator=gen))]
        stride = strides_like(whole, local.shape, local.stride())
        g = torch.empty_strided(whole, stride, device="meta")
        back = strides_like(local.shape, whole, stride)
        if not (is_non_overlapping_and_dense_or_false(g)
                and all(a == b for a, b, n in zip(back, local.stride(), local.shape) if n > 1)
                and (local.is_contiguous() or not g.is_contiguous())):
            bad.append(f"{tuple(local.shape)}/{local.stride()} -> {whole}/{stride} -> {back}")
    assert_all_ranks(not bad, "; ".join(bad[:5]))
    assert_all_ranks(strides_like((8, 6), (4, 6), (12, 1)) == (12, 1), "a row-step slice keeps its gap")
    assert_all_ranks(strides_like((4, 8, 32), (4, 8, 16), (0, 16, 1)) == (0, 32, 1), "an expanded dim stays")
