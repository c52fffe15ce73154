"""fully_shard's ``shard_placement_fn`` on plain parameters (Shard(d > 0): strided packing,
uneven shards at 2-4 ranks), its argument checks, clip_grad_norm_ (foreach and not) on
tensor-parallel parameters, and FSDP's buffers as ``mpidtensor.tools.memory`` sees them."""
import gc
from math import prod

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard
from mpidtensor.tools import memory
from mpidtensor.fsdp import MixedPrecisionPolicy, fully_shard
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from test_fsdp import TOL, assert_same_model, batch, make_net, reference, shard_net, train

WORLD = MPI.COMM_WORLD


def last_dim(param):
    return Shard(-1) if param.ndim > 1 else None


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shard_last_dim_matches_single_process(mesh1d, reshard_after_forward):
    ref, ref_losses, _ = reference()
    net = shard_net(make_net(), mesh=mesh1d, shard_placement_fn=last_dim,
                    reshard_after_forward=reshard_after_forward)
    assert_all_ranks(net.inp.weight.placements == (Shard(1),) and net.inp.bias.placements == (Shard(0),))
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_shard_last_dim_cast_and_hsdp(request):
    """param_dtype (the packed send path) on a 1-D mesh; HSDP on 2x2 at 4 ranks."""
    mesh = request.getfixturevalue("mesh2d") if WORLD.size == 4 else request.getfixturevalue("mesh1d")
    ref, ref_losses, _ = reference()
    mp = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32)
    net = shard_net(make_net(), mesh=mesh, shard_placement_fn=last_dim, mp_policy=mp)
    want = (Replicate(), Shard(1)) if mesh.ndim == 2 else (Shard(1),)
    assert_all_ranks(net.head.weight.placements == want, f"{net.head.weight.placements}")
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x.double(), target, comm=WORLD)
    assert_close(losses, ref_losses, atol=1e-4, rtol=1e-4)
    assert_same_model(net, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn, error", [(lambda p: Shard(2), AssertionError), (lambda p: Replicate(), TypeError)])
def test_bad_shard_placement_fn(mesh1d, fn, error):
    net = make_net()
    before = dict(net.named_parameters())
    try:
        fully_shard(net, mesh=mesh1d, shard_placement_fn=fn)
        raised = None
    except (TypeError, ValueError, AssertionError) as exc:  # (torch's type for an invalid dim: AssertionError)
        raised = exc
    assert_all_ranks(type(raised) is error, f"{raised!r}")
    assert_all_ranks(all(p is before[n] for n, p in net.named_parameters()))


def test_shard_placement_fn_on_a_tp_sharded_dim_is_refused(mesh2d):
    net = make_net()
    parallelize_module(net.blocks[0], mesh2d["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    before = dict(net.blocks[0].named_parameters())
    try:
        fully_shard(net.blocks[0], mesh=mesh2d["dp"], shard_placement_fn=lambda p: Shard(0))
        message = None
    except ValueError as exc:
        message = str(exc)
    assert_all_ranks(message is not None and "strided" in message, f"{message}")
    assert_all_ranks(all(p is before[n] for n, p in net.blocks[0].named_parameters()))


def _tp_mlp(mesh):
    net = make_net(hidden=12)  # 12: even TP shards at 1-4 ranks (from_local reads them so)
    for block in net.blocks:
        parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for name in ("inp", "head"):
        parallelize_module(net, mesh, {name: ColwiseParallel(output_layouts=Replicate())})
    return net


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_tp(mesh1d, foreach):
    ref = make_net(hidden=12)
    (x, target), _ = batch(1, 0)
    ref_losses, ref_norms = train(ref, x, target, clip=0.5, foreach=foreach)
    net = _tp_mlp(mesh1d)
    losses, norms = train(net, x, target, clip=0.5, foreach=foreach)
    assert_close(torch.stack(norms), torch.stack(ref_norms), **TOL)
    assert_close(losses, ref_losses, **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in net.named_parameters():  # the norms stay plain tensors
        assert_close(p.full_tensor() if isinstance(p, DTensor) else p.detach(), ref_params[name].detach(), **TOL)


def test_memory_figures(mesh1d):
    """``memory_allocated()`` sees FSDP's buffers: the sharded parameters after sharding
    and after backward (plus the sharded gradients there), and during forward a peak of at
    most sharded + the root's group (gathered all forward) + three of the largest group
    (its unsharded buffer, its all-gather receive buffer, and the prefetched next group's
    receive buffer); margins: one padding row and 16 alignment bytes per parameter."""
    gc.collect()
    base = memory.memory_allocated()
    net = shard_net(make_net(n_blocks=3, dim=32, hidden=64), mesh=mesh1d)
    world, itemsize = WORLD.size, 4
    params = list(net.parameters())
    ideal = sum(p.numel() for p in params) * itemsize / world
    margin = sum(prod(p.shape[1:]) * itemsize + 16 for p in params)
    sharded = memory.memory_allocated() - base
    assert_all_ranks(ideal <= sharded + margin and sharded <= ideal + margin, f"sharded {sharded} vs {ideal}")
    group = sum(p.numel() for p in net.blocks[0].parameters()) * itemsize
    root = sum(p.numel() for m in (net.inp, net.head) for p in m.parameters()) * itemsize
    _, (x, target) = batch(world, WORLD.rank)
    for step in range(2):  # the second step prefetches in forward
        memory.reset_peak_memory_stats()
        loss = F.cross_entropy(net(x), target)
        peak = memory.max_memory_allocated() - base
        bound = sharded + root + 3 * group + margin
        assert_all_ranks(sharded + group <= peak <= bound, f"step {step}: forward peak {peak}, bound {bound}")
        loss.backward()
        after = memory.memory_allocated() - base
        assert_all_ranks(after <= 2 * (ideal + margin), f"after backward {after} vs 2 x {ideal}")
        net.zero_grad()
        gc.collect()
        now = memory.memory_allocated() - base
        assert_all_ranks(now == sharded, f"after zero_grad {now} vs {sharded}")
