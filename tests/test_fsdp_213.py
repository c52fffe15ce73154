"""torch 2.13's FSDP2 additions and what torchtitan needs of FSDP and the mesh.

``DataParallelMeshDims`` (FSDP over the data-parallel dims of a full SPMD mesh, with and
without TP on its other dims, HSDP through replicate dims), ``fully_shard`` of a list of
modules as one group, ``DeviceMesh._unflatten`` and meshes from two unflattens of one
world mesh composing FSDP x TP (torchtitan's pattern), the gradient divide factor
(torchtitan turns FSDP's division off), and the five setters and ``share_comm_ctx``. Each
trains against one process from the same seed (losses, then every parameter after AdamW).
"""
from collections import Counter

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, _StridedShard, distribute_module, distribute_tensor, init_device_mesh
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import DataParallelMeshDims, FSDPModule, fully_shard, share_comm_ctx
from mpidtensor.mesh.relations import joint_mesh
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from test_fsdp import TOL, assert_same_model, batch, make_net, reference, train

WORLD = MPI.COMM_WORLD
NET = dict(dim=7, hidden=10)  # dim 7: uneven shards
TP_PLAN = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}  # colwise fc1, rowwise fc2


def spmd_net(mesh, tp: str | None = None, **kwargs):
    """The test net as DTensors on the full ``mesh``: replicated, except the blocks' fc1/fc2
    tensor-parallel over the dim named ``tp``; the output a plain tensor again."""
    net = make_net(**kwargs)

    def partition(name, module, device_mesh):
        for key, param in list(module._parameters.items()):
            placements = [Replicate()] * device_mesh.ndim
            plan = TP_PLAN.get(f"{name.rsplit('.', 1)[-1]}.{key}")
            if tp is not None and plan is not None and name.startswith("blocks"):
                placements[device_mesh.mesh_dim_names.index(tp)] = plan
            module.register_parameter(key, nn.Parameter(distribute_tensor(param.detach(), device_mesh, placements)))

    def output(module, out, device_mesh):
        return out.redistribute(device_mesh, [Replicate()] * device_mesh.ndim).to_local()

    return distribute_module(net, mesh, partition, output_fn=output)


def shard_all(net, **kwargs):
    for block in net.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(net, **kwargs)


def _train_on(net, ref_losses, ref, dp_comm):
    _, (x, target) = batch(dp_comm.size, dp_comm.rank)
    losses, _ = train(net, x, target, steps=3, comm=dp_comm)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def _reference(dp_size: int, **kwargs):
    ref = make_net(**kwargs)
    (x, target), _ = batch(dp_size, 0)
    losses, _ = train(ref, x, target, steps=3)
    return ref, losses


# --- DataParallelMeshDims -----------------------------------------------------------------------
def test_dp_mesh_dims_fsdp_x_tp_2x2(mesh2d):
    """FSDP over "dp" of the full ("dp", "tp") mesh whose parameters TP already shards on
    "tp": the sharded parameters stay on the full mesh, FSDP's placement on dim 0 (strided
    where TP shards dim 0, as torch's), and training equals one process."""
    ref, ref_losses = _reference(2, **NET)
    net = shard_all(spmd_net(mesh2d, "tp", **NET), mesh=mesh2d, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    fc1, fc2 = net.blocks[0].fc1, net.blocks[0].fc2
    strided = _StridedShard(0, split_factor=2)
    assert_all_ranks(fc1.weight.device_mesh is mesh2d and fc1.weight.placements == (strided, Shard(0))
                     and fc1.bias.placements == (strided, Shard(0))
                     and fc2.weight.placements == (Shard(0), Shard(1))
                     and net.inp.weight.placements == (Shard(0), Replicate()), f"{fc1.weight.placements}")
    _train_on(net, ref_losses, ref, mesh2d.get_group("dp"))


def test_dp_mesh_dims_fsdp_only(mesh1d):
    """FSDP-only over a named 1-D SPMD mesh at any world size: Shard(0) on that mesh."""
    mesh = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("dp",))
    ref, ref_losses, _ = reference(steps=3)
    net = shard_all(spmd_net(mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert_all_ranks(all(p.device_mesh is mesh and p.placements == (Shard(0),) for p in net.parameters()))
    _train_on(net, ref_losses, ref, WORLD)


@pytest.mark.parametrize("dims", ["hsdp", "flat_shard", "replicate_only"])
def test_dp_mesh_dims_hsdp_2x2(dims):
    """HSDP through ``replicate``, two shard dims flattened into one, and replication alone
    (DDP) on a (2, 2) SPMD mesh without TP: each equals one process on the whole batch."""
    if WORLD.size != 4:
        pytest.skip("a 2x2 mesh")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    choice = {"hsdp": DataParallelMeshDims(shard="b", replicate="a"),
              "flat_shard": DataParallelMeshDims(shard=("a", "b")),
              "replicate_only": DataParallelMeshDims(replicate=("a", "b"))}[dims]
    ref, ref_losses, _ = reference(steps=3)
    net = shard_all(spmd_net(mesh), mesh=mesh, dp_mesh_dims=choice)
    want = {"hsdp": (Replicate(), Shard(0)), "flat_shard": (Shard(0),), "replicate_only": (Replicate(), Shard(0))}
    assert_all_ranks(net.inp.weight.placements == want[dims], f"{net.inp.weight.placements}")
    _train_on(net, ref_losses, ref, WORLD)


def test_dp_mesh_dims_hsdp_x_tp_3d():
    """HSDP x TP on a (2, 1, 2) ("dp_replicate", "fsdp", "tp") SPMD mesh: the sharded
    parameters stay on it, ``[Replicate(), _StridedShard(0, sf=2), <tp>]``; training equals one process."""
    if WORLD.size != 4:
        pytest.skip("a (2, 1, 2) mesh")
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "fsdp", "tp"))
    ref, ref_losses = _reference(2, **NET)
    net = shard_all(spmd_net(mesh, "tp", **NET), mesh=mesh,
                    dp_mesh_dims=DataParallelMeshDims(shard="fsdp", replicate="dp_replicate"))
    fc1 = net.blocks[0].fc1
    assert_all_ranks(fc1.weight.device_mesh is mesh
                     and fc1.weight.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0)),
                     f"{fc1.weight.placements}")
    _train_on(net, ref_losses, ref, mesh["dp_replicate", "fsdp"]._flatten().get_group())


def test_dp_mesh_dims_bad_input_every_rank(mesh1d):
    """A dim the mesh lacks, a dim TP uses, a plain parameter, a mesh without names: the
    same ValueError on every rank, before anything changes."""
    n = WORLD.size
    mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("dp", "tp"))
    raises_everywhere(ValueError, lambda: fully_shard(spmd_net(mesh), mesh=mesh,
                                                      dp_mesh_dims=DataParallelMeshDims(shard="fsdp")), "not dims")
    tp_on_dp = spmd_net(mesh, "dp")  # TP's placements on the dim named as data-parallel
    raises_everywhere(ValueError, lambda: fully_shard(tp_on_dp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(
        shard="dp")), "a dim tensor parallelism uses")
    raises_everywhere(ValueError, lambda: fully_shard(make_net(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(
        shard="dp")), "must be a DTensor")
    raises_everywhere(ValueError, lambda: fully_shard(spmd_net(mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(
        shard="dp", replicate="dp")), "twice")
    raises_everywhere(ValueError, lambda: fully_shard(make_net(), mesh=mesh1d, dp_mesh_dims=DataParallelMeshDims(
        shard="dp")), "mesh_dim_names")
    raises_everywhere(ValueError, lambda: DataParallelMeshDims(), "At least one")
    assert_all_ranks(not isinstance(tp_on_dp, FSDPModule), "the module was left as it was")


# --- fully_shard of a list ----------------------------------------------------------------------
def test_list_is_one_group(mesh1d):
    """``fully_shard([net.inp, net.head])`` (torchtitan's ``[norm, output]``): one group,
    gathered once at the first of them and resharded after the last; one all-gather and
    one reduce-scatter per step for the pair; training equals one process."""
    ref, ref_losses, _ = reference(steps=3)
    net = make_net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh1d)
    pair = fully_shard([net.inp, net.head], mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    assert_all_ranks(pair == [net.inp, net.head] and isinstance(net.head, FSDPModule)
                     and net.inp._fsdp_state is net.head._fsdp_state, "one state for the pair")
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    with CommDebugMode() as comm:
        torch.nn.functional.cross_entropy(net(x), target).backward()
    counts = Counter(comm.get_comm_counts())
    groups = len(net.blocks) + 1
    many = WORLD.size > 1  # (a one-rank mesh runs no collective, as torch)
    assert_all_ranks(counts["all_gather"] == 2 * groups * many and counts["reduce_scatter"] == groups * many,
                     f"{counts}")
    for p in net.parameters():
        p.grad = None
    net2 = make_net()
    for block in net2.blocks:
        fully_shard(block, mesh=mesh1d)
    fully_shard([net2.inp, net2.head], mesh=mesh1d)
    fully_shard(net2, mesh=mesh1d)
    _train_on(net2, ref_losses, ref, WORLD)


class Body(nn.Module):
    """The test net's forward without its head (the head runs outside the root, per chunk
    of the loss, as chunked-loss recipes call it)."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_list_partly_run_by_the_root(mesh1d):
    """``fully_shard([net.inp, net.head])`` where the root's forward runs only ``inp`` and
    the head runs afterwards on two chunks: the group is completed at the root's end and
    gathered again for the head; training equals one process."""
    ref, ref_losses, _ = reference(steps=3)
    net = make_net()
    net.__class__ = type("BodyNet", (Body, type(net)), {})
    for block in net.blocks:
        fully_shard(block, mesh=mesh1d)
    fully_shard([net.inp, net.head], mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)

    def forward(x):
        h = net(x)
        return torch.cat([net.head(chunk) for chunk in h.chunk(2)])

    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(net, x, target, steps=3, comm=WORLD, forward=forward)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


def test_list_root_and_bad_lists(mesh1d):
    """A list as the root is refused at the first forward (as torch); an empty list, a
    repeated module or a sharded one, at the call; all on every rank."""
    raises_everywhere(ValueError, lambda: fully_shard([], mesh=mesh1d), "at least one")
    net = make_net()
    raises_everywhere(ValueError, lambda: fully_shard([net.inp, net.inp], mesh=mesh1d), "twice")
    fully_shard([net.inp, net.head], mesh=mesh1d)
    raises_everywhere(ValueError, lambda: fully_shard([net.head], mesh=mesh1d), "already applied")
    _, (x, _) = batch(WORLD.size, WORLD.rank)
    raises_everywhere(RuntimeError, lambda: net.inp(x), "one module, not a list")


# --- _unflatten and meshes of one root ----------------------------------------------------------
def _factor_pairs(n):
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def test_unflatten_coords_groups_and_slices(mesh1d):
    """``world._unflatten(0, (a, b), names)`` is ``init_device_mesh((a, b))``: coordinates,
    groups and slices; unflattening a dim of a 2-D mesh too; bad sizes raise everywhere."""
    n, rank = WORLD.size, WORLD.rank
    world = init_device_mesh("cpu", (n,), mesh_dim_names=("world",))
    for a, b in _factor_pairs(n):
        mesh = world._unflatten(0, (a, b), ("x", "y"), backend_override={"x": "fake"})
        same = init_device_mesh("cpu", (a, b), mesh_dim_names=("x", "y"))
        assert_all_ranks(mesh.mesh.tolist() == torch.arange(n).reshape(a, b).tolist()
                         and mesh.get_coordinate() == list(divmod(rank, b)), f"{mesh} {mesh.get_coordinate()}")
        assert_all_ranks(mesh.get_group("x").allgather(rank) == [rank % b + b * i for i in range(a)]
                         and mesh.get_group("y").allgather(rank) == [rank // b * b + j for j in range(b)])
        assert_all_ranks(mesh["x"] == same["x"] and mesh["y"] == same["y"] and mesh == same, repr(mesh))
        deeper = mesh._unflatten("y", (1, b), ("y1", "y2"))
        assert_all_ranks(deeper.shape == (a, 1, b) and deeper.mesh_dim_names == ("x", "y1", "y2")
                         and deeper["y2"].mesh.tolist() == mesh["y"].mesh.tolist() and deeper["x"] == mesh["x"], repr(deeper))
    raises_everywhere(ValueError, lambda: world._unflatten(0, (n + 1,), ("z",)), "product")
    raises_everywhere(ValueError, lambda: world._unflatten(0, (n, 1), ("z",)), "name each")
    raises_everywhere(ValueError, lambda: world._unflatten(0, (n,), ("z",), backend_override={"q": "fake"}), "not among")


def _titan_meshes(batch_size, cp, fsdp_size, rep, tp):
    """torchtitan's ``ParallelDims.build_mesh``: two unflattens of one world mesh."""
    world = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("world",))
    loading = world._unflatten(0, (1, batch_size, cp, tp), ("pp", "batch", "cp", "tp"))
    dense = world._unflatten(0, (1, rep, fsdp_size, tp), ("pp", "dp_replicate", "fsdp", "tp"))
    return loading, dense


def _titan_cases():
    n = WORLD.size
    cases = [(n, 1, n, 1, 1)]  # TP of size 1 (degenerate) at any size: FSDP over all
    if n == 4:
        cases += [(2, 1, 2, 1, 2), (2, 1, 1, 2, 2)]  # FSDP x TP, HSDP x TP
    return cases


@pytest.mark.parametrize("case", range(3))
def test_two_unflattens_compose_fsdp_x_tp(case):
    """TP on one unflatten's "tp", FSDP (or HSDP) on another's "fsdp" ("dp_replicate"):
    fully_shard accepts them, the joint mesh's groups are theirs, training equals one
    process."""
    cases = _titan_cases()
    if case >= len(cases):
        pytest.skip("this layout needs 4 ranks")
    batch_size, cp, fsdp_size, rep, tp = cases[case]
    loading, dense = _titan_meshes(batch_size, cp, fsdp_size, rep, tp)
    dp_mesh = dense["dp_replicate", "fsdp"] if rep > 1 else dense["fsdp"]
    joint, dp_dims, tp_dims = joint_mesh(dp_mesh, loading["tp"])
    rank = WORLD.rank
    assert_all_ranks(joint.get_group("tp").allgather(rank) == loading["tp"].get_group().allgather(rank)
                     and joint.get_group("fsdp").allgather(rank) == dense["fsdp"].get_group().allgather(rank))
    ref, ref_losses = _reference(batch_size, **NET)
    net = make_net(**NET)
    for block in net.blocks:
        parallelize_module(block, loading["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    shard_all(net, mesh=dp_mesh)
    assert_all_ranks(net.blocks[0].fc1.weight.placements[-1] == Shard(0) and net.inp.weight.ndim == 2)
    _train_on(net, ref_losses, ref, loading["batch"].get_group())


def test_pipeline_stages_build_joint_meshes_apart_2x2():
    """With a "pp" dim of 2, each stage's joint FSDP x TP mesh is built by that stage's
    ranks alone: stage 1 builds its own only after stage 0 has finished (a world-wide
    collective would hang here)."""
    if WORLD.size != 4:
        pytest.skip("2 stages of 2 ranks")
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    loading = world._unflatten(0, (2, 2, 1, 1), ("pp", "batch", "cp", "tp"))
    dense = world._unflatten(0, (2, 1, 2, 1), ("pp", "dp_replicate", "fsdp", "tp"))
    fsdp, tp = dense["fsdp"], loading["tp"]  # slicing is collective over the sliced mesh: all ranks
    stage = WORLD.rank // 2
    if stage == 1:
        WORLD.recv(source=WORLD.rank - 2)
    joint, _, _ = joint_mesh(fsdp, tp)
    if stage == 0:
        WORLD.send("built", dest=WORLD.rank + 2)
    mine = [2 * stage, 2 * stage + 1]
    assert_all_ranks(joint.mesh.flatten().tolist() == mine and joint.get_group("fsdp").allgather(WORLD.rank) == mine,
                     repr(joint))


# --- gradient division (PREMUL_SUM) and the setters ----------------------------------------------
def _one_backward(net, setup=lambda net: None):
    setup(net)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    torch.nn.functional.cross_entropy(net(x), target).backward()
    return {name: p.grad.full_tensor() for name, p in net.named_parameters()}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_divide_factor_scales_the_sum(mesh1d, reduce_dtype):
    """torchtitan's ``set_gradient_divide_factor(1.0)``: the gradients are the unscaled sum,
    the default's times the data-parallel size; any factor f gives sum / f; forcing sum
    reductions moves the division, not the result (bfloat16 reduced in float32)."""
    from mpidtensor.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    n = WORLD.size
    base = _one_backward(shard_all(make_net(), mesh=mesh1d, mp_policy=mp))

    def every(method, *args):
        return lambda net: [getattr(m, method)(*args) for m in net.modules() if isinstance(m, FSDPModule)]

    unscaled = _one_backward(shard_all(make_net(), mesh=mesh1d, mp_policy=mp), every("set_gradient_divide_factor", 1.0))
    halved = _one_backward(shard_all(make_net(), mesh=mesh1d, mp_policy=mp), every("set_gradient_divide_factor", 2.0))
    forced = _one_backward(shard_all(make_net(), mesh=mesh1d, mp_policy=mp),
                           every("set_force_sum_reduction_for_comms", True))
    tol = TOL if reduce_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, g in base.items():
        assert_close(unscaled[name], g * n, **tol)
        assert_close(halved[name], g * n / 2, **tol)
        assert_close(forced[name], g, **tol)


def test_premul_sum_scales_before_the_hook(mesh1d):
    """A factor other than the shard group's size is torch's ``PREMUL_SUM(1 / f)``: the
    terms are scaled before the sum, so the all-reduce hook already sees ``sum / f``."""
    net = shard_all(make_net(), mesh=mesh1d)
    seen = []
    net.blocks[0].set_gradient_divide_factor(3.0)
    net.blocks[0].set_all_reduce_hook(lambda reduced: seen.append(reduced.clone()))
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    torch.nn.functional.cross_entropy(net(x), target).backward()
    weight = next(net.blocks[0].parameters())
    n = weight._local_tensor.numel()
    assert_all_ranks(len(seen) == 1, f"{len(seen)} hook calls")
    assert_close(seen[0][:n].view_as(weight._local_tensor), weight.grad._local_tensor, **TOL)


def test_setters_are_stored_and_harmless(mesh1d):
    """The five torch 2.13 setters and ``share_comm_ctx``: each setting is stored, training
    with them equals training without, and bad values raise as torch's do."""
    ref, ref_losses, _ = reference(steps=3)
    net = shard_all(make_net(), mesh=mesh1d)
    other = shard_all(make_net(seed=1), mesh=mesh1d)
    net.set_allocate_memory_from_process_group_for_comm(True)
    net.set_symm_mem_for_comm()
    net.set_reduce_scatter_max_input_buffers(2)
    net.set_reduce_scatter_unused_params(True)
    net.set_separate_reduce_scatter_group(True)
    share_comm_ctx([net, other])
    groups = [m._fsdp_state.group for m in net.modules() if isinstance(m, FSDPModule) and m._fsdp_state.group]
    assert_all_ranks(all(g.reduce_scatter_max_input_buffers == 2 and g.reduce_scatter_unused_params
                         and g.reduce_scatter_comm is not g.info.shard_comm for g in groups), "stored recursively")
    assert_all_ranks(net._fsdp_state.group.allocate_from_process_group and net._fsdp_state.group.symm_mem_backend == "NCCL"
                     and other._fsdp_state.comm_ctx is net._fsdp_state.comm_ctx, "stored on the module")
    raises_everywhere(ValueError, lambda: net.set_reduce_scatter_max_input_buffers(0), "positive")
    raises_everywhere(TypeError, lambda: net.set_reduce_scatter_max_input_buffers(True), "int")
    raises_everywhere(ValueError, lambda: net.set_symm_mem_for_comm("NVSHMEM"), "NCCL")
    raises_everywhere(ValueError, lambda: share_comm_ctx([net, make_net()]), "FSDPModules")
    _train_on(net, ref_losses, ref, WORLD)


class MaybeBias(nn.Linear):
    """A Linear whose bias this rank's forward may leave out (``use_bias``)."""

    use_bias = True

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias if self.use_bias else None)


def _maybe_bias_net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), MaybeBias(6, 3))


def test_unused_params_send_zeros(mesh1d):
    """A bias that forward uses on even ranks only: with
    ``set_reduce_scatter_unused_params(True)`` every rank reduce-scatters it (zeros where
    unused), and its gradient is the sum over the ranks that used it over the data-parallel
    size, as torch's."""
    ref, net = _maybe_bias_net(), _maybe_bias_net()
    fully_shard(net[1], mesh=mesh1d)
    fully_shard(net, mesh=mesh1d)
    net.set_reduce_scatter_unused_params(True)
    net[1].use_bias = WORLD.rank % 2 == 0
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    torch.nn.functional.cross_entropy(net(x), target).backward()
    expected = torch.zeros(3)
    for r in range(0, WORLD.size, 2):
        _, (rx, rt) = batch(WORLD.size, r)
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(rx), rt).backward()
        expected += ref[1].bias.grad / WORLD.size
    assert_close(net[1].bias.grad.full_tensor(), expected, **TOL)
