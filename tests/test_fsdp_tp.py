"""FSDP x TP on a 2x2 (dp, tp) mesh: tensor-parallel modules, then fully_shard over dp.

FSDP shards dim 0, as torch's FSDP2: ``[_StridedShard(0, sf=2), Shard(0)]`` for a
ColwiseParallel weight or bias (dim 0 of its TP block), ``[Shard(0), Shard(1)]`` for a
RowwiseParallel weight. The ``dim1`` layout (``shard_placement_fn`` choosing dim 1 for a
TP ``Shard(0)`` weight, what FSDP gives by default where the strided layout cannot
describe the rows: uneven, 3+ data-parallel ranks) is trained as well: its groups are
gathered into rows and copied out. Training matches one process on the whole batch, and
every step runs TP's collectives plus exactly FSDP's own.
"""
import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard, _StridedShard, init_device_mesh
from mpidtensor.comm import placed
from mpidtensor.debug import CommDebugMode
from mpidtensor.fast import registry
from mpidtensor.fsdp import clip_grad_norm_, fully_shard
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from test_fsdp import TOL, assert_same_model, batch, make_net, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import build_model, cross_entropy, parallelize_llama  # noqa: E402
from test_llama_tp import PARAM_ATOL, config, tokens  # noqa: E402

WORLD = MPI.COMM_WORLD
NET = dict(dim=7, hidden=10)  # dim 7: FSDP's Shard(1) of a Colwise weight is uneven (4 + 3)
STRIDED = _StridedShard(0, split_factor=2)


def dim1(param):
    """``shard_placement_fn`` of the ``dim1`` layout: dim 1 for a weight TP shards on dim 0."""
    return Shard(1) if isinstance(param, DTensor) and param.ndim == 2 and param.placements[-1] == Shard(0) else None


LAYOUTS = {"strided": None, "dim1": dim1}


def tp_net(mesh, colwise: bool = True):
    """The test MLP with each block's fc1/fc2 tensor-parallel over ``mesh["tp"]``."""
    net = make_net(**NET)
    first = ColwiseParallel() if colwise else RowwiseParallel(input_layouts=Replicate())
    second = RowwiseParallel() if colwise else RowwiseParallel(input_layouts=Replicate())
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], {"fc1": first, "fc2": second})
    return net


def fsdp_net(net, mesh, blocks, layout="strided"):
    """``fully_shard`` each of ``blocks``, then the whole net, over ``mesh``, in ``layout``."""
    for block in blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=LAYOUTS[layout])
    return fully_shard(net, mesh=mesh, shard_placement_fn=LAYOUTS[layout])


def _placements(net):
    return {name: tuple(p.placements) for name, p in net.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_colwise_rowwise_mlp_matches_single_process(mesh2d, layout):
    ref = make_net(**NET)
    (x, target), _ = batch(2, 0)
    ref_losses, _ = train(ref, x, target)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks, layout)
    placements = _placements(net)
    expected = {"fc1.weight": (STRIDED if layout == "strided" else Shard(1), Shard(0)), "fc1.bias": (STRIDED, Shard(0)),
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


def test_strided_layout_placed_by_piece_matches_single_process(mesh2d, monkeypatch):
    """The strided layout's groups are dim-0 pieces: with ``placed.BY_PIECE_MIN`` at 0 the
    data-parallel pairs gather each parameter by one ``Iallgatherv`` straight into place
    (``fsdp.placed_gather``; at the test's sizes they gather into rows otherwise), and
    training still equals one process."""
    monkeypatch.setattr(placed, "BY_PIECE_MIN", 0)
    ref = make_net(**NET)
    (x, target), _ = batch(2, 0)
    ref_losses, _ = train(ref, x, target)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks)
    before = {p.name: p.hits for p in registry.paths()}
    dp = mesh2d.get_group("dp")
    _, (local_x, local_t) = batch(2, dp.rank)
    losses, _ = train(net, local_x, local_t, comm=dp)
    ran = {p.name: p.hits - before[p.name] for p in registry.paths()}["fsdp.placed_gather"]
    assert_all_ranks(ran > 0, f"placed all-gathers: {ran}")
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


@pytest.mark.parametrize("hidden", [13, 12])
def test_three_dp_ranks_uneven_fallback_and_strided(hidden):
    """On a (dp 3, tp 2) mesh (6 ranks: run by hand, ``mpiexec -n 6``): 13 rows (7 + 6 over
    tp, then chunked over 3 dp ranks) are where ``_StridedShard`` cannot describe FSDP's
    rows, so fc1 keeps the earlier layout (weight on dim 1, bias replicated over dp); 12
    rows are strided. Both train like one process, and FSDP's clip norm equals torch's."""
    if WORLD.size != 6:
        pytest.skip("a (3, 2) mesh: 6 ranks")
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
    net_sizes = dict(dim=7, hidden=hidden)
    ref = make_net(**net_sizes)
    (x, target), _ = batch(3, 0)
    ref_losses, _ = train(ref, x, target)
    net = make_net(**net_sizes)
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fsdp_net(net, mesh["dp"], net.blocks)
    fc1 = net.blocks[0].fc1
    want = ((Shard(1), Shard(0)), (Replicate(), Shard(0))) if hidden % 6 else ((STRIDED, Shard(0)),) * 2
    assert_all_ranks((fc1.weight.placements, fc1.bias.placements) == want, f"{fc1.weight.placements}")
    dp = mesh.get_group("dp")
    _, (local_x, local_t) = batch(3, dp.rank)
    losses, _ = train(net, local_x, local_t, comm=dp)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)
    F.cross_entropy(ref(x), target).backward()
    F.cross_entropy(net(local_x), local_t).backward()
    assert_close(clip_grad_norm_(net.parameters(), 1e9), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), **TOL)


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mlp_collective_counts(mesh2d, layout):
    """Per step, on top of TP's own collectives (measured on the TP-only model): one
    all-gather per group in forward, one more per non-root group in backward, one
    reduce-scatter per group (the Colwise biases are sharded too: no all-reduce)."""
    dp = mesh2d.get_group("dp")
    _, (x, target) = batch(2, dp.rank)
    tp_only = tp_net(mesh2d)
    net = tp_net(mesh2d)
    fsdp_net(net, mesh2d["dp"], net.blocks, layout)
    tp_opt = torch.optim.AdamW(tp_only.parameters(), lr=0.01)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        tp_fwd, tp_bwd, _ = _step_counts(tp_only, x, target, tp_opt)
        fwd, bwd, step = _step_counts(net, x, target, opt)
        groups = 3
        assert_all_ranks(fwd == tp_fwd + Counter(all_gather=groups), f"forward {fwd} vs TP {tp_fwd}")
        want = tp_bwd + Counter(all_gather=groups - 1, reduce_scatter=groups)
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_fsdp_tp_matches_single_process(mesh2d, layout):
    cfg = config(2)
    ref = build_model(cfg, seed=3)
    model = parallelize_llama(copy.deepcopy(ref), mesh2d["tp"])
    fsdp_net(model, mesh2d["dp"], model.layers, layout)
    placements = _placements(model)
    colwise = (STRIDED if layout == "strided" else Shard(1), Shard(0))
    assert_all_ranks(placements["layers.0.attention.wq.weight"] == colwise, f"{placements}")
    assert_all_ranks(placements["layers.0.feed_forward.w2.weight"] == (Shard(0), Shard(1)), f"{placements}")
    assert_all_ranks(placements["tok_embeddings.weight"] == colwise, f"{placements}")
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
