"""FSDP x TP on a 2x2 (dp, tp) mesh: tensor-parallel modules, then fully_shard over dp.

FSDP shards the first dim TP leaves whole: ``[Shard(1), Shard(0)]`` for a ColwiseParallel
weight, ``[Shard(0), Shard(1)]`` for a RowwiseParallel one; a Colwise bias (no free dim)
stays replicated over dp. Training matches one process on the whole batch, and every
step runs TP's collectives plus exactly FSDP's own.
"""
import copy
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import fully_shard
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from test_fsdp import TOL, assert_same_model, batch, make_net, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import build_model, cross_entropy, parallelize_llama  # noqa: E402
from test_llama_tp import PARAM_ATOL, config, tokens  # noqa: E402

NET = dict(dim=7, hidden=10)  # dim 7: FSDP's Shard(1) of a Colwise weight is uneven (4 + 3)


def tp_net(mesh, colwise: bool = True):
    """The test MLP with each block's fc1/fc2 tensor-parallel over ``mesh["tp"]``."""
    net = make_net(**NET)
    first = ColwiseParallel() if colwise else RowwiseParallel(input_layouts=Replicate())
    second = RowwiseParallel() if colwise else RowwiseParallel(input_layouts=Replicate())
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], {"fc1": first, "fc2": second})
    return net


def fsdp_net(net, mesh, blocks):
    """``fully_shard`` each of ``blocks``, then the whole net, over ``mesh``."""
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def _placements(net):
    return {name: tuple(p.placements) for name, p in net.named_parameters()}


def test_colwise_rowwise_mlp_matches_single_process(mesh2d):
    ref = make_net(**NET)
    (x, target), _ = batch(2, 0)
    ref_losses, _ = train(ref, x, target)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    placements = _placements(net)
    expected = {"fc1.weight": (Shard(1), Shard(0)), "fc1.bias": (Replicate(), Shard(0)),
                "fc2.weight": (Shard(0), Shard(1)), "fc2.bias": (Shard(0), Replicate())}
    for name, want in expected.items():
        assert_all_ranks(placements[f"blocks.0.{name}"] == want, f"{name}: {placements[f'blocks.0.{name}']}")
        assert_all_ranks(net.blocks[1].get_parameter(name).device_mesh == mesh2d)
    assert_all_ranks(net.inp.weight.device_mesh == mesh2d["dp"] and net.inp.weight.placements == (Shard(0),))
    dp = mesh2d.get_group("dp")
    _, (local_x, local_t) = batch(2, dp.rank)
    losses, _ = train(net, local_x, local_t, comm=dp)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_rowwise_only_keeps_dim0(mesh2d):
    """TP that leaves dim 0 whole: FSDP keeps Shard(0) (the layout before shard_placement_fn)."""
    ref = make_net(**NET)
    (x, target), _ = batch(2, 0)
    ref_losses, _ = train(ref, x, target)
    net = tp_net(mesh2d, colwise=False)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    fc1 = net.blocks[0].fc1
    assert_all_ranks(fc1.weight.placements == (Shard(0), Shard(1)) and fc1.bias.placements == (Shard(0), Replicate()))
    dp = mesh2d.get_group("dp")
    _, (local_x, local_t) = batch(2, dp.rank)
    losses, _ = train(net, local_x, local_t, comm=dp)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def _step_counts(net, x, target, opt):
    counts = []
    for phase in ("forward", "backward", "step"):
        with CommDebugMode() as comm:
            if phase == "forward":
                loss = F.cross_entropy(net(x), target)
            elif phase == "backward":
                loss.backward()
            else:
                opt.step()
                opt.zero_grad()
        counts.append(Counter(comm.get_comm_counts()))
    return counts


def test_mlp_collective_counts(mesh2d):
    """Per step, on top of TP's own collectives (measured on the TP-only model): one
    all-gather per group in forward, one more per non-root group in backward, one
    reduce-scatter per group, and one all-reduce per group holding replicated biases."""
    dp = mesh2d.get_group("dp")
    _, (x, target) = batch(2, dp.rank)
    tp_only = tp_net(mesh2d)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    tp_opt = torch.optim.AdamW(tp_only.parameters(), lr=0.01)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        tp_fwd, tp_bwd, _ = _step_counts(tp_only, x, target, tp_opt)
        fwd, bwd, step = _step_counts(net, x, target, opt)
        groups, blocks = 3, 2
        assert_all_ranks(fwd == tp_fwd + Counter(all_gather=groups), f"forward {fwd} vs TP {tp_fwd}")
        want = tp_bwd + Counter(all_gather=groups - 1, reduce_scatter=groups, all_reduce=blocks)
        assert_all_ranks(bwd == want, f"backward {bwd} vs TP {tp_bwd}")
        assert_all_ranks(sum(step.values()) == 0, f"optimizer {step}")


def _llama_train(model, batch, dp, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        logits = model(batch[:, :-1])
        with loss_parallel():
            loss = cross_entropy(logits, batch[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(dp.allreduce(loss.full_tensor().item()) / dp.size)
    return torch.tensor(losses)


def test_llama_fsdp_tp_matches_single_process(mesh2d):
    cfg = config(2)
    ref = build_model(cfg, seed=3)
    model = parallelize_llama(copy.deepcopy(ref), mesh2d["tp"])
    fsdp_net(model, mesh2d["dp"], model.layers)
    placements = _placements(model)
    assert_all_ranks(placements["layers.0.attention.wq.weight"] == (Shard(1), Shard(0)), f"{placements}")
    assert_all_ranks(placements["layers.0.feed_forward.w2.weight"] == (Shard(0), Shard(1)), f"{placements}")
    assert_all_ranks(placements["tok_embeddings.weight"] == (Shard(1), Shard(0)), f"{placements}")
    assert_all_ranks(placements["norm.weight"] == (Shard(0), Replicate()), f"{placements}")
    batch = tokens(cfg)
    ref_opt, ref_losses = torch.optim.AdamW(ref.parameters(), lr=1e-2), []
    for _ in range(4):
        loss = cross_entropy(ref(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    dp = mesh2d.get_group("dp")
    losses = _llama_train(model, batch[dp.rank:dp.rank + 1], dp)
    assert_close(losses, torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    differ = {}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert_all_ranks(isinstance(p, DTensor) and p.device_mesh == mesh2d, f"{name}: {p}")
        full = p.full_tensor()
        if not torch.allclose(full, p_ref.detach(), atol=PARAM_ATOL, rtol=1e-5):
            differ[name] = (full - p_ref.detach()).abs().max().item()
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


def test_llama_collective_counts(mesh2d):
    """One step of the Llama block stack: TP + SP's collectives (measured on the TP-only
    model) plus FSDP's: an all-gather per group (3) in forward, again per non-root group in
    backward, a reduce-scatter per group (no biases: no all-reduce)."""
    cfg = config(2)
    batch = tokens(cfg)[:1]
    tp_only = parallelize_llama(build_model(cfg, seed=3), mesh2d["tp"])
    model = parallelize_llama(build_model(cfg, seed=3), mesh2d["tp"])
    fsdp_net(model, mesh2d["dp"], model.layers)
    counts = []
    for net in (tp_only, model):
        with CommDebugMode() as comm:
            logits = net(batch[:, :-1])
            with loss_parallel():
                cross_entropy(logits, batch[:, 1:]).backward()
        counts.append(Counter(comm.get_comm_counts()))
    want = counts[0] + Counter(all_gather=3 + 2, reduce_scatter=3)
    assert_all_ranks(counts[1] == want, f"FSDP x TP {counts[1]} vs TP {counts[0]}")
