"""FSDP x TP on a 2x2 (dp, tp) mesh: tensor-parallel blocks, then fully_shard over dp."""
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard
from mpidtensor.fsdp import fully_shard
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from test_fsdp import TOL, assert_same_model, batch, make_net, train

WORLD = MPI.COMM_WORLD


def _tp_net(mesh2d):
    net = make_net()
    plan = {"fc1": RowwiseParallel(input_layouts=Replicate()), "fc2": RowwiseParallel(input_layouts=Replicate())}
    for block in net.blocks:
        parallelize_module(block, mesh2d["tp"], plan)
    return net


def test_fsdp_tp_matches_single_process(mesh2d):
    ref = make_net()
    (x, target), _ = batch(2, 0)
    ref_losses, _ = train(ref, x, target)
    net = _tp_net(mesh2d)
    for block in net.blocks:
        fully_shard(block, mesh=mesh2d["dp"])
    fully_shard(net, mesh=mesh2d["dp"])
    fc1 = net.blocks[0].fc1
    assert_all_ranks(fc1.weight.device_mesh == mesh2d and fc1.weight.placements == (Shard(0), Shard(1)),
                     f"{fc1.weight.placements}")
    assert_all_ranks(fc1.bias.placements == (Shard(0), Replicate()), f"{fc1.bias.placements}")
    assert_all_ranks(net.inp.weight.device_mesh == mesh2d["dp"] and net.inp.weight.placements == (Shard(0),))
    dp = mesh2d.get_group("dp")
    _, (local_x, local_t) = batch(2, dp.rank)
    losses, _ = train(net, local_x, local_t, comm=dp)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_fsdp_over_colwise_tp_is_refused(mesh2d):
    net = make_net()
    parallelize_module(net.blocks[0], mesh2d["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    before = dict(net.blocks[0].named_parameters())
    try:
        fully_shard(net.blocks[0], mesh=mesh2d["dp"])
        message = None
    except ValueError as exc:
        message = str(exc)
    assert_all_ranks(message is not None and "Shard(0)" in message, f"{message}")
    assert_all_ranks(all(p is before[n] for n, p in net.blocks[0].named_parameters()))
    assert_all_ranks(all(isinstance(p, DTensor) and p.device_mesh == mesh2d["tp"]
                         for n, p in before.items() if n.startswith("fc")))
