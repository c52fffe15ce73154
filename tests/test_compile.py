"""torch.compile over DTensors: compiled results and gradients equal eager ones; FSDP
blocks compiled one by one train like one process.

Dynamo traces DTensor ops (the wrapper-subclass protocol); the collectives that a
sharding plan runs inside dispatch become ``mpidtensor::*`` custom ops in the graph;
``redistribute``/``from_local``/``full_tensor`` are graph breaks. Backends "eager"
and "aot_eager" (as torch's DTensor tests); inductor works too but compiles for
minutes on two cores, so it is left out. Compile times are printed by rank 0 (-s).
"""
import copy
import pickle
import time

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch._dynamo.utils import counters

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD = MPI.COMM_WORLD
TOL = dict(atol=1e-5, rtol=1e-5)
BACKENDS = ["eager", "aot_eager"]

pytestmark = [
    pytest.mark.skipif(WORLD.size > 2, reason="Dynamo compiles slowly on oversubscribed cores; run at 1 and 2 ranks"),
    pytest.mark.quick_at(2),  # compiling dominates; one rank adds no communication to trace
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled_first_call(fn, *args):
    """``fn(*args)`` and the seconds the first (compiling) call took, slowest rank's."""
    start = time.perf_counter()
    out = fn(*args)
    seconds = WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return out, seconds


def report(what: str, seconds: float) -> None:
    if WORLD.rank == 0:
        print(f"\n[compile] {what}: first call {seconds:.2f} s at {WORLD.size} ranks")


class Block(nn.Module):
    """A 2-layer MLP: fc1 column-parallel, fc2 row-parallel under tensor parallelism."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_block_compiled_equals_eager(mesh1d, backend):
    torch.manual_seed(0)
    ref = Block(6, 10)  # 10 hidden units: uneven shards at 3 and 4 ranks
    eager = parallelize_module(copy.deepcopy(ref), mesh1d, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    model = parallelize_module(copy.deepcopy(ref), mesh1d, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    compiled = torch.compile(model, backend=backend)
    x = global_tensor((5, 6))
    weight = global_tensor((5, 6), seed=7)

    out, seconds = compiled_first_call(compiled, x)
    report(f"TP block fwd, backend={backend}", seconds)
    out_eager = eager(x)
    assert_close(out, out_eager, **TOL)
    assert_close(out, ref(x), **TOL)
    (out * weight).sum().backward()
    (out_eager * weight).sum().backward()
    for (name, p), p_eager in zip(model.named_parameters(), eager.parameters()):
        assert_all_ranks(isinstance(p.grad, DTensor) and p.grad.placements == p_eager.grad.placements,
                         f"{name}: gradient placements differ")
        assert_close(p.grad.full_tensor(), p_eager.grad.full_tensor(), **TOL)

    again = compiled(x)  # a second call runs the cached graphs: no recompilation
    assert_close(again, out_eager, **TOL)
    assert_all_ranks(counters["stats"]["unique_graphs"] >= 1, "nothing was compiled")


def mlp(x, w1, w2):
    """Over DTensors, with the collectives inside dispatch: x S(0) @ w1.T (w1 S(0)) needs w1
    gathered; h @ w2.T with w2 S(1) leaves a Partial sum, settled by ``.sum()``'s rule."""
    h = torch.relu(x @ w1.T)
    return (h @ w2.T * 2).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_function_over_dtensors_one_graph(mesh1d, backend):
    xs = [global_tensor((8, 6), seed=1), global_tensor((4, 6), seed=2), global_tensor((6, 4), seed=3)]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)]]
    inputs = [distribute_tensor(t, mesh1d, p).requires_grad_() for t, p in zip(xs, placements)]
    twins = [distribute_tensor(t, mesh1d, p).requires_grad_() for t, p in zip(xs, placements)]

    out, seconds = compiled_first_call(torch.compile(mlp, backend=backend), *inputs)
    report(f"mlp over DTensors fwd, backend={backend}", seconds)
    expected = mlp(*twins)
    assert_close(out.full_tensor(), expected.full_tensor(), **TOL)
    ref = [t.clone().requires_grad_() for t in xs]
    assert_close(out.full_tensor(), mlp(*ref), **TOL)
    out.backward()
    expected.backward()
    mlp(*ref).backward()
    for a, b, r in zip(inputs, twins, ref):
        assert_close(a.grad.full_tensor(), b.grad.full_tensor(), **TOL)
        assert_close(a.grad.full_tensor(), r.grad, **TOL)
    # The collectives are traced as custom ops: one graph, no graph break.
    assert_all_ranks(counters["stats"]["unique_graphs"] == 1, f"graphs: {dict(counters['stats'])}")
    assert_all_ranks(not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_redistribute_is_a_graph_break(mesh1d, backend):
    def f(x, w):
        y = torch.relu(x.redistribute(mesh1d, [Replicate()]) @ w.T)
        return y.redistribute(mesh1d, [Replicate()]).to_local().sum()

    x = global_tensor((7, 5), seed=4)
    w = global_tensor((6, 5), seed=5)
    dx, dw = distribute_tensor(x, mesh1d, [Shard(0)]), distribute_tensor(w, mesh1d, [Shard(0)])
    dx.requires_grad_()
    dw.requires_grad_()
    out, seconds = compiled_first_call(torch.compile(f, backend=backend), dx, dw)
    report(f"redistribute + to_local, backend={backend}", seconds)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.relu(xr @ wr.T).sum()
    assert_close(out, expected, **TOL)
    out.backward()
    expected.backward()
    assert_close(dx.grad.full_tensor(), xr.grad, **TOL)
    assert_close(dw.grad.full_tensor(), wr.grad, **TOL)


def test_spec_copies_are_the_spec(mesh1d):
    """Dynamo guards on a deep copy of the spec compared by ``==`` (identity for interned specs)."""
    spec = distribute_tensor(global_tensor((4, 3)), mesh1d, [Shard(0)])._spec
    rebuild, args = spec.__reduce__()
    same = copy.copy(spec) is spec and copy.deepcopy(spec) is spec and rebuild(*args) is spec
    assert_all_ranks(same, "a copy of an interned spec is a different object")
    back = pickle.loads(pickle.dumps(spec))  # the mesh pickles as a description (mesh.pickling)
    assert_all_ranks(back is spec, f"an unpickled spec is another object: {back}")


def test_fsdp_blocks_compiled_train_like_one_process(mesh1d):
    """``fully_shard`` per block, then ``block.compile()`` per block (torchtitan's order): FSDP's
    hooks run eagerly around each compiled block (Dynamo traced into them would hand fake
    tensors to MPI), training matches one process, and later steps reuse the graphs."""
    import zoo_models as zm
    from mpidtensor.fsdp import fully_shard

    zoo = zm.ZOO["llama"]
    ref = zoo.build()
    model = copy.deepcopy(ref)
    for block in zoo.blocks(model):
        fully_shard(block, mesh=mesh1d)
    fully_shard(model, mesh=mesh1d)
    for block in zoo.blocks(model):
        block.compile(backend="aot_eager")
    zm.check_trains_like_one_process(model, ref, zoo.batches(1), WORLD.rank, WORLD.size, WORLD)
    graphs = counters["stats"]["unique_graphs"]
    assert_all_ranks(graphs >= 1, "nothing was compiled")
    for batch in zoo.batches(2, seed=9):
        zm.loss_of(model, *zm.shard(batch, WORLD.rank, WORLD.size)).backward()
    assert_all_ranks(counters["stats"]["unique_graphs"] == graphs,
                     f"recompiled: {graphs} graphs after one step, {counters['stats']['unique_graphs']} after three")


def test_fsdp_blocks_compiled_fullgraph_train_like_one_process(mesh1d):
    """torchtitan's ``fsdp_compile`` order: ``block.compile(fullgraph=True)`` per block first,
    then ``fully_shard`` per block and the root. Dynamo, tracing the compiled ``_call_impl``,
    meets FSDP's forward hooks and must accept them without a graph break (``fullgraph``
    forbids one); training matches one process."""
    import zoo_models as zm
    from mpidtensor.fsdp import fully_shard

    zoo = zm.ZOO["llama"]
    ref = zoo.build()
    model = copy.deepcopy(ref)
    for block in zoo.blocks(model):
        block.compile(backend="aot_eager", fullgraph=True)
    for block in zoo.blocks(model):
        fully_shard(block, mesh=mesh1d)
    fully_shard(model, mesh=mesh1d)
    zm.check_trains_like_one_process(model, ref, zoo.batches(1), WORLD.rank, WORLD.size, WORLD)
    assert_all_ranks(counters["stats"]["unique_graphs"] >= 1, "nothing was compiled")
