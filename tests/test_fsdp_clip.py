"""``mpidtensor.fsdp.clip_grad_norm_`` on FSDP, FSDP x TP and HSDP x TP models, whose
gradients are DTensors on several meshes (torch's ``clip_grad_norm_`` refuses them): the
total norm equals one process's, clipped training gives the same parameters, and the norm
costs one all-reduce per distinct rank group."""
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import clip_grad_norm_
from test_fsdp import TOL, assert_same_model, batch, make_net, shard_net
from test_fsdp_hsdp_tp import ALL_SHAPES, NET, _dp, mesh_of
from test_fsdp_tp import fsdp_net, tp_net

WORLD = MPI.COMM_WORLD
MAX_NORM = 0.1  # below the gradients' norm: every step clips


def _train(model, x, target, *, clip, norm_type, foreach, comm=None, steps=3):
    """AdamW steps with gradient clipping; (losses averaged over ``comm``, norms). The
    optimizer is not foreach: its ``_foreach_*`` ops would mix meshes under FSDP x TP."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=False)
    losses, norms = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        norms.append(clip(model.parameters(), MAX_NORM, norm_type=norm_type, foreach=foreach))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if comm is None else comm.allreduce(loss.item()) / comm.size)
    return torch.tensor(losses), torch.stack(norms)


def _reference(dp_size, norm_type, foreach, **net):
    ref = make_net(**net)
    (x, target), _ = batch(dp_size, 0)
    losses, norms = _train(ref, x, target, clip=torch.nn.utils.clip_grad_norm_, norm_type=norm_type,
                           foreach=foreach)
    return ref, losses, norms


def _check(net, ref_run, x, target, comm, norm_type, foreach):
    ref, ref_losses, ref_norms = ref_run
    losses, norms = _train(net, x, target, clip=clip_grad_norm_, norm_type=norm_type, foreach=foreach, comm=comm)
    assert_all_ranks(not isinstance(norms, DTensor) and norms.shape == ref_norms.shape, f"{norms}")
    assert_all_ranks(bool((ref_norms > MAX_NORM).all()), f"reference norms {ref_norms} never clip")
    assert_close(norms, ref_norms, **TOL)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_fsdp_1d(mesh1d, norm_type, foreach):
    """1-D FSDP at every world size (uneven shards at 3 ranks, an empty head-bias shard at 4)."""
    ref_run = _reference(WORLD.size, norm_type, foreach)
    net = shard_net(make_net(), mesh=mesh1d)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    _check(net, ref_run, x, target, WORLD, norm_type, foreach)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_fsdp_tp(mesh2d, norm_type, foreach):
    """FSDP x TP on (dp, tp): gradients on mesh2d (dp- and tp-sharded) and on mesh2d["dp"]."""
    ref_run = _reference(2, norm_type, foreach, **NET)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    meshes = {p.device_mesh for p in net.parameters()}
    assert_all_ranks(meshes == {mesh2d, mesh2d["dp"]}, f"{meshes}")
    dp = mesh2d.get_group("dp")
    _, (x, target) = batch(2, dp.rank)
    _check(net, ref_run, x, target, dp, norm_type, foreach)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_hsdp_tp(shape):
    """HSDP x TP on (dp_replicate, dp_shard, tp): [Replicate(), Shard(d), <tp>] gradients."""
    mesh3d = mesh_of(shape)
    ref_run = _reference(mesh3d.size(0) * mesh3d.size(1), 2.0, False, **NET)
    dp, comm = _dp(mesh3d)
    net = tp_net(mesh3d)
    fsdp_net(net, dp, net.blocks)
    _, (x, target) = batch(comm.size, comm.rank)
    _check(net, ref_run, x, target, comm, 2.0, False)


def test_one_all_reduce_per_rank_group(mesh2d):
    """FSDP x TP gradients are sharded over all 4 ranks (Colwise weights and biases, whose
    ``_StridedShard`` on dp counts as a shard, Rowwise weights) or over dp (a Rowwise bias on
    mesh2d and every plain parameter on mesh2d["dp"]: the same ranks): two all-reduces,
    nothing else."""
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    _, (x, target) = batch(2, mesh2d.get_group("dp").rank)
    F.cross_entropy(net(x), target).backward()
    with CommDebugMode() as comm:
        clip_grad_norm_(net.parameters(), MAX_NORM)
    assert_all_ranks(Counter(comm.get_comm_counts()) == Counter(all_reduce=2), f"{comm.get_comm_counts()}")


def test_plain_and_partial_gradients(mesh1d):
    """Plain tensors count once (replicated); a Partial gradient is summed before its norm."""
    torch.manual_seed(0)
    plain = torch.nn.Parameter(global_tensor((4, 3), seed=1))
    plain.grad = global_tensor((4, 3), seed=2)
    ref_plain = plain.grad.clone()
    whole = global_tensor((5, 2), seed=3)
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 2), mesh1d, [Replicate()]))
    param.grad = DTensor.from_local(whole / WORLD.size, mesh1d, [Partial()])
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(7, 3), mesh1d, [Shard(0)]))
    sharded.grad = distribute_tensor(global_tensor((7, 3), seed=4), mesh1d, [Shard(0)])
    ref_grads = [ref_plain, whole.clone(), global_tensor((7, 3), seed=4)]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref_grads]
    for p, g in zip(ref_params, ref_grads):
        p.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    norm = clip_grad_norm_([plain, param, sharded], 1.0)
    assert_close(norm, ref_norm, **TOL)
    assert_all_ranks(param.grad.placements == (Replicate(),), f"{param.grad.placements}")
    for p, ref in zip((plain, param, sharded), ref_params):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert_close(grad, ref.grad, **TOL)


def test_bad_input_raises_everywhere(mesh1d):
    net = shard_net(make_net(), mesh=mesh1d)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    F.cross_entropy(net(x), target).backward()
    raises_everywhere(ValueError, lambda: clip_grad_norm_(net.parameters(), 1.0, norm_type=0), "norm_type")
    net.head.bias.grad._local_tensor.fill_(float("nan"))  # every rank: its piece (maybe empty)
    net.inp.bias.grad._local_tensor.fill_(float("nan"))
    raises_everywhere(RuntimeError, lambda: clip_grad_norm_(net.parameters(), 1.0, error_if_nonfinite=True),
                      "non-finite")
    norm = clip_grad_norm_(net.parameters(), 1.0)
    assert_all_ranks(bool(torch.isnan(norm)), f"{norm}")
