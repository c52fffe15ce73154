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
from mpidtensor import DTensor, Replicate, Shard, _StridedShard, distribute_tensor
from mpidtensor.fsdp.api import _shard_dim
from mpidtensor.fsdp.param import _strided_exact
from mpidtensor.tensor.layout import dim_runs
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


def test_shard_placement_fn_on_a_tp_sharded_dim_is_strided(mesh2d):
    """``Shard(0)`` for a ColwiseParallel weight (TP shards dim 0 too): as torch's FSDP2,
    ``_StridedShard(0, sf=tp)`` on dp, each rank's rows its chunk of its TP block."""
    net = make_net(hidden=10)
    parallelize_module(net.blocks[0], mesh2d["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    tp_block = net.blocks[0].fc1.weight.to_local().clone()
    fully_shard(net.blocks[0], mesh=mesh2d["dp"], shard_placement_fn=lambda p: Shard(0))
    weight, dp = net.blocks[0].fc1.weight, mesh2d.get_group("dp")
    assert_all_ranks(weight.placements == (_StridedShard(0, split_factor=2), Shard(0)), f"{weight.placements}")
    assert_all_ranks(torch.equal(weight.to_local(), tp_block.chunk(dp.size)[dp.rank]))


@pytest.mark.parametrize("dp,tp", [(2, 2), (3, 2), (2, 3), (4, 2), (3, 3)])
def test_strided_layout_exact_against_torch_chunk(dp, tp):
    """``param._strided_exact`` (whether ``[_StridedShard(0, sf=tp), Shard(0)]`` describes
    FSDP's rows, a ``torch.chunk`` of each rank's TP block) against torch.chunk itself: the
    verdict is true exactly where every rank's indices agree. Uneven lengths over 3+
    data-parallel ranks are where the two differ (7 rows over (3, 2))."""
    layout = (_StridedShard(0, split_factor=tp), Shard(0))
    for length in range(0, 30):
        rows = torch.arange(length)
        agree = True
        for d in range(dp):
            for t in range(tp):
                block = rows.chunk(tp)[t] if t < len(rows.chunk(tp)) else rows[:0]
                pieces = block.chunk(dp)
                mine = pieces[d] if d < len(pieces) else rows[:0]
                runs = dim_runs(length, 0, layout, (dp, tp), (d, t))
                agree &= mine.tolist() == [i for o, n in runs for i in range(o, o + n)]
        assert _strided_exact(length, 0, layout, (dp, tp), 0) == agree, (length, agree)
    assert dp != 3 or tp != 2 or not _strided_exact(7, 0, layout, (3, 2), 0)


class _Uneven:
    """A mesh info whose strided layouts never describe FSDP's rows (3+ data-parallel ranks, uneven)."""

    def layout_exact(self, tp_spec, dim, length):
        return False


def test_uneven_strided_layout_falls_back_or_is_refused(mesh1d):
    """Where the strided layout cannot describe the rows, the default shards the first dim
    TP leaves whole (``None`` if there is none: a Colwise bias stays replicated), and
    ``shard_placement_fn`` asking for the TP-sharded dim gets a ValueError."""
    weight = distribute_tensor(torch.randn(10, 7), mesh1d, [Shard(0)])
    bias = distribute_tensor(torch.randn(10), mesh1d, [Shard(0)])
    assert _shard_dim(weight, None, _Uneven(), None) == 1 and _shard_dim(bias, None, _Uneven(), None) is None
    with pytest.raises(ValueError, match="cannot describe those rows"):
        _shard_dim(weight, lambda p: Shard(0), _Uneven(), None)


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
