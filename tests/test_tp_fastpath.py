"""The TP local paths' per-call shortcuts: ``direct_apply`` (``Function.apply`` without its
Python layer) and the prepared reduce-scatter / all-gather of a sequence-parallel row Linear
and vocab-parallel embedding (``shard_route``): the same values, bit for bit, as
``Function.apply`` and the general collectives, uneven blocks included (3 ranks)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import CollectiveLog, assert_all_ranks
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.tensor.layout import chunk_sizes
from mpidtensor.comm import collectives
from mpidtensor.parallel import RowwiseParallel, parallelize_module
from mpidtensor.fast.functions import direct_apply
from test_parallel import tp_mesh  # noqa: F401 (a fixture)

WORLD = MPI.COMM_WORLD


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _WithSetup(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("compiling_checked", [False, True])
def test_direct_apply_matches_apply(compiling_checked):
    scale = direct_apply(_Scale, compiling_checked=compiling_checked)
    x = torch.randn(5, requires_grad=True)
    y = scale(x, 3.0)
    assert type(y.grad_fn) is _Scale._backward_cls
    y.sum().backward()
    assert torch.equal(y, _Scale.apply(x, 3.0)) and torch.equal(x.grad, torch.full((5,), 3.0))


@pytest.mark.parametrize("compiling_checked", [False, True])
def test_direct_apply_under_functorch_takes_public_apply(compiling_checked):
    """Under a functorch transform the public ``apply`` runs: its error for a Function
    without ``setup_context``, as before (whether or not the caller ruled out compiling)."""
    scale = direct_apply(_Scale, compiling_checked=compiling_checked)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: scale(t, 2.0).sum())(torch.randn(4))


@pytest.mark.parametrize("compiling_checked", [False, True])
def test_direct_apply_takes_a_dead_functorch_wrapper_as_apply_does(compiling_checked):
    """A tensor leaked from a finished ``torch.func.grad`` (a dead wrapper, whose Python type
    is plain ``torch.Tensor``: the only type ``direct_apply`` looks at) gives what the public
    ``apply`` gives, and no functorch wrapper."""
    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or t.sum())(torch.arange(4.0))
    dead = leaked[0]
    assert type(dead) is torch.Tensor and torch._C._functorch.is_functorch_wrapped_tensor(dead)
    got, want = direct_apply(_Scale)(dead, 2.0), _Scale.apply(dead, 2.0)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(got)
    assert torch.equal(got, want) and torch.equal(got, torch.arange(4.0) * 2)


def test_direct_apply_without_plain_tensors_matches_apply(tp_mesh):
    """Arguments with no plain ``torch.Tensor`` (a DTensor, a number) go to the C++ ``apply``
    as they are (no unwrap list): the same output, node and gradient as ``Function.apply``."""
    x = distribute_tensor(torch.arange(6.0), tp_mesh, [Shard(0)]).requires_grad_()
    y, want = direct_apply(_Scale, compiling_checked=True)(x, 3.0), _Scale.apply(x, 3.0)
    assert_all_ranks(type(y.grad_fn) is _Scale._backward_cls and torch.equal(y.full_tensor(), want.full_tensor()),
                     "output or node differs from Function.apply")
    y.sum().backward()
    assert_all_ranks(torch.equal(x.grad.full_tensor(), torch.full((6,), 3.0)), "gradient differs")

def _cube_class():
    """A fresh Function (x ** 3, a backward that is itself differentiable)."""
    class _Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, grad):
            x, = ctx.saved_tensors
            return grad * 3 * x * x
    return _Cube


def test_direct_backward_runs_the_backward_as_torch_does():
    """``direct_apply`` makes the node class's ``apply`` the Function's ``backward`` (the
    engine's entry, torch's ``BackwardCFunction.apply`` chose it per call): gradients,
    a direct ``grad_fn.apply`` and a double backward (``create_graph=True``) are bit-equal
    to the same Function left as torch made it."""
    fast_cls, plain_cls = _cube_class(), _cube_class()
    cube = direct_apply(fast_cls)
    assert fast_cls._backward_cls.__dict__["apply"] is fast_cls.backward
    assert "apply" not in plain_cls._backward_cls.__dict__
    x = torch.randn(7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [cube(xs[0]), plain_cls.apply(xs[1])]
    g = torch.randn(7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(ys[0].grad_fn.apply(g), ys[1].grad_fn.apply(g))
    firsts = [torch.autograd.grad(y, t, g, create_graph=True)[0] for y, t in zip(ys, xs)]
    seconds = [torch.autograd.grad(f.sum(), t)[0] for f, t in zip(firsts, xs)]
    assert torch.equal(firsts[0], firsts[1]) and torch.equal(seconds[0], seconds[1])
    assert torch.allclose(seconds[0], 6 * x * g)


def test_direct_backward_leaves_what_torch_decides_per_call():
    """A Function with both ``backward`` and ``vjp`` keeps torch's node ``apply`` (and its
    error); so does one that boxes its gradients."""
    class _Both(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

        @staticmethod
        def vjp(ctx, grad):
            return grad * 2

    class _Boxed(torch.autograd.Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grads):
            return grads[0] * 2

    both, boxed = direct_apply(_Both), direct_apply(_Boxed)
    assert "apply" not in _Both._backward_cls.__dict__ and "apply" not in _Boxed._backward_cls.__dict__
    with pytest.raises(RuntimeError, match="both 'backward' and 'vjp'"):
        both(torch.ones(2, requires_grad=True)).sum().backward()
    x = torch.ones(3, requires_grad=True)
    boxed(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_direct_apply_refuses_setup_context():
    with pytest.raises(TypeError, match="setup_context"):
        direct_apply(_WithSetup)


def _row_linear(tp_mesh, wanted):
    torch.manual_seed(2)
    ref = nn.Linear(6, 5, bias=False)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh,
                               RowwiseParallel(input_layouts=Shard(-1), output_layouts=wanted, use_local_output=False))
    return ref, model


def test_sequence_parallel_row_linear_bit_identical_to_general_collectives(tp_mesh):
    """7 tokens (uneven at 2 and 3 ranks): the output is the general reduce-scatter of the
    partial product, its input gradient uses the general all-gather of the output gradient."""
    ref, model = _row_linear(tp_mesh, Shard(1))
    comm = tp_mesh.comm_for((0,))
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(3))
    xs = distribute_tensor(x, tp_mesh, [Shard(2)]).requires_grad_()
    with CollectiveLog() as comms:
        out = model(xs)
    if comm.size > 1:
        assert_all_ranks(comms.calls == ["reduce_scatter"], str(comms.calls))
    w = model.weight._local_tensor
    partial = F.linear(xs._local_tensor, w)
    sizes = chunk_sizes(7, comm.size)
    want = collectives.reduce_scatter(partial, comm, "sum", dim=1, sizes=sizes) if comm.size > 1 else partial
    assert_all_ranks(isinstance(out, DTensor) and out.placements == (Shard(1),), repr(out))
    assert_all_ranks(torch.equal(out._local_tensor, want), "forward differs from the general reduce-scatter")
    gy = torch.randn(out._local_tensor.shape, generator=torch.Generator().manual_seed(4 + comm.rank))
    out.backward(DTensor(gy, out._spec))
    whole = collectives.all_gather(gy, comm, dim=1, sizes=sizes) if comm.size > 1 else gy
    assert_all_ranks(torch.equal(xs.grad._local_tensor, whole.matmul(w)), "input gradient differs")


def test_row_linear_replicated_output_still_all_reduces(tp_mesh):
    ref, model = _row_linear(tp_mesh, Replicate())
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(3))
    xs = distribute_tensor(x, tp_mesh, [Shard(2)])
    with CollectiveLog() as comms:
        out = model(xs)
    if tp_mesh.size() > 1:
        assert_all_ranks(comms.calls == ["all_reduce"], str(comms.calls))
    assert_all_ranks(torch.allclose(out.full_tensor(), ref(x), atol=1e-5), "replicated output differs")
