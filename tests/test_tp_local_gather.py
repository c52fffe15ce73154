"""The local Shard(d) -> Replicate all-gather of a sequence-parallel region (fast/gather.py):
PrepareModuleInput and a ColwiseParallel input read as Shard(1) gather with one all-gather
and hand the gradient back with one reduce-scatter (a Partial gradient), or locally (a
replicated one); values, gradients and layouts equal the public redistribute's and one
process's at 1-4 ranks (3 ranks: uneven sequence blocks) on the 1-D mesh and the 2x2 mesh's
"tp" dim; inputs the path does not take (non-contiguous, no autograd) stay correct."""
import copy

import pytest
import torch
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from mpidtensor.fast.gather import gather_shards
from test_parallel import tp_mesh  # noqa: F401 (a fixture)

TOL = dict(atol=1e-5, rtol=1e-5)
SEQ = 7  # uneven over 2-4 ranks


def _sharded(mesh, shape=(2, SEQ, 6), dim=1, seed=1):
    whole = global_tensor(shape, seed=seed)
    return whole, distribute_tensor(whole, mesh, [Shard(dim)]).requires_grad_()


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("grad_layout", [Partial(), Replicate(), Shard(0)])
def test_gather_matches_redistribute(tp_mesh, dim, grad_layout):
    """Forward value and layout as redistribute's; the gradient in the input's spec, for a
    Partial (reduce-scatter), a replicated (local block) and another (public path) layout."""
    whole, x = _sharded(tp_mesh, dim=dim)
    ref = x.detach().clone().requires_grad_()
    grad = distribute_tensor(global_tensor(tuple(whole.shape), seed=5), tp_mesh, [Replicate()])
    if isinstance(grad_layout, Partial):  # every rank holds a share: the sum is the whole
        grad = DTensor.from_local(grad.to_local() / tp_mesh.size(), tp_mesh, [Partial()], run_check=False)
    elif isinstance(grad_layout, Shard):
        grad = grad.redistribute(tp_mesh, [grad_layout])
    y = gather_shards(x)
    y_ref = ref.redistribute(tp_mesh, [Replicate()])
    assert_all_ranks(y._spec is y_ref._spec, f"{y._spec} vs {y_ref._spec}")
    assert_close(y.to_local(), whole, **TOL)
    y.backward(grad)
    y_ref.backward(grad)
    assert_all_ranks(x.grad._spec is x._spec, f"gradient spec {x.grad._spec}")
    assert_close(x.grad.full_tensor(), ref.grad.full_tensor(), **TOL)
    assert_all_ranks(x.grad.to_local().is_contiguous(), "a contiguous local gradient")


def test_gather_is_one_collective_each_way(tp_mesh):
    whole, x = _sharded(tp_mesh)
    with CommDebugMode() as comm:
        y = gather_shards(x)
        y.backward(DTensor.from_local(torch.ones_like(whole), tp_mesh, [Partial()], run_check=False))
    expected = {"all_gather": 1, "reduce_scatter": 1} if tp_mesh.size() > 1 else {}
    counts = {k: v for k, v in comm.get_comm_counts().items() if v}
    assert_all_ranks(counts == expected, str(counts))
    assert_close(x.grad.full_tensor(), torch.full_like(whole, float(tp_mesh.size())), **TOL)


def test_ranks_without_a_block(tp_mesh):
    """A sequence of 2 over 3-4 ranks: some ranks hold no position; gather and gradient still exact."""
    whole, x = _sharded(tp_mesh, shape=(2, 2, 3))
    y = gather_shards(x)
    y.backward(DTensor.from_local(torch.ones_like(whole), tp_mesh, [Partial()], run_check=False))
    assert_close(y.to_local(), whole, **TOL)
    assert_close(x.grad.full_tensor(), torch.full_like(whole, float(tp_mesh.size())), **TOL)


def test_paths_not_taken(tp_mesh):
    """A non-contiguous input and a 2-D mesh go to the public path (None); without autograd
    the gather still runs, with no graph."""
    whole, x = _sharded(tp_mesh)
    t = distribute_tensor(whole.transpose(0, 2).contiguous(), tp_mesh, [Shard(1)]).transpose(0, 2)
    assert_all_ranks(gather_shards(t) is None, "a non-contiguous spec takes the public path")
    with torch.no_grad():
        y = gather_shards(x)
    assert_all_ranks(y is not None and not y.requires_grad, "no autograd node without grad mode")
    assert_close(y.to_local(), whole, **TOL)


class Mixer(nn.Module):
    """Three column-parallel projections of one input (their input gradients are summed as
    Partial DTensors), then a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.o = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x):
        return self.o(self.a(x) * self.b(x).sigmoid() + self.c(x))


class Block(nn.Module):
    """An SP region: the sequence-sharded input is gathered for the mixer, whose row-parallel
    output is reduce-scattered back; a residual add on the sequence-sharded stream."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inner = Mixer()

    def forward(self, x):
        return x + self.inner(x)


def _block_plan():
    return {"inner": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "inner.a": ColwiseParallel(), "inner.b": ColwiseParallel(), "inner.c": ColwiseParallel(),
            "inner.o": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def test_sequence_parallel_block(tp_mesh):
    whole = global_tensor((2, SEQ, 6), seed=4)
    ref = Block()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, _block_plan())
    x_ref = whole.clone().requires_grad_()
    x = distribute_tensor(whole, tp_mesh, [Shard(1)]).requires_grad_()
    weight = global_tensor((2, SEQ, 6), seed=6)
    with CommDebugMode() as comm:
        out = model(x)
        (out.full_tensor() * weight).sum().backward()
    (ref(x_ref) * weight).sum().backward()
    assert_all_ranks(out.placements == (Shard(1),), repr(out.placements))
    assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(params[name].grad.full_tensor(), p.grad, **TOL)
    if tp_mesh.size() > 1:  # the region's gather and its backward reduce-scatter, once each
        counts = comm.get_comm_counts()
        assert_all_ranks(counts["reduce_scatter"] == 2, f"forward output + backward input gradient: {counts}")


def test_colwise_sharded_input(tp_mesh):
    """ColwiseParallel(input_layouts=Shard(1)) on a DTensor input: one Function all-gathers it,
    multiplies, and reduce-scatters the input gradient back."""
    whole = global_tensor((2, SEQ, 6), seed=4)
    ref = nn.Linear(6, 10)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, ColwiseParallel(input_layouts=Shard(1),
                                                                            use_local_output=False))
    x_ref = whole.clone().requires_grad_()
    x = distribute_tensor(whole, tp_mesh, [Shard(1)]).requires_grad_()
    weight = global_tensor((2, SEQ, 10), seed=6)
    with CommDebugMode() as comm:
        out = model(x)
        (out * DTensor.from_local(weight, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(2)])).sum().backward()
    (ref(x_ref) * weight).sum().backward()
    assert_all_ranks(out.placements == (Shard(2),), repr(out.placements))
    if tp_mesh.size() > 1:  # the Function's all-gather and its backward's reduce-scatter, nothing else
        counts = {k: v for k, v in comm.get_comm_counts().items() if v}
        assert_all_ranks(counts.get("all_gather") == 1 and counts.get("reduce_scatter") == 1, str(counts))
    assert_close(out.full_tensor(), ref(whole).detach(), **TOL)
    assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
    assert_close(model.weight.grad.full_tensor(), ref.weight.grad, **TOL)
