"""runtime.progress (MPI progress for in-flight collectives: off, MPI_Test from FSDP's hooks,
a progress thread) and FSDP's all-gather into the unsharded parameters: same training as
one process in every mode (the reduce-scatter is blocking in ``off``, non-blocking in the
others), on uneven shards and a shard dim > 0, nothing left in flight, a clean exit with
the thread; the one-copy gather and one-``cat`` gradient pack of evenly split groups."""
import pytest
import torch
from mpi4py import MPI

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import Shard
from mpidtensor.fsdp import fully_shard
from mpidtensor.runtime import progress
from subjob import run_job
from test_fsdp import TOL, assert_same_model, batch, make_net, reference, shard_net, train

WORLD = MPI.COMM_WORLD


@pytest.fixture
def mode(request):
    before = progress.mode()
    progress.set_mode(request.param)
    yield request.param
    progress.set_mode(before)


def last_dim(param):
    return Shard(param.ndim - 1)


@pytest.mark.parametrize("mode", progress.MODES, indirect=True)
@pytest.mark.parametrize("placement_fn", [None, last_dim], ids=["dim0", "last_dim"])
def test_training_matches_single_process(request, mode, placement_fn):
    """At 3 ranks every size is uneven (5 and 3 rows); a 2x2 mesh at 4 ranks is HSDP."""
    mesh = request.getfixturevalue("mesh2d" if WORLD.size == 4 else "mesh1d")
    ref, ref_losses, _ = reference()
    net = shard_net(make_net(), mesh=mesh, shard_placement_fn=placement_fn)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)
    assert_all_ranks(progress.in_flight() == 0, f"{progress.in_flight()} collectives left in flight")


def test_gather_writes_the_parameters_in_place(mesh1d):
    """One all-gather per group (a copy on one rank), into the group's flat buffer: the unsharded
    parameters are views of it with the right values; reshard frees it, and the next
    gather refills the same views."""
    net = shard_net(make_net(), mesh=mesh1d)
    ref = make_net()
    group = net._fsdp_state.group
    for _ in range(2):
        with CollectiveLog() as log:
            net.unshard()
        flat = group.unsharded_flat
        inside = all(p.unsharded.data_ptr() - flat.data_ptr() == p.unsharded_offset for p in group.gathered)
        gathers = ["all_gather"] if mesh1d.size() > 1 else []  # one rank: a copy, no collective (as torch)
        assert_all_ranks(log.calls == gathers and inside, f"{log.calls}, views of the buffer: {inside}")
        assert_close(net.head.weight.detach(), ref.head.weight.detach())
        assert_close(net.inp.bias.detach(), ref.inp.bias.detach())
        net.reshard()
        assert_all_ranks(flat.untyped_storage().nbytes() == 0, "reshard must free the flat buffer")


def test_bad_mode():
    raises_everywhere(ValueError, lambda: progress.set_mode("async"), match="progress mode")


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
def test_thread_mode_exits_cleanly(tmp_path):
    """A job that trains with the progress thread running ends on its own (the thread is
    stopped before MPI finalizes) with exit code 0."""
    script = """
        import torch
        import mpidtensor as md
        from mpidtensor.fsdp import fully_shard
        from mpidtensor.runtime import progress
        mesh = md.init_device_mesh("cpu", (2,))
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        for _ in range(3):
            net(torch.randn(4, 8)).sum().backward()
        assert progress.mode() == "thread" and progress.in_flight() == 0
        print("trained")
    """
    result = run_job(script, tmp_path, env={"MPIDTENSOR_PROGRESS": "thread"}, timeout=180)
    assert_all_ranks(result.returncode == 0 and result.output.count("trained") == 2, result.output[-2000:])


def test_one_parameter_groups_match_single_process(mesh1d):
    """Groups of one bias-free Linear(8, 8): with even shards (1, 2, 4 ranks) the
    all-gather writes the parameter itself, at 3 ranks it is copied out of a buffer."""
    def stack():
        torch.manual_seed(3)
        return torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(3)))
    ref, net = stack(), stack()
    for layer in net:
        fully_shard(layer, mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    _train_alongside(ref, net, seed=5)


def _train_alongside(ref, net, seed: int, each_step=None) -> None:
    """Three AdamW steps of ``ref`` on the whole batch and of the FSDP ``net`` on this rank's
    rows, then every parameter compared; ``each_step(log)`` sees each FSDP step's collectives."""
    x = global_tensor((4 * WORLD.size, 8), seed=seed)
    mine = x[4 * WORLD.rank:4 * (WORLD.rank + 1)]
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=0.02), torch.optim.AdamW(net.parameters(), lr=0.02)
    for _ in range(3):
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with CollectiveLog() as log:
            net(mine).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if each_step is not None:
            each_step(log)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.full_tensor(), q.detach(), **TOL)


@pytest.mark.parametrize("mode", ["off", "hooks"], indirect=True)
def test_even_and_uneven_groups_match_single_process(mesh1d, mode):
    """``Linear(8, 48)``: 48 rows split evenly at 1-4 ranks, 16-byte pieces, so its group
    is copied out of the gathered rows in one op and its gradients packed with one ``cat``;
    ``Linear(48, 8)`` has 8 rows (uneven at 3 ranks, 8-byte bias pieces at 4): per-parameter
    copies where that is so. Blocking (``off``) and non-blocking reduce-scatters alike."""
    def stack():
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    ref, net = stack(), stack()
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    scatters = 2 if mesh1d.size() > 1 else 0  # one rank: nothing to reduce, no collective (as torch)
    _train_alongside(ref, net, seed=6, each_step=lambda log: assert_all_ranks(
        log.calls.count("reduce_scatter") == scatters and progress.in_flight() == 0, f"{log.calls}"))
    world = WORLD.size
    first, last = net[0]._fsdp_state.group.split_sizes, net[2]._fsdp_state.group.split_sizes
    assert_all_ranks(first == [48 // world * 8 * 4, 48 // world * 4] and (last is not None) == (world <= 2),
                     f"one-copy layouts: {first}, {last}")
