"""SequenceParallel: LayerNorm / RMSNorm / dropout on sequence-sharded activations equal one
process, forward and gradients, uneven sequence lengths, alone and in a Megatron-style
block (norm sequence-parallel, all-gather into the column-parallel Linear, reduce-scatter
out of the row-parallel one)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, DeviceMesh, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from test_parallel import check_against, full_of, tp_mesh  # noqa: F401 (a fixture)

WORLD = MPI.COMM_WORLD


class PyRMSNorm(nn.Module):
    """Llama's Python RMSNorm (what torch's docs name as supported besides nn.RMSNorm)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str) -> nn.Module:
    torch.manual_seed(4)
    module = {"layer": nn.LayerNorm(6), "rms": nn.RMSNorm(6), "pyrms": PyRMSNorm(6)}[kind]
    with torch.no_grad():  # not the ones init: replication must carry real values
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("kind", ["layer", "rms", "pyrms"])
@pytest.mark.parametrize("sequence_dim", [1, 0])
@pytest.mark.parametrize("use_local_output", [False, True])
def test_norms(tp_mesh, kind, sequence_dim, use_local_output):
    ref = _norm(kind)
    style = SequenceParallel(sequence_dim=sequence_dim, use_local_output=use_local_output)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, style)
    x = global_tensor((5, 7, 6))  # 7 (and 5) split unevenly over 2-4 ranks
    out = model(distribute_tensor(x, tp_mesh, [Shard(sequence_dim)]).to_local())
    assert_all_ranks(isinstance(out, DTensor) != use_local_output, type(out).__name__)
    if isinstance(out, DTensor):
        assert_all_ranks(out.placements == (Shard(sequence_dim),), repr(out.placements))
    assert_all_ranks(all(p.placements == (Replicate(),) for p in model.parameters()))
    check_against(ref, model, ref(x), full_of(out, tp_mesh, Shard(sequence_dim)))


def test_dtensor_input_is_redistributed(tp_mesh):
    ref = _norm("layer")
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = global_tensor((2, 5, 6))
    out = model(distribute_tensor(x, tp_mesh, [Replicate()]))
    assert_all_ranks(out.placements == (Shard(1),), repr(out.placements))
    check_against(ref, model, ref(x), out.full_tensor())


@pytest.mark.parametrize("src", [0, None])
def test_parameters_from_src_data_rank(tp_mesh, src):
    """Norm weights are replicated from the source (coordinate 0 of the mesh), not assumed
    to be ones; with src_data_rank=None each rank keeps its own."""
    ref = _norm("rms")
    mine = copy.deepcopy(ref)
    with torch.no_grad():
        mine.weight.add_(WORLD.rank)
    model = parallelize_module(mine, tp_mesh, SequenceParallel(), src_data_rank=src)
    source = WORLD.rank if src is None else int(tp_mesh.mesh[0])
    assert_close(model.weight.to_local(), ref.weight.detach() + source)


@pytest.mark.parametrize("dropout", [nn.Dropout(0.4), nn.Dropout1d(0.3)], ids=["dropout", "dropout1d"])
def test_dropout_mask_equals_one_process(tp_mesh, dropout):
    """mpidtensor's random ops are layout-invariant: the sequence-sharded dropout keeps the
    elements that one process (a mesh of this rank alone) keeps, under the same seed."""
    solo = DeviceMesh("cpu", [0], comm=MPI.COMM_SELF)
    x = global_tensor((3, 7, 6)).requires_grad_()
    torch.manual_seed(11)
    expected = dropout(distribute_tensor(x, solo, [Replicate()])).to_local()
    model = parallelize_module(copy.deepcopy(dropout), tp_mesh, SequenceParallel())
    torch.manual_seed(11)
    sharded = distribute_tensor(x, tp_mesh, [Shard(1)])  # a leaf: its grad is checked below
    out = model(sharded.to_local())
    assert_close(out.full_tensor(), expected.detach())
    kept = (expected != 0).float()
    assert_all_ranks(0 < kept.mean().item() < 1, "the mask keeps some and drops some")
    weight = global_tensor(tuple(x.shape), seed=9)
    (out.full_tensor() * weight).sum().backward()
    scale = 1 / (1 - dropout.p)
    assert_close(sharded.grad.full_tensor(), weight * kept * scale, atol=1e-6, rtol=1e-6)


class Block(nn.Module):
    """norm -> up (column) -> gelu -> down (row) -> dropout, with a residual."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_megatron_block(tp_mesh):
    ref = Block()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, plan)
    x = global_tensor((2, 7, 6))
    out = model(distribute_tensor(x, tp_mesh, [Shard(1)]))  # the residual stream stays Shard(1)
    assert_all_ranks(out.placements == (Shard(1),), repr(out.placements))
    check_against(ref, model, ref(x), out.full_tensor())


def test_partial_gradients_settled_once(tp_mesh):
    """The norm's replicated weight and bias get Partial gradients from the sequence
    shards: the gradient hook all-reduces each once in the backward, so .grad is
    Replicate and an optimizer step communicates nothing."""
    from mpidtensor.debug import CommDebugMode

    ref = _norm("layer")
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = global_tensor((2, 7, 6))
    ref(x).pow(2).sum().backward()
    out = model(distribute_tensor(x, tp_mesh, [Shard(1)]))
    with CommDebugMode() as comm:
        out.pow(2).sum().backward()
    reduces = 2 if tp_mesh.size() > 1 else 0  # weight and bias
    assert_all_ranks(comm.get_comm_counts().get("all_reduce", 0) == reduces, str(comm.get_comm_counts()))
    for name, p in model.named_parameters():
        assert_all_ranks(p.grad.placements == (Replicate(),), f"{name}: {p.grad.placements}")
        assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CommDebugMode() as comm:
        opt.step()
    assert_all_ranks(not comm.get_comm_counts(), f"optimizer step: {comm.get_comm_counts()}")
