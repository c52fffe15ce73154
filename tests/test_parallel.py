"""parallelize_module with ColwiseParallel/RowwiseParallel, and src_data_rank: outputs and
gradients equal a single-process copy of the model on 1-D meshes (1-4 ranks, uneven
sizes) and on the "tp" sub-meshes of a 2x2 mesh.

The helpers at the top are shared with the other test_parallel_* files."""
import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD = MPI.COMM_WORLD
TOL = dict(atol=1e-5, rtol=1e-5)


# --- shared helpers --------------------------------------------------------------------------


@pytest.fixture(params=["world", "tp"])
def tp_mesh(request):
    """The mesh a style gets: the 1-D world mesh, or (at 4 ranks) the "tp" sub-mesh of the
    2x2 mesh, ranks [0, 1] or [2, 3] depending on the rank: both halves run the test."""
    if request.param == "world":
        return request.getfixturevalue("mesh1d")
    return request.getfixturevalue("mesh2d")["tp"]



def full_of(out, mesh, layout=None) -> torch.Tensor:
    """The global value of a module output: a DTensor's full tensor, or a local shard
    read as ``layout`` (``None``: already the whole, replicated tensor). Differentiable."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if layout is None:
        return out
    return DTensor.from_local(out, mesh, [layout]).full_tensor()


def check_against(ref: nn.Module, model: nn.Module, out_ref: torch.Tensor, out: torch.Tensor, comm=WORLD) -> None:
    """Forward values, then gradients of a fixed weighting of the output, parameter by parameter."""
    out = out.full_tensor() if isinstance(out, DTensor) else out
    assert_close(out, out_ref, comm, **TOL)
    weight = global_tensor(tuple(out_ref.shape), seed=7)
    (out_ref * weight).sum().backward()
    (out * weight).sum().backward()
    params = dict(model.named_parameters())
    assert_all_ranks(set(params) == {n for n, _ in ref.named_parameters()}, "parameter names differ", comm)
    for name, p_ref in ref.named_parameters():
        grad = params[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        assert_close(grad, p_ref.grad, comm, **TOL)


def untouched(model: nn.Module, ref: nn.Module) -> bool:
    """No DTensor parameter, no hook, and the values of ``ref``."""
    for sub in model.modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            return False
    state, state_ref = model.state_dict(), ref.state_dict()
    return all(not isinstance(v, DTensor) and torch.equal(v, state_ref[k]) for k, v in state.items())


# --- models ----------------------------------------------------------------------------------


class MLP(nn.Module):
    """Embedding, then two Linears with an odd hidden width (uneven shards at 2-4 ranks)."""

    def __init__(self, vocab=11, dim=6, hidden=7, out=5, bias=True):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, out, bias=bias)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


class Stack(nn.Module):
    """Three residual MLP blocks in a ModuleList, for wildcard and nested plans."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(6, 9), "down": nn.Linear(9, 6)}) for _ in range(3))
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["down"](torch.relu(layer["up"](x)))
        return self.head(x)


IDS = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(1))

MLP_PLAN = {"emb": RowwiseParallel(input_layouts=Replicate()), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


# --- Colwise / Rowwise -----------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_colwise_rowwise_mlp(tp_mesh, bias):
    ref = MLP(bias=bias)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MLP_PLAN)
    out = model(IDS)
    assert_all_ranks(type(out) is torch.Tensor, "use_local_output=True hands on a plain tensor")
    check_against(ref, model, ref(IDS), out)
    placements = {n: p.placements for n, p in model.named_parameters()}
    expected = {"emb.weight": (Shard(0),), "fc1.weight": (Shard(0),), "fc2.weight": (Shard(1),)}
    if bias:
        expected.update({"fc1.bias": (Shard(0),), "fc2.bias": (Replicate(),)})
    assert_all_ranks(placements == expected, str(placements))


def test_tp_on_submesh_of_2d_mesh(mesh2d):
    """The issue's case: each "tp" sub-mesh ([0, 1] and [2, 3]) has its own source, its
    coordinate 0, and every rank of it gets that rank's values."""
    tp = mesh2d["tp"]
    ref = MLP()
    mine = copy.deepcopy(ref)
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(WORLD.rank)  # only the source's values may reach the sub-mesh
    source = int(tp.mesh[0])
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(source)
    model = parallelize_module(mine, tp, MLP_PLAN)
    check_against(ref, model, ref(IDS), model(IDS), comm=tp.comm)
    assert_all_ranks(all(p.device_mesh is tp for p in model.parameters()))


def test_embedding_colwise(tp_mesh):
    ref = nn.Embedding(13, 7)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, ColwiseParallel())
    out = model(IDS)  # local: the last dim sharded
    check_against(ref, model, ref(IDS), full_of(out, tp_mesh, Shard(-1)))
    assert_all_ranks(model.weight.placements == (Shard(1),))


def test_embedding_rowwise_sharded_output(tp_mesh):
    ref = nn.Embedding(13, 7)
    style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, style)
    out = model(IDS)
    assert_all_ranks(isinstance(out, DTensor) and out.placements == (Shard(1),), repr(out.placements))
    check_against(ref, model, ref(IDS), out.full_tensor())


# (style, how the test feeds the input, the layout its local output has)
LINEAR_CASES = {
    "colwise": (ColwiseParallel(), None, Shard(-1)),
    "colwise_replicated_out": (ColwiseParallel(output_layouts=Replicate()), None, None),
    "colwise_dtensor_out": (ColwiseParallel(use_local_output=False), None, "dtensor"),
    "colwise_batch_sharded_in": (ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0)), Shard(0), Shard(0)),
    "rowwise": (RowwiseParallel(), Shard(-1), None),
    "rowwise_replicated_in": (RowwiseParallel(input_layouts=Replicate()), None, None),
    "rowwise_seq_sharded_out": (RowwiseParallel(output_layouts=Shard(1)), Shard(-1), Shard(1)),
    "rowwise_dtensor_in": (RowwiseParallel(use_local_output=False), "dtensor", "dtensor"),
    "tuple_layouts": (ColwiseParallel(input_layouts=(Replicate(),), output_layouts=(Shard(1),)), None, Shard(1)),
}


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linear_layouts(tp_mesh, case):
    style, feed, out_layout = LINEAR_CASES[case]
    ref = nn.Linear(7, 5)
    torch.manual_seed(2)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, copy.deepcopy(style))
    x = global_tensor((3, 5, 7))
    if feed == "dtensor":
        arg = distribute_tensor(x, tp_mesh, [Shard(1)])  # any layout: redistributed as needed
    elif feed is not None:
        arg = distribute_tensor(x, tp_mesh, [feed]).to_local()  # this rank's shard
    else:
        arg = x
    out = model(arg)
    assert_all_ranks(isinstance(out, DTensor) == (out_layout == "dtensor"), type(out).__name__)
    check_against(ref, model, ref(x), full_of(out, tp_mesh, None if out_layout == "dtensor" else out_layout))


# --- plans: wildcards, "", nested calls, a style as the plan ---------------------------------


def _stack_plan_ok(model):
    for i in range(3):
        assert_all_ranks(model.layers[i]["up"].weight.placements == (Shard(0),))
        assert_all_ranks(model.layers[i]["down"].weight.placements == (Shard(1),))
    assert_all_ranks(not isinstance(model.head.weight, DTensor))


def test_wildcard_plan(tp_mesh):
    ref = Stack()
    plan = {"layers.*.up": ColwiseParallel(), "layers.*.do?n": RowwiseParallel()}
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, plan)
    _stack_plan_ok(model)
    x = global_tensor((2, 3, 6))
    check_against(ref, model, ref(x), model(x))


def test_nested_calls_and_empty_key(tp_mesh):
    ref = Stack()
    model = copy.deepcopy(ref)
    for layer in model.layers:  # one call per layer, as a training script would
        parallelize_module(layer, tp_mesh, {"up": ColwiseParallel()})
        parallelize_module(layer["down"], tp_mesh, RowwiseParallel())
    parallelize_module(model.head, tp_mesh, {"": ColwiseParallel(output_layouts=Replicate())})
    assert_all_ranks(model.head.weight.placements == (Shard(0),))
    x = global_tensor((2, 3, 6))
    check_against(ref, model, ref(x), model(x))


def test_wildcard_one_level_only(mesh1d):
    """A ``*`` stands for one name component, as in torch: "*.up" names nothing at depth 3."""
    ref = Stack()
    model = parallelize_module(copy.deepcopy(ref), mesh1d, {"layers.1*.up": ColwiseParallel()})
    placed = [isinstance(layer["up"].weight, DTensor) for layer in model.layers]
    assert_all_ranks(placed == [False, True, False], str(placed))
    raises_everywhere(ValueError, lambda: parallelize_module(copy.deepcopy(ref), mesh1d, {"*.up": ColwiseParallel()}),
                      "names no submodule")


# --- src_data_rank -----------------------------------------------------------------------------


@pytest.mark.parametrize("src", [0, "last", None])
def test_src_data_rank(mesh1d, src):
    ref = MLP()
    mine = copy.deepcopy(ref)
    with torch.no_grad():
        for p in mine.parameters():
            p.mul_(1 + WORLD.rank)
    with CommDebugMode() as comm:
        src_rank = WORLD.size - 1 if src == "last" else src
        model = parallelize_module(mine, mesh1d, MLP_PLAN, src_data_rank=src_rank)
    sources = comm.get_comm_counts()["scatter"] + comm.get_comm_counts()["broadcast"]
    for name, p in model.named_parameters():
        full = dict(ref.named_parameters())[name].detach()
        if src_rank is None:  # each rank keeps its own block of its own values
            placement = p.placements[0]
            expected = distribute_tensor(full * (1 + WORLD.rank), mesh1d, [placement], src_data_rank=None)
            assert_close(p.to_local(), expected.to_local())
        else:
            assert_close(p.full_tensor(), full * (1 + src_rank))
    assert_all_ranks((sources == 0) == (src_rank is None), str(comm.get_comm_counts()))


@pytest.mark.parametrize("src", [0, None])
def test_distribute_module_src_data_rank(tp_mesh, src):
    ref = MLP()
    mine = copy.deepcopy(ref)
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(WORLD.rank)
    model = distribute_module(mine, tp_mesh, src_data_rank=src)
    source = WORLD.rank if src is None else int(tp_mesh.mesh[0])
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert_all_ranks(p.placements == (Replicate(),), name)
        assert_close(p.to_local(), p_ref.detach() + source)


def test_distribute_tensor_sources_per_mesh_dim(mesh2d):
    """src_data_rank is a group rank on each mesh dim: on the 2x2 mesh, ``r`` means the
    rank at coordinate (r, r); on a sub-mesh, that sub-mesh's coordinate r."""
    full = global_tensor((5, 3))
    for src in (0, 1):
        mine = full + WORLD.rank
        d = distribute_tensor(mine, mesh2d, [Shard(0), Replicate()], src_data_rank=src)
        assert_close(d.full_tensor(), full + int(mesh2d.mesh[src, src]))
        tp = mesh2d["tp"]
        d = distribute_tensor(mine, tp, [Shard(1)], src_data_rank=src)
        assert_close(d.full_tensor(), full + int(tp.mesh[src]), tp.comm)


def test_bad_src_data_rank_1d(mesh1d):
    raises_everywhere(ValueError, lambda: distribute_tensor(global_tensor((4, 2)), mesh1d, src_data_rank=WORLD.size))


def test_bad_src_data_rank_2d(mesh2d):
    x = global_tensor((4, 2))
    for bad, exc in ((2, ValueError), (-1, ValueError), ("0", TypeError), (True, TypeError)):
        raises_everywhere(exc, lambda: distribute_tensor(x, mesh2d, [Shard(0), Shard(1)], src_data_rank=bad))
        raises_everywhere(exc, lambda: parallelize_module(nn.Linear(2, 2), mesh2d["tp"], ColwiseParallel(),
                                                          src_data_rank=bad))


def test_rowwise_linear_input_needs_no_shape_exchange(tp_mesh, monkeypatch):
    """A plain Shard(-1) input of a row-parallel Linear takes its global shape from
    ``in_features``: from_local's all-gather of the local shapes never runs."""
    from mpidtensor.tensor import validate

    gather_shapes = validate.global_shape_from_locals

    def no_exchange(local, mesh, placements):
        if any(isinstance(p, Shard) for p in placements):  # the only case that communicates
            raise AssertionError("from_local gathered the local shapes")
        return gather_shapes(local, mesh, placements)

    ref = MLP(bias=True)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, MLP_PLAN)
    monkeypatch.setattr(validate, "global_shape_from_locals", no_exchange)
    check_against(ref, model, ref(IDS), model(IDS))
