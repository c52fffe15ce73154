"""fully_shard (FSDP2 semantics): training matches one process from the same seed.

Each rank trains on its own slice of the batch; the single-process reference trains
on the whole batch, so averaged gradients must reproduce it. Every parameter's
``full_tensor()`` and every loss are compared after several AdamW steps.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

WORLD = MPI.COMM_WORLD
TOL = dict(atol=1e-5, rtol=1e-5)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Input projection, residual blocks, head: odd sizes so that shards are uneven."""

    def __init__(self, n_blocks: int = 2, dim: int = 6, hidden: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def shard_net(net: Net, **kwargs) -> Net:
    for block in net.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(net, **kwargs)


def batch(dp_size: int, dp_rank: int, per_rank: int = 3):
    """The whole batch and this data-parallel rank's slice of it."""
    x = global_tensor((per_rank * dp_size, 5), seed=7)
    target = torch.randint(0, 3, (per_rank * dp_size,), generator=torch.Generator().manual_seed(8))
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return (x, target), (x[rows], target[rows])


def train(model, x, target, *, steps=4, foreach=False, comm=None, clip=None, lr=0.02, forward=None):
    """AdamW steps; the losses (averaged over ``comm``) and the clip norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=foreach)
    losses, norms = [], []
    for _ in range(steps):
        loss = F.cross_entropy((forward or model)(x).float(), target)
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        opt.step()
        opt.zero_grad()
        value = loss.item()
        losses.append(value if comm is None else comm.allreduce(value) / comm.size)
    return torch.tensor(losses), norms


def assert_same_model(sharded: nn.Module, ref: nn.Module, **tol) -> None:
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in sharded.named_parameters()]
    assert_all_ranks(sorted(names) == sorted(ref_params), f"parameter names differ: {names}")
    for name, p in sharded.named_parameters():
        assert_all_ranks(isinstance(p, DTensor), f"{name} is not a DTensor")
        assert_close(p.full_tensor(), ref_params[name].detach(), **tol)


def reference(steps=4, clip=None, foreach=False):
    ref = make_net()
    (x, target), _ = batch(WORLD.size, 0)
    losses, norms = train(ref, x, target, steps=steps, clip=clip, foreach=foreach)
    return ref, losses, norms


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_matches_single_process(mesh1d, reshard_after_forward, foreach):
    ref, ref_losses, _ = reference(foreach=foreach)
    net = shard_net(make_net(), mesh=mesh1d, reshard_after_forward=reshard_after_forward)
    assert_all_ranks(isinstance(net, FSDPModule) and isinstance(net.blocks[0], FSDPModule))
    assert_all_ranks(type(net).__name__ == "FSDPNet", type(net).__name__)
    for p in net.parameters():
        assert_all_ranks(p.placements == (Shard(0),), f"{p.placements}")
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, foreach=foreach, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_frozen_and_trainable_share_a_group(mesh1d):
    ref, net = make_net(), make_net()
    for model in (ref, net):
        for block in model.blocks:
            block.norm.requires_grad_(False)
            block.fc1.bias.requires_grad_(False)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    ref_losses, _ = train(ref, x, target)
    shard_net(net, mesh=mesh1d)
    losses, _ = train(net, local_x, local_t, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)
    frozen = net.blocks[0].norm.weight
    assert_all_ranks(isinstance(frozen, DTensor) and not frozen.requires_grad and frozen.grad is None)


def test_fsdp_explicit_prefetch(mesh1d):
    ref, ref_losses, _ = reference()
    net = shard_net(make_net(), mesh=mesh1d)
    blocks = list(net.blocks)
    net.set_modules_to_forward_prefetch([blocks[0]])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_fsdp_mixed_precision_bf16(mesh1d):
    """Against one process computing in bf16 from fp32 master weights (as the policy does)."""
    ref = make_net()

    def bf16_forward(x):
        params = {n: p.to(torch.bfloat16) for n, p in ref.named_parameters()}
        return torch.func.functional_call(ref, params, (x.to(torch.bfloat16),))

    (full_x, full_target), _ = batch(WORLD.size, 0)
    ref_losses, _ = train(ref, full_x, full_target, lr=0.002, forward=bf16_forward)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net = shard_net(make_net(), mesh=mesh1d, mp_policy=mp)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    with CommDebugMode() as comm:
        out = net(x)
    assert_all_ranks(out.dtype == torch.bfloat16, str(out.dtype))
    gathered = sum(p.numel() for p in net.parameters()) * 2  # bytes of the whole model in bf16
    padded = sum(-(-p.shape[0] // WORLD.size) * (p.numel() // p.shape[0]) * 2 + 16 for p in net.parameters())
    sent = comm.get_comm_bytes()["all_gather"]
    ok = gathered <= sent * WORLD.size and sent <= padded if WORLD.size > 1 else sent == 0  # (one rank: none)
    assert_all_ranks(ok, f"all-gather sent {sent} bytes for {gathered} bf16 bytes")
    out.float().sum().backward()
    net.zero_grad()
    for p in net.parameters():
        assert_all_ranks(p.dtype == torch.float32 and p.grad is None)
    losses, _ = train(net, x, target, comm=WORLD, lr=0.002)
    assert_close(losses, ref_losses, atol=2e-2, rtol=2e-2)
    assert_same_model(net, ref, atol=2e-2, rtol=2e-2)


def test_hsdp_2d(mesh2d):
    ref, ref_losses, _ = reference()
    net = shard_net(make_net(), mesh=mesh2d)
    for p in net.parameters():
        assert_all_ranks(p.placements == (Replicate(), Shard(0)), f"{p.placements}")
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm(mesh1d, foreach):
    ref, ref_losses, ref_norms = reference(clip=0.5, foreach=foreach)
    net = shard_net(make_net(), mesh=mesh1d)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, norms = train(net, x, target, comm=WORLD, clip=0.5, foreach=foreach)
    assert_close(torch.stack(norms), torch.stack(ref_norms), **TOL)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_collective_counts(mesh1d, reshard_after_forward):
    net = shard_net(make_net(n_blocks=3), mesh=mesh1d, reshard_after_forward=reshard_after_forward)
    groups = 4  # three blocks and the root (input projection and head)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        with CommDebugMode() as fwd:
            loss = F.cross_entropy(net(x), target)
        with CommDebugMode() as bwd:
            loss.backward()
        with CommDebugMode() as step:
            opt.step()
            opt.zero_grad()
        # the root stays gathered from forward to backward; the others are gathered again
        regathered = groups - 1 if reshard_after_forward else 0
        many = WORLD.size > 1  # (a one-rank mesh runs no collective, as torch)
        assert_all_ranks(fwd.get_comm_counts() == ({"all_gather": groups} if many else {}),
                         f"forward {fwd.get_comm_counts()}")
        expected = {"reduce_scatter": groups, **({"all_gather": regathered} if regathered else {})} if many else {}
        assert_all_ranks(bwd.get_comm_counts() == expected, f"backward {bwd.get_comm_counts()}")
        assert_all_ranks(step.get_total_counts() == 0, f"optimizer {step.get_comm_counts()}")


def test_collective_counts_hsdp(mesh2d):
    net = shard_net(make_net(), mesh=mesh2d)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    with CommDebugMode() as comm:
        F.cross_entropy(net(x), target).backward()
    assert_all_ranks(comm.get_comm_counts() == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3},
                     f"{comm.get_comm_counts()}")


def _parameter_bytes(net: nn.Module) -> int:
    """Bytes of the distinct live storages behind every FSDP parameter's two forms."""
    storages = {}
    for module in net.modules():
        group = module._fsdp_state.group if isinstance(module, FSDPModule) else None
        for p in group.params if group is not None else ():
            for t in (p.sharded._local_tensor, p.unsharded):
                if t is not None:
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _padded_bytes(params, world: int, copies: int = 1) -> int:
    """Bytes of the padded, 16-byte aligned flat segments FSDP keeps for ``params``."""
    def aligned(nbytes):
        return -(-nbytes // 16) * 16

    return sum(aligned(-(-p.shape[0] // world) * copies * (p.numel() // p.shape[0]) * 4) for p in params)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_parameter_memory(mesh1d):
    """During forward and backward, parameter memory stays at the sharded size plus the
    gathered groups in flight: the one computing, the root (it stays gathered between
    forward and backward) and the one prefetched."""
    n_blocks, dim, hidden = 4, 16, 64
    world = WORLD.size
    net = shard_net(make_net(n_blocks=n_blocks, dim=dim, hidden=hidden), mesh=mesh1d)
    ref = make_net(n_blocks=n_blocks, dim=dim, hidden=hidden)
    sharded = _padded_bytes(ref.parameters(), world)
    block = _padded_bytes(ref.blocks[0].parameters(), world, copies=world)
    root = _padded_bytes([ref.inp.weight, ref.inp.bias, ref.head.weight, ref.head.bias], world, copies=world)
    peak = []

    def measure(*_):
        peak.append(_parameter_bytes(net))

    for module in net.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(measure)
            module.register_full_backward_hook(measure)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    for _ in range(2):
        F.cross_entropy(net(x), target).backward()
    full = sum(p.numel() for p in ref.parameters()) * 4
    bound = sharded + root + 2 * block
    assert_all_ranks(max(peak) <= bound, f"peak {max(peak)} > {bound} (sharded {sharded}, full {full})")
    assert_all_ranks(world == 1 or bound < 0.8 * full + sharded, f"bound {bound} is not below the full model")
    assert_all_ranks(_parameter_bytes(net) == sharded, f"after backward {_parameter_bytes(net)} != {sharded}")


def test_gradient_accumulation_without_sync(mesh1d):
    """Two micro-batches, the first without gradient sync: the same step as one sync'd backward
    of their sum."""
    ref = make_net()
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    half = x.size(0) // 2
    for rows in (slice(None, half), slice(half, None)):
        (F.cross_entropy(ref(x[rows]), target[rows], reduction="sum") / x.size(0)).backward()
    net = shard_net(make_net(), mesh=mesh1d)
    per = local_x.size(0) // 2
    for i, rows in enumerate((slice(None, per), slice(per, None))):
        net.set_requires_gradient_sync(i == 1)
        net.set_reshard_after_backward(i == 1)
        with CommDebugMode() as comm:
            out = net(local_x[rows])
        (F.cross_entropy(out, local_t[rows], reduction="sum") * WORLD.size / x.size(0)).backward()
        if i == 0:
            assert_all_ranks(all(p.grad is None for p in net.parameters()), "gradient reduced without sync")
        else:  # still gathered from the first micro-batch's backward
            assert_all_ranks(comm.get_total_counts() == 0, f"second forward: {comm.get_comm_counts()}")
    assert_all_ranks(all(isinstance(p, DTensor) for p in net.parameters()), "not resharded")
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in net.named_parameters():
        assert_close(p.grad.full_tensor(), ref_grads[name], **TOL)


class _Branches(nn.Module):
    """Two heads; ``forward(x, both=False)`` uses the first only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x, both: bool = True):
        return self.a(x) + self.b(x) if both else self.a(x)


@pytest.mark.parametrize("own_group", [False, True], ids=["one-group", "b-own-group"])
def test_accumulated_gradient_of_a_module_the_last_backward_skips(mesh1d, own_group):
    """A parameter with a gradient from a micro-batch without sync and none from the synced
    last one still gets it reduced (torch keeps it in its accumulated gradient), whether
    its group runs in the last backward or not at all."""
    torch.manual_seed(3)
    ref = _Branches()
    net = copy.deepcopy(ref)
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    for both in (True, False):
        (F.cross_entropy(ref(x, both), target, reduction="sum") / x.size(0)).backward()
    if own_group:
        fully_shard(net.b, mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    for i, both in enumerate((True, False)):
        net.set_requires_gradient_sync(i == 1)
        (F.cross_entropy(net(local_x, both), local_t, reduction="sum") * WORLD.size / x.size(0)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    got = {n: p.grad.full_tensor() if p.grad is not None else None for n, p in net.named_parameters()}
    missing = sorted(n for n, g in got.items() if g is None)
    assert_all_ranks(not missing, f"no gradient for {missing}")
    for name, g in got.items():
        assert_close(g, ref_grads[name], **TOL)


def test_unshard_reshard_api(mesh1d):
    net = shard_net(make_net(), mesh=mesh1d)
    ref = make_net()
    handle = net.blocks[0].unshard(async_op=True)
    handle.wait()
    weight = net.blocks[0].fc1.weight
    assert_all_ranks(not isinstance(weight, DTensor), "unsharded parameter is still a DTensor")
    assert_close(weight.detach(), ref.blocks[0].fc1.weight.detach())
    net.blocks[0].reshard()
    assert_all_ranks(isinstance(net.blocks[0].fc1.weight, DTensor))
    with torch.no_grad():  # no backward follows: every group, the root included, reshards
        out = net(global_tensor((2, 5)))
    assert_close(out, ref(global_tensor((2, 5))), **TOL)
    assert_all_ranks(all(isinstance(p, DTensor) for p in net.parameters()))
