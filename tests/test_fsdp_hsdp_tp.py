"""HSDP x TP on a 3-D (dp_replicate, dp_shard, tp) mesh: tensor-parallel modules on
``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp_replicate", "dp_shard"]``.

Parameters end up ``[Replicate(), Shard(0), <tp placement>]`` on the 3-D mesh, the
``Shard(0)`` a ``_StridedShard(0, sf=tp)`` where TP shards dim 0 too (as torch's FSDP2);
gradients are reduce-scattered over dp_shard and all-reduced
over dp_replicate. Training matches one process on the whole batch. Mesh shapes per
world size: 1 (1,1,1); 2 (1,2,1), (1,1,2); 3 (1,3,1); 4 (2,1,2), (1,2,2), (2,2,1);
8 (2,2,2) (run by hand: ``mpiexec -n 8``).
"""
import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, _StridedShard, init_device_mesh
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import fully_shard
from mpidtensor.parallel import loss_parallel
from test_fsdp import TOL, assert_same_model, batch, make_net, train
from test_fsdp_tp import NET, fsdp_net, tp_net

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import build_model, cross_entropy, parallelize_llama  # noqa: E402
from test_llama_tp import PARAM_ATOL, config  # noqa: E402

WORLD = MPI.COMM_WORLD
NAMES = ("dp_replicate", "dp_shard", "tp")
SHAPES = {1: [(1, 1, 1)], 2: [(1, 2, 1), (1, 1, 2)], 3: [(1, 3, 1)],
          4: [(2, 1, 2), (1, 2, 2), (2, 2, 1)], 8: [(2, 2, 2)]}
ALL_SHAPES = sorted({s for shapes in SHAPES.values() for s in shapes})
_meshes: dict = {}


def mesh_of(shape: tuple[int, int, int]):
    """The 3-D mesh of ``shape`` (made once); skips the test unless it fits the world size."""
    if shape not in SHAPES.get(WORLD.size, []):
        pytest.skip(f"mesh {shape} needs {shape[0] * shape[1] * shape[2]} ranks")
    if shape not in _meshes:
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    return _meshes[shape]


@pytest.fixture(params=ALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def mesh3d(request):
    return mesh_of(request.param)


def _dim0(mesh3d):
    """FSDP's placement of a block TP shards on dim 0 as well."""
    return _StridedShard(0, split_factor=mesh3d.size(2)) if mesh3d.size(2) > 1 else Shard(0)


def _dp(mesh3d):
    """The HSDP mesh and its flat communicator (the data-parallel rank picks the batch slice)."""
    dp = mesh3d["dp_replicate", "dp_shard"]
    return dp, dp.comm_for((0, 1))


def test_mlp_placements_and_training(mesh3d):
    ref = make_net(**NET)
    (x, target), _ = batch(mesh3d.size(0) * mesh3d.size(1), 0)
    ref_losses, _ = train(ref, x, target)
    dp, comm = _dp(mesh3d)
    net = tp_net(mesh3d)
    fsdp_net(net, dp, net.blocks)
    strided = _dim0(mesh3d)
    expected = {"fc1.weight": strided, "fc1.bias": strided, "fc2.weight": Shard(0), "fc2.bias": Shard(0)}
    tp_side = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1), "fc2.bias": Replicate()}
    for block in net.blocks:
        for name, own in expected.items():
            p = block.get_parameter(name)
            want = (Replicate(), own, tp_side[name])
            assert_all_ranks(p.device_mesh == mesh3d and p.placements == want, f"{name}: {p.placements}")
    assert_all_ranks(net.inp.weight.device_mesh == dp and net.inp.weight.placements == (Replicate(), Shard(0)))
    _, (local_x, local_t) = batch(comm.size, comm.rank)
    losses, _ = train(net, local_x, local_t, comm=comm)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def _counts(net, x, target):
    with CommDebugMode() as comm:
        F.cross_entropy(net(x), target).backward()
    return Counter(comm.get_comm_counts())


def test_mlp_collective_counts(mesh3d):
    """One step: TP's collectives plus FSDP's: an all-gather per group in forward and per
    non-root group in backward, a reduce-scatter (over dp_shard) and an all-reduce (over
    dp_replicate) per group; none over a mesh dim (or data-parallel mesh) of one rank."""
    dp, comm = _dp(mesh3d)
    _, (x, target) = batch(comm.size, comm.rank)
    tp_only = _counts(tp_net(mesh3d), x, target)
    net = tp_net(mesh3d)
    fsdp_net(net, dp, net.blocks)
    groups = 3
    shard, replicate = mesh3d.size(1) > 1, mesh3d.size(0) > 1  # a one-rank dim runs no collective (as torch)
    want = tp_only + Counter(all_gather=(2 * groups - 1) * shard, reduce_scatter=groups * shard,
                             all_reduce=groups * replicate)
    for _ in range(2):
        got = _counts(net, x, target)
        assert_all_ranks(got == want, f"HSDP x TP {got} vs TP {tp_only}")
        net.zero_grad()


def test_llama_matches_single_process(mesh3d):
    cfg = config(mesh3d.size(2))
    ref = build_model(cfg, seed=3)
    model = parallelize_llama(copy.deepcopy(ref), mesh3d["tp"])
    dp, comm = _dp(mesh3d)
    fsdp_net(model, dp, model.layers)
    wq = model.layers[0].attention.wq.weight
    assert_all_ranks(wq.device_mesh == mesh3d and wq.placements == (Replicate(), _dim0(mesh3d), Shard(0)),
                     f"{wq.placements}")
    rows = max(2, comm.size)  # one or more whole sequences per data-parallel rank
    data = torch.randint(0, cfg.vocab_size, (rows, 13), generator=torch.Generator().manual_seed(5))
    per = rows // comm.size
    ref_opt, ref_losses = torch.optim.AdamW(ref.parameters(), lr=1e-2), []
    for _ in range(3):
        loss = cross_entropy(ref(data[:, :-1]), data[:, 1:])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    local = data[comm.rank * per:(comm.rank + 1) * per]
    for _ in range(3):
        logits = model(local[:, :-1])
        with loss_parallel():
            loss = cross_entropy(logits, local[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(comm.allreduce(loss.full_tensor().item()) / comm.size)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    differ = {}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert_all_ranks(isinstance(p, DTensor) and p.device_mesh == mesh3d, f"{name}: {p}")
        full = p.full_tensor()
        if not torch.allclose(full, p_ref.detach(), atol=PARAM_ATOL, rtol=1e-5):
            differ[name] = (full - p_ref.detach()).abs().max().item()
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


def test_mesh_not_complementary_raises(mesh3d):
    """FSDP's mesh must meet each TP group once: the whole mesh flattened (it holds TP's
    ranks too) is refused on every rank, and the model is left as it was. (A mesh that
    leaves a dim out, dp_shard alone, composes with TP over the ranks it spans, as torch's
    does for pipeline stages: tests/test_fsdp_213.py.)"""
    if mesh3d.size("tp") == 1:
        pytest.skip("TP over one rank composes with any mesh")
    net = tp_net(mesh3d)
    before = {name: p for name, p in net.named_parameters()}
    raises_everywhere(ValueError, lambda: fully_shard(net.blocks[0], mesh=mesh3d._flatten("all")), "compose")
    assert_all_ranks(all(p is before[n] for n, p in net.named_parameters()), "model changed")
