"""The rest of FSDP2's public API, tested by effect against one process (test_fsdp's Net,
whose odd sizes give uneven shards): offload policies, register_fsdp_forward_method,
reshard_after_forward as an int, and the FSDPModule settings frameworks call; bad input
raises on every rank and leaves the module as it was."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import CollectiveLog, assert_all_ranks, assert_close, raises_everywhere
from mpidtensor import init_device_mesh
from mpidtensor.fsdp import (
    CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard, register_fsdp_forward_method,
)
from mpidtensor.fsdp.group import ShardedState
from mpidtensor.tools.memory import memory_allocated
from test_fsdp import TOL, assert_same_model, batch, make_net, reference, shard_net, train

WORLD = MPI.COMM_WORLD


def _local_batch():
    return batch(WORLD.size, WORLD.rank)


def _ref_grads(microbatches: int = 1) -> dict[str, torch.Tensor]:
    """One process's gradients of the whole batch (summed over ``microbatches`` backwards)."""
    ref = make_net()
    (x, target), _ = _local_batch()
    for _ in range(microbatches):
        F.cross_entropy(ref(x), target).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def _backward(net, times: int = 1) -> None:
    _, (x, target) = _local_batch()
    for _ in range(times):
        F.cross_entropy(net(x), target).backward()


def _assert_grads(net, expected: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    for name, p in net.named_parameters():
        assert_all_ranks(p.grad is not None, f"{name} has no gradient")
        assert_close(p.grad.full_tensor(), expected[name] * scale, **TOL)


def _unchanged(module: nn.Module, params: dict) -> bool:
    return not isinstance(module, FSDPModule) and not hasattr(module, "_fsdp_state") and all(
        p is params[name] for name, p in module.named_parameters())


def test_post_accumulate_grad_hooks_step_the_optimizer_in_backward(mesh1d):
    """A sharded parameter's post-accumulate-grad hooks run once its reduced ``.grad`` is in,
    as torch's FSDP2 runs them: an optimizer per parameter stepped from them (torchtune's
    ``optimizer_in_bwd``) trains as one process's AdamW. Before, they never ran (no step)."""
    ref, ref_losses, _ = reference(steps=3)
    net = shard_net(make_net(), mesh=mesh1d)
    optims = {p: torch.optim.AdamW([p], lr=0.02, weight_decay=0.1, foreach=False) for p in net.parameters()}
    calls = []

    def step(param):
        calls.append(param)
        optims[param].step()
        optims[param].zero_grad()

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(step)
    _, (x, target) = _local_batch()
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(net(x), target)
        loss.backward()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size)
    assert_all_ranks(len(calls) == 3 * len(optims) and set(calls) == set(optims),
                     f"{len(calls)} hook calls for {len(optims)} parameters over 3 backwards")
    assert_close(torch.tensor(losses), ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


# --- offload ---------------------------------------------------------------------------------------
def test_cpu_offload_policy_on_cpu_changes_nothing(mesh1d):
    ref, ref_losses, _ = reference(steps=2)
    net = shard_net(make_net(), mesh=mesh1d, offload_policy=CPUOffloadPolicy())
    _, (x, target) = _local_batch()
    losses, _ = train(net, x, target, steps=2, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)
    assert_all_ranks(all(p._local_tensor.device.type == "cpu" and p.grad is None for p in net.parameters()))
    assert_all_ranks(isinstance(CPUOffloadPolicy(), OffloadPolicy) and CPUOffloadPolicy().pin_memory)


def test_offload_policy_bad_input_leaves_module_unchanged(mesh1d):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a parameter on a device the host policy cannot serve, without one
        weight = torch.empty(6, 4, device="cuda")
    module = nn.Linear(4, 6)
    module.weight = nn.Parameter(weight)
    del module.bias
    params = dict(module.named_parameters())
    raises_everywhere(ValueError, lambda: fully_shard(module, mesh=mesh1d, offload_policy=CPUOffloadPolicy()),
                      "CPUOffloadPolicy cannot serve parameters on ['cuda:0']")
    assert_all_ranks(_unchanged(module, params))
    plain = make_net()
    params = dict(plain.named_parameters())
    raises_everywhere(TypeError, lambda: fully_shard(plain, mesh=mesh1d, offload_policy="cpu"), "OffloadPolicy")
    assert_all_ranks(_unchanged(plain, params))


# --- register_fsdp_forward_method ----------------------------------------------------------------
class Scorer(nn.Module):
    """A method other than forward that reads the parameters and calls forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(5, 7)
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))

    def score(self, x):
        return self(x).softmax(-1) @ self.out.weight.sum(1, keepdim=True).T.expand(3, 3) + self.proj.bias.sum()


def test_register_fsdp_forward_method(mesh1d):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    expected = Scorer().score(x)
    model = Scorer()
    register_fsdp_forward_method(model, "score")  # not an FSDPModule yet: a no-op
    fully_shard(model, mesh=mesh1d)
    register_fsdp_forward_method(model, "score")
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = model.score(x)
        assert_close(got.detach(), expected.detach(), **TOL)
        resharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
        assert_all_ranks(resharded != grad, "the root reshards after forward only without gradients")
    got.sum().backward()
    model.reshard()
    raises_everywhere(ValueError, lambda: register_fsdp_forward_method(model, "generate"), "no method 'generate'")
    raises_everywhere(TypeError, lambda: register_fsdp_forward_method(model, "training"), "not a method")


# --- the group's ShardedState ------------------------------------------------------------------------
def test_sharded_state_follows_unshard_and_reshard(mesh1d):
    """``unshard(async_op=True)`` leaves the all-gather in flight (``UNSHARDING``, the sharded
    parameters still registered), ``wait()`` registers the unsharded ones (``UNSHARDED``);
    a second unshard changes nothing; ``reshard`` goes back to ``SHARDED`` from either, a
    prefetch nobody used included; forward then backward end ``SHARDED`` with the values right."""
    net = shard_net(make_net(), mesh=mesh1d)
    ref = make_net()
    group = net.blocks[0]._fsdp_state.group
    seen = [group.sharded_state]
    handle = net.blocks[0].unshard(async_op=True)
    seen.append((group.sharded_state, type(net.blocks[0].fc1.weight).__name__))
    handle.wait()
    net.blocks[0].unshard()
    seen.append((group.sharded_state, type(net.blocks[0].fc1.weight).__name__))
    assert_close(net.blocks[0].fc1.weight.detach(), ref.blocks[0].fc1.weight.detach())
    net.blocks[0].reshard()
    seen.append(group.sharded_state)
    net.blocks[0].unshard(async_op=True)
    net.blocks[0].reshard()
    seen.append((group.sharded_state, type(net.blocks[0].fc1.weight).__name__))
    _backward(net)
    seen.append(group.sharded_state)
    S = ShardedState
    want = [S.SHARDED, (S.UNSHARDING, "DTensor"), (S.UNSHARDED, "Parameter"), S.SHARDED, (S.SHARDED, "DTensor"),
            S.SHARDED]
    assert_all_ranks(seen == want, f"{seen}")
    _assert_grads(net, _ref_grads())


# --- reshard_after_forward=int ---------------------------------------------------------------------
def test_reshard_after_forward_int_matches_and_keeps_a_fraction():
    if WORLD.size != 4:
        pytest.skip("a non-trivial divisor of the shard group size needs 4 ranks")
    mesh = init_device_mesh("cpu", (4,))
    ref, ref_losses, _ = reference(steps=2)
    net = shard_net(make_net(), mesh=mesh, reshard_after_forward=2)
    _, (x, target) = _local_batch()
    losses, _ = train(net, x, target, steps=2, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)

    block = net.blocks[0]._fsdp_state.group
    before = memory_allocated()
    loss = F.cross_entropy(net(x), target)
    kept = memory_allocated() - before
    per_block = block.gather_nbytes * 2  # half of the 4 ranks' rows
    assert_all_ranks(block._kept is not None and block._kept.numel() == per_block, "kept rows")
    assert_all_ranks(isinstance(net.blocks[0].fc1.weight, torch.Tensor)
                     and block.sharded_state is ShardedState.SHARDED_POST_FORWARD)
    with CollectiveLog() as log:
        loss.backward()
    assert_all_ranks(block._kept is None and log.calls.count("all_gather") == 2, f"{log.calls}")
    assert_all_ranks(kept >= 2 * per_block, f"{kept} bytes kept after forward, expected >= {2 * per_block}")


def test_reshard_after_forward_bad_int_leaves_module_unchanged(mesh1d):
    net = make_net()
    params = dict(net.named_parameters())
    for bad in (0, WORLD.size + 1):
        raises_everywhere(ValueError, lambda: fully_shard(net, mesh=mesh1d, reshard_after_forward=bad),
                          "must divide the shard group size")
    raises_everywhere(TypeError, lambda: fully_shard(net, mesh=mesh1d, reshard_after_forward=1.5), "bool or an int")
    assert_all_ranks(_unchanged(net, params))


# --- gradient scaling, hooks and reductions ------------------------------------------------------------
def test_gradient_divide_factor(mesh1d):
    expected = _ref_grads()
    net = shard_net(make_net(), mesh=mesh1d)
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(2.0)
    _backward(net)
    _assert_grads(net, expected, WORLD.size / 2.0)  # the sum over ranks divided by 2

    net = shard_net(make_net(), mesh=mesh1d)
    with pytest.warns(FutureWarning):
        net.set_reduce_scatter_divide_factor(4.0)
    net.blocks[0].set_force_sum_reduction_for_comms(True)  # another split, the same value
    _backward(net)
    _assert_grads(net.blocks[1], {n: expected["blocks.1." + n] for n, _ in net.blocks[1].named_parameters()})
    _assert_grads(net.head, {n: expected["head." + n] * WORLD.size / 4.0 for n, _ in net.head.named_parameters()})


@pytest.mark.parametrize("force_sum", [False, True])
def test_all_reduce_hook(mesh1d, force_sum):
    expected = _ref_grads()
    net = shard_net(make_net(), mesh=mesh1d)
    seen = []

    def hook(reduced: torch.Tensor) -> None:
        seen.append(reduced.clone())
        reduced.mul_(3)

    net.blocks[0].set_all_reduce_hook(hook)
    net.blocks[0].set_force_sum_reduction_for_comms(force_sum)
    _backward(net)
    block = {n: expected["blocks.0." + n] for n, _ in net.blocks[0].named_parameters()}
    _assert_grads(net.blocks[0], block, 3.0)
    _assert_grads(net.head, {n: expected["head." + n] for n, _ in net.head.named_parameters()})
    weight = next(net.blocks[0].parameters())  # first in the group: at the start of the flat buffer
    n = weight._local_tensor.numel()
    ok = len(seen) == 1 and seen[0].dtype == torch.float32
    scale = WORLD.size if force_sum else 1  # force_sum: the hook sees the sum, undivided
    assert_all_ranks(ok, f"hook calls {len(seen)}")
    assert_close(seen[0][:n].view_as(weight._local_tensor), weight.grad._local_tensor / 3 * scale, **TOL)
    raises_everywhere(TypeError, lambda: net.set_all_reduce_hook("not callable"), "callable")


def test_requires_all_reduce_hsdp():
    if WORLD.size not in (2, 4):
        pytest.skip("HSDP on a 2x1 or 2x2 mesh")
    mesh = init_device_mesh("cpu", (2, WORLD.size // 2), mesh_dim_names=("replicate", "shard"))
    expected = _ref_grads(microbatches=2)
    net = shard_net(make_net(), mesh=mesh)
    net.set_requires_all_reduce(False)
    with CollectiveLog() as log:
        _backward(net)
    scatters = WORLD.size // 2 > 1  # (a one-rank shard group reduces nothing: no collective, as torch)
    assert_all_ranks("all_reduce" not in log.calls and ("reduce_scatter" in log.calls) == scatters, f"{log.calls}")
    assert_all_ranks(all(p.grad is None for p in net.parameters()), "gradients set without the all-reduce")
    net.set_requires_all_reduce(True)
    with CollectiveLog() as log:
        _backward(net)
    assert_all_ranks("all_reduce" in log.calls, f"{log.calls}")
    _assert_grads(net, expected)


def test_is_last_backward_leaves_the_reduction_running(mesh1d):
    expected = _ref_grads(microbatches=2)
    net = shard_net(make_net(), mesh=mesh1d)
    net.set_is_last_backward(False)
    _backward(net)
    root = net._fsdp_state
    pending = [s.group for s in root.states if s.group is not None and s.group.reducing]
    assert_all_ranks(len(pending) == 1, f"{len(pending)} reductions still running")
    net.set_is_last_backward(True)
    _backward(net)
    assert_all_ranks(not any(s.group.reducing for s in root.states if s.group is not None))
    _assert_grads(net, expected)


def test_unshard_in_backward_false_skips_the_gather():
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 3))
    net = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 3))
    net.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 11, (2 * WORLD.size, 5), generator=torch.Generator().manual_seed(5))
    ref(tokens).square().mean().backward()
    fully_shard(net[0])
    fully_shard(net)
    net[0].set_unshard_in_backward(False)
    net[0].set_reshard_after_forward(True)
    local = tokens[2 * WORLD.rank:2 * WORLD.rank + 2]
    out = net(local).square().mean()
    with CollectiveLog() as log:
        out.backward()
    assert_all_ranks(log.calls.count("all_gather") == 0, f"{log.calls}")
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        assert_close(p.grad.full_tensor(), r.grad, **TOL)


# --- custom collectives, events, reset -------------------------------------------------------------
class MPIAllGather:
    """torch's AllGather shape on mpi4py: blocking, so it returns None."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        group.Allgather(input_tensor.numpy(), output_tensor.numpy())


class MPIReduceScatter(MPIAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        assert op == "sum"
        self.calls += 1
        group.Reduce_scatter_block(input_tensor.numpy(), output_tensor.numpy(), MPI.SUM)


def test_custom_all_gather_and_reduce_scatter(mesh1d):
    ref, ref_losses, _ = reference(steps=2)
    net = shard_net(make_net(), mesh=mesh1d)
    gather, scatter = MPIAllGather(), MPIReduceScatter()
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    _, (x, target) = _local_batch()
    losses, _ = train(net, x, target, steps=2, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)
    if WORLD.size > 1:  # (a one-rank mesh runs no collective, custom or not, as torch)
        assert_all_ranks(gather.calls >= 2 * 4 and scatter.calls == 2 * 3, f"{gather.calls} {scatter.calls}")
    else:
        assert_all_ranks(gather.calls == scatter.calls == 0, f"{gather.calls} {scatter.calls}")
    raises_everywhere(TypeError, lambda: net.set_custom_all_gather(lambda *a: None), "allocate")


def test_post_optim_event_is_waited_then_dropped(mesh1d):
    class Event:
        waited = 0

        def synchronize(self):
            Event.waited += 1

    net = shard_net(make_net(), mesh=mesh1d)
    net.set_post_optim_event(Event())
    _backward(net)
    _backward(net)
    assert_all_ranks(Event.waited == 1 and net._fsdp_state.post_optim_event is None)
    raises_everywhere(TypeError, lambda: net.set_post_optim_event(object()), "synchronize")


def test_reset_iter_state_after_an_exception(mesh1d):
    ref, ref_losses, _ = reference(steps=2)
    net = shard_net(make_net(), mesh=mesh1d)
    _, (x, target) = _local_batch()
    fail = {"on": True}

    def boom(module, args):
        if fail["on"]:
            raise RuntimeError("boom")

    handle = net.head.register_forward_pre_hook(boom)
    raises_everywhere(RuntimeError, lambda: net(x), "boom")
    fail["on"] = False
    handle.remove()
    raises_everywhere(RuntimeError, lambda: net.blocks[0].reset_iter_state(), "root")
    net.reset_iter_state()
    assert_all_ranks(all(s.group.sharded_state is ShardedState.SHARDED for s in net._fsdp_state.states
                         if s.group is not None))
    losses, _ = train(net, x, target, steps=2, comm=WORLD)
    assert_close(losses, ref_losses, **TOL)
    assert_same_model(net, ref, **TOL)


# --- tensor subclasses without the extension -------------------------------------------------------
class Wrapped(torch.Tensor):
    """A wrapper subclass with no fsdp_pre/post_all_gather."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data):
        self.data_ = data

    def __tensor_flatten__(self):
        return ["data_"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.data_ if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return cls(out) if func is torch.ops.aten.detach.default else out


class HalfExtension(Wrapped):
    def fsdp_pre_all_gather(self, mesh):
        return (self.data_,), None


@pytest.mark.parametrize("cls, match", [(Wrapped, "needs fsdp_pre_all_gather and fsdp_post_all_gather"),
                                        (HalfExtension, "defines only one of")])
def test_subclass_without_extension_is_refused(mesh1d, cls, match):
    net = make_net()
    net.head.weight = nn.Parameter(cls(net.head.weight.detach().clone()))
    params = dict(net.named_parameters())
    raises_everywhere(TypeError, lambda: shard_net(net, mesh=mesh1d), match)
    assert_all_ranks(isinstance(net.blocks[0], FSDPModule), "the blocks were sharded first")
    raises_everywhere(TypeError, lambda: fully_shard(net.head, mesh=mesh1d), match)
    assert_all_ranks(_unchanged(net.head, {k[5:]: v for k, v in params.items() if k.startswith("head.")}))


def test_ignored_params_stay_as_they_are(mesh1d):
    """``ignored_params`` (torch's): the parameter is not sharded, not gathered, and its
    gradient is each rank's own (not reduced); the others train as usual."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    ignored = net[1].weight
    fully_shard(net, mesh=mesh1d, ignored_params={ignored})
    kinds = [type(p).__name__ for p in net.parameters()]
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(WORLD.rank))
    net(x).sum().backward()
    mine = ignored.grad.clone()
    expected = torch.autograd.grad(F.linear(F.linear(x, net[0].weight.full_tensor(), net[0].bias.full_tensor()),
                                            ignored, net[1].bias.full_tensor()).sum(), ignored)[0]
    assert_all_ranks(kinds == ["DTensor", "DTensor", "Parameter", "DTensor"] and ignored is net[1].weight
                     and torch.allclose(mine, expected, atol=1e-6), f"kinds {kinds}")
    raises_everywhere(TypeError, lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1d, ignored_params={torch.ones(2)}),
                      match="ignored_params")
