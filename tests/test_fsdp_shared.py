"""A module called several times in one forward, and tied weights, under fully_shard.

A shared block applied twice stays gathered between its calls (once the first
iteration has recorded the order) and its gradient, the sum of both uses, is
reduce-scattered once per backward; tied embedding/output weights in one group get
the sum of both uses too. Everything is checked against one process on the whole batch.
"""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import DTensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import fully_shard
from mpidtensor.fsdp.group import ShardedState
from test_fsdp import TOL, Block, assert_same_model, batch, train

WORLD = MPI.COMM_WORLD


class SharedNet(nn.Module):
    """One block applied ``uses`` times; ``on_input``: the first call takes the raw input
    (no gradient flows into it, so that call signals no end of its backward)."""

    def __init__(self, uses: int = 2, on_input: bool = False) -> None:
        super().__init__()
        self.uses, self.on_input = uses, on_input
        self.inp = nn.Linear(5, 5)
        self.block = Block(5, 9)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = x if self.on_input else self.inp(x)
        for _ in range(self.uses):
            h = self.block(h)
        return self.head(h)


class TiedNet(nn.Module):
    """Embedding and output projection share one weight; blocks between them."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, 10) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _make(cls, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs)


def _shard(net, children, **kwargs):
    for child in children:
        fully_shard(child, **kwargs)
    return fully_shard(net, **kwargs)


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shared_block_matches_single_process(mesh1d, reshard_after_forward, on_input):
    ref = _make(SharedNet, on_input=on_input)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    ref_losses, _ = train(ref, x, target)
    net = _make(SharedNet, on_input=on_input)
    _shard(net, [net.block], mesh=mesh1d, reshard_after_forward=reshard_after_forward)
    losses, _ = train(net, local_x, local_t, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_shared_block_gradient_is_sum_of_uses(mesh1d):
    """After one backward: every gradient equals one process's (the block's: both uses)."""
    ref = _make(SharedNet, uses=3)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    F.cross_entropy(ref(x), target).backward()
    net = _make(SharedNet, uses=3)
    _shard(net, [net.block], mesh=mesh1d)
    F.cross_entropy(net(local_x), local_t).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in net.named_parameters():
        assert_all_ranks(isinstance(p.grad, DTensor), f"{name}: no sharded gradient")
        assert_close(p.grad.full_tensor(), grads[name], **TOL)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shared_block_collective_counts(mesh1d, reshard_after_forward):
    """Two groups (block, root). The first forward gathers the block per call (its order is
    not known yet); from then on once per forward, and again once in backward (if
    resharded after forward). Every backward: one reduce-scatter per group."""
    net = _make(SharedNet)
    _shard(net, [net.block], mesh=mesh1d, reshard_after_forward=reshard_after_forward)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    for step in range(3):
        with CommDebugMode() as fwd:
            loss = F.cross_entropy(net(x), target)
        with CommDebugMode() as bwd:
            loss.backward()
        net.zero_grad()
        many = WORLD.size > 1  # (a one-rank mesh runs no collective, as torch)
        forward_gathers = (3 if step == 0 and reshard_after_forward else 2) if many else 0
        assert_all_ranks(Counter(fwd.get_comm_counts()) == +Counter(all_gather=forward_gathers),
                         f"step {step} forward {fwd.get_comm_counts()}")
        want = Counter(reduce_scatter=2, all_gather=1 if reshard_after_forward else 0) if many else Counter()
        assert_all_ranks(Counter(bwd.get_comm_counts()) == +want, f"step {step} backward {bwd.get_comm_counts()}")
        block = net.block._fsdp_state.group
        assert_all_ranks(block.sharded_state is ShardedState.SHARDED and not block.reducing,
                         "block left gathered or reducing")


class Switch(nn.Module):
    """Each call uses ``shared`` and one of ``a`` / ``b``: the calls' gradients are ready
    at different times (a parameter used once is accumulated as soon as its call's
    backward is done)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x, first: bool):
        return torch.tanh(self.shared(x) + (self.a(x) if first else self.b(x)))


class SwitchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.switch, self.head = nn.Linear(5, 5), Switch(), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.switch(self.switch(self.inp(x), True), False))


def test_calls_using_different_parameters(mesh1d):
    """The second call's own parameters have their gradients before the first call's
    backward: still one reduce-scatter for the group, after its last call."""
    ref = _make(SwitchNet)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    ref_losses, _ = train(ref, x, target)
    net = _make(SwitchNet)
    _shard(net, [net.switch], mesh=mesh1d)
    with CommDebugMode() as comm:
        F.cross_entropy(net(local_x), local_t).backward()
    net.zero_grad()
    assert_all_ranks(comm.get_comm_counts()["reduce_scatter"] == (2 if WORLD.size > 1 else 0), f"{comm.get_comm_counts()}")
    net = _make(SwitchNet)
    _shard(net, [net.switch], mesh=mesh1d)
    losses, _ = train(net, local_x, local_t, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_two_forwards_one_backward(mesh1d):
    """Two forwards, one backward of the summed loss: each group is reduced once, with the
    gradient of both forwards."""
    ref = _make(SharedNet)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    (F.cross_entropy(ref(x), target) + F.cross_entropy(ref(2 * x), target)).backward()
    net = _make(SharedNet)
    _shard(net, [net.block], mesh=mesh1d)
    with CommDebugMode() as comm:
        loss = F.cross_entropy(net(local_x), local_t) + F.cross_entropy(net(2 * local_x), local_t)
        loss.backward()
    assert_all_ranks(comm.get_comm_counts()["reduce_scatter"] == (2 if WORLD.size > 1 else 0), f"{comm.get_comm_counts()}")
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in net.named_parameters():
        assert_close(p.grad.full_tensor(), grads[name], **TOL)


def test_shared_block_accumulation_without_sync(mesh1d):
    """Two micro-batches, the first without gradient sync, through the shared block."""
    ref = _make(SharedNet)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    half = x.size(0) // 2
    for rows in (slice(None, half), slice(half, None)):
        (F.cross_entropy(ref(x[rows]), target[rows], reduction="sum") / x.size(0)).backward()
    net = _make(SharedNet)
    _shard(net, [net.block], mesh=mesh1d)
    per = local_x.size(0) // 2
    for i, rows in enumerate((slice(None, per), slice(per, None))):
        net.set_requires_gradient_sync(i == 1)
        loss = F.cross_entropy(net(local_x[rows]), local_t[rows], reduction="sum") * WORLD.size / x.size(0)
        loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in net.named_parameters():
        assert_close(p.grad.full_tensor(), grads[name], **TOL)


def _tokens(dp_size, dp_rank, per_rank=2, seq=4):
    tokens = torch.randint(0, 11, (per_rank * dp_size, seq + 1), generator=torch.Generator().manual_seed(3))
    return tokens, tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def test_tied_embedding_and_output(mesh1d):
    ref = _make(TiedNet)
    tokens, local = _tokens(WORLD.size, WORLD.rank)
    net = _make(TiedNet)
    _shard(net, net.blocks, mesh=mesh1d)
    assert_all_ranks(net.head.weight is net.emb.weight and isinstance(net.emb.weight, DTensor), "tie lost")

    def step(model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    losses = {}
    for name, model, batch_ in (("ref", ref, tokens), ("fsdp", net, local)):
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
        values = []
        for _ in range(3):
            loss = step(model, batch_)
            loss.backward()
            opt.step()
            opt.zero_grad()
            values.append(loss.item())
        losses[name] = torch.tensor(values)
    averaged = torch.tensor([WORLD.allreduce(v) / WORLD.size for v in losses["fsdp"].tolist()])
    assert_close(averaged, losses["ref"], **TOL)
    assert_all_ranks(net.head.weight is net.emb.weight, "tie lost after training")
    assert_same_model(net, ref, **TOL)


def test_tie_across_groups_raises(mesh1d):
    """Sharding the output projection alone unties it from the embedding: as torch's, the
    root's first forward (which would use the embedding's copy sharded separately) raises
    torch's ValueError on every rank, naming the parameter."""
    net = _make(TiedNet)
    fully_shard(net.head, mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    raises_everywhere(ValueError, lambda: net(torch.zeros(2, 3, dtype=torch.long)),
                      "Parameter 'emb.weight' is shared with a parameter already managed by another FSDP group")
