"""fully_shard: meta-device initialisation, state dicts, and bad input."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Shard, distribute_tensor, init_device_mesh
from mpidtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from test_fsdp import Net, TOL, assert_same_model, batch, make_net, shard_net, train

WORLD = MPI.COMM_WORLD


def _reset(net: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _init(mesh, *, meta: bool) -> Net:
    if meta:
        with torch.device("meta"):
            net = Net()
    else:
        net = make_net(seed=123)
    shard_net(net, mesh=mesh)
    if meta:
        net.to_empty(device="cpu")
    _reset(net, seed=5)
    return net


def test_meta_init_matches_eager_init_on_any_mesh(mesh1d):
    one_rank = init_device_mesh("cpu", (1,), comm=MPI.COMM_SELF)
    meta, eager, single = _init(mesh1d, meta=True), _init(mesh1d, meta=False), _init(one_rank, meta=True)
    for name, p in meta.named_parameters():
        assert_all_ranks(p.device.type == "cpu" and p.placements == (Shard(0),), f"{name}: {p}")
    single_params = {n: p.full_tensor() for n, p in single.named_parameters()}
    assert_same_model(eager, meta, **TOL)
    for name, p in meta.named_parameters():
        assert_close(p.full_tensor(), single_params[name], atol=0, rtol=0)
    _, (x, target) = batch(WORLD.size, WORLD.rank)
    losses, _ = train(meta, x, target, steps=2, comm=WORLD)
    eager_losses, _ = train(eager, x, target, steps=2, comm=WORLD)
    assert_close(losses, eager_losses, **TOL)
    assert_same_model(eager, meta, **TOL)


def test_state_dict_round_trip(mesh1d):
    net = shard_net(make_net(), mesh=mesh1d)
    ref = make_net()
    state = net.state_dict()
    assert_all_ranks(sorted(state) == sorted(ref.state_dict()), f"{sorted(state)}")
    for key, value in state.items():
        assert_all_ranks(isinstance(value, DTensor) and value.placements == (Shard(0),), key)
    other = shard_net(make_net(seed=9), mesh=mesh1d)
    other.load_state_dict(state)
    assert_same_model(other, ref, atol=0, rtol=0)


def _trains_like_one_process(net: nn.Module, ref: nn.Module) -> None:
    """Three steps of ``net`` (sharded, this rank's batch) and ``ref`` (one process, the whole
    batch): the same losses and parameters."""
    (x, target), (local_x, local_t) = batch(WORLD.size, WORLD.rank)
    ref_losses, _ = train(ref, x, target, steps=3)
    losses, _ = train(net, local_x, local_t, steps=3, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


@pytest.mark.parametrize("assign", [False, True])
def test_load_full_state_dict_distributed(mesh1d, assign):
    """Full tensors distributed with distribute_tensor load (in place or assigned), and
    training then matches one process."""
    ref = make_net()
    net = shard_net(make_net(seed=9), mesh=mesh1d)
    full = {k: distribute_tensor(v, mesh1d, [Shard(0)]) for k, v in ref.state_dict().items()}
    net.load_state_dict(full, assign=assign)
    assert_same_model(net, ref, atol=0, rtol=0)
    _trains_like_one_process(net, ref)


def test_meta_parameters_beside_real_ones(mesh1d):
    """A module whose parameters are partly on meta (deferred init, as transformers leaves
    those its loader fills later) shards as torch's does: the real ones keep their values,
    a meta one assigned afterwards is adopted, and training equals one process."""
    ref = make_net()
    net = make_net()
    net.head.weight = nn.Parameter(torch.empty(3, 6, device="meta"))
    shard_net(net, mesh=mesh1d)
    for name, p in net.named_parameters():
        if name != "head.weight":
            assert_close(p.full_tensor(), dict(ref.named_parameters())[name].detach(), atol=0, rtol=0)
    net.head.weight = nn.Parameter(distribute_tensor(ref.head.weight.detach(), mesh1d, [Shard(0)]))
    assert_same_model(net, ref, atol=0, rtol=0)
    _trains_like_one_process(net, ref)


def test_plain_parameter_meeting_dtensors(mesh1d):
    """A plain parameter that meets a DTensor in its module's forward (taken as ``Replicate``
    there, as transformers' TP x FSDP leaves some) gets a DTensor gradient; FSDP reduces its
    whole value (it stopped with an AttributeError), and training equals one process."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    net = fully_shard(copy.deepcopy(ref), mesh=mesh1d)
    x = global_tensor((5, 4), seed=3)
    losses = {}
    for name, model, inputs in (("ref", ref, x), ("fsdp", net, distribute_tensor(x, mesh1d, [Shard(0)]))):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses[name] = []
        for _ in range(3):
            out = model(inputs)
            loss = (out.full_tensor() if isinstance(out, DTensor) else out).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.detach())
    assert_close(torch.stack(losses["fsdp"]), torch.stack(losses["ref"]), **TOL)
    for name, p in net.named_parameters():
        assert_close(p.full_tensor(), dict(ref.named_parameters())[name].detach(), **TOL)


def _raises(error: type, fn) -> str | None:
    try:
        fn()
    except error as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001  (reported as a failure below)
        return f"wrong error {type(exc).__name__}: {exc}"
    return None


BAD_INPUTS = ["meshes", "mesh_ndim", "mp_dtype", "mp_type", "reduce_dtype"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_everywhere_and_changes_nothing(mesh1d, case):
    net = make_net()
    error = TypeError if case.startswith(("mp", "reduce")) else ValueError
    if case == "meshes":
        other = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("other",))
        net.inp.weight = nn.Parameter(distribute_tensor(net.inp.weight.detach(), mesh1d, [Shard(0)]))
        net.head.weight = nn.Parameter(distribute_tensor(net.head.weight.detach(), other, [Shard(0)]))
    calls = {
        "meshes": lambda: fully_shard(net, mesh=mesh1d),
        "mesh_ndim": lambda: fully_shard(net, mesh=init_device_mesh("cpu", (1, 1, WORLD.size))),
        "mp_dtype": lambda: fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8)),
        "reduce_dtype": lambda: fully_shard(net, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int32)),
        "mp_type": lambda: fully_shard(net, mp_policy=torch.bfloat16),
    }
    before = dict(net.named_parameters())
    message = _raises(error, calls[case])
    assert_all_ranks(message is not None and not message.startswith("wrong"), f"{case}: {message}")
    after = dict(net.named_parameters())
    assert_all_ranks(all(after[n] is p for n, p in before.items()) and not isinstance(net, FSDPModule),
                     f"{case}: the module was changed")
    assert_all_ranks(not hasattr(net, "_fsdp_state"), f"{case}: state left behind")


def test_fully_shard_twice_raises(mesh1d):
    net = fully_shard(make_net(), mesh=mesh1d)
    before = dict(net.named_parameters())
    message = _raises(ValueError, lambda: fully_shard(net, mesh=mesh1d))
    assert_all_ranks(message is not None and "already" in message, f"{message}")
    assert_all_ranks(all(p is before[n] for n, p in net.named_parameters()))


def test_zero_grad_and_no_grad_forward(mesh1d):
    """An eval forward reshards everything, the root included; state_dict stays sharded."""
    net = shard_net(make_net(), mesh=mesh1d)
    ref = make_net()
    x = batch(WORLD.size, 0)[0][0]
    with torch.no_grad():
        out = net(x)
    assert_close(out, ref(x).detach(), **TOL)
    assert_all_ranks(all(isinstance(v, DTensor) for v in net.state_dict().values()))
    F.cross_entropy(net(x), batch(WORLD.size, 0)[0][1]).backward()
    net.zero_grad()
    assert_all_ranks(all(p.grad is None for p in net.parameters()))
