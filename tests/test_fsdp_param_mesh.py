"""torch 2.13's per-parameter mesh in ``fully_shard``: ``shard_placement_fn`` returning a
``ShardPlacementResult(placement, mesh_info)`` shards that parameter over
``mesh_info.mesh`` (torchtitan's MoE blocks: routed experts, expert-parallel over ``ep``,
sharded over ``efsdp``; the rest of the block over ``fsdp``). One module, one group per
mesh, driven together; also with ``dp_mesh_dims`` (torchtitan's ``full_dtensor``: the
experts' mesh info names ``efsdp`` of the sparse mesh). Trained against one process from
the same seed at 1-4 ranks."""
import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.fsdp import DataParallelMeshDims, fully_shard

WORLD = MPI.COMM_WORLD
DIM, EXPERTS, ROWS, STEPS = 6, 4, 2, 3


class Block(nn.Module):
    """A dense projection, then every expert's (E, D, D) map of it, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.experts
        if isinstance(w, DTensor):  # expert-parallel: the whole weight from the ep ranks
            w = w.full_tensor()
        weight = self.dense.weight
        if isinstance(weight, DTensor):  # full_dtensor: the rows as a replicated DTensor on the dense mesh
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
        h = self.dense(x)
        if isinstance(h, DTensor):
            h = h.to_local()
        return torch.tanh(torch.einsum("bd,edf->bf", h, w))


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(Block(), Block())


def meshes():
    """(fsdp, efsdp, ep): the world mesh and its (efsdp, ep) unflatten, ep 2 where it divides."""
    n = WORLD.size
    ep = 2 if n % 2 == 0 else 1
    world = init_device_mesh("cpu", (n,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (n,), ("fsdp",))
    sparse = world._unflatten(0, (n // ep, ep), ("efsdp", "ep"))
    return dense["fsdp"], sparse["efsdp"], sparse["ep"]


def shard(model: nn.Module, fsdp, efsdp, ep) -> None:
    """torchtitan's pattern: experts Shard(0) over ep first, then FSDP per block with the
    experts on efsdp (a torch ShardPlacementResult), the rest on fsdp."""
    for block in model:
        block.experts = nn.Parameter(distribute_tensor(block.experts.detach(), ep, [Shard(0)]))
        experts_info = FSDPMeshInfo(efsdp, shard_mesh_dim=0)

        def placement(param, experts=block.experts, info=experts_info):
            return ShardPlacementResult(placement=Shard(0), mesh_info=info) if param is experts else None
        fully_shard(block, mesh=fsdp, shard_placement_fn=placement)
    fully_shard(model, mesh=fsdp)


def batches(chunks: int) -> torch.Tensor:
    return torch.randn(STEPS, chunks * ROWS, DIM, generator=torch.Generator().manual_seed(3))


def train(model: nn.Module, xs: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for x in xs:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_experts_on_their_own_mesh_match_one_process(reshard_after_forward):
    fsdp, efsdp, ep = meshes()
    chunks = efsdp.size()
    xs = batches(chunks)
    ref = make_model()
    ref_losses = train(ref, xs)

    model = make_model()
    shard(model, fsdp, efsdp, ep)
    for block in model:
        block.set_reshard_after_forward(reshard_after_forward)
    experts = model[0].experts
    assert_all_ranks(experts.device_mesh.mesh_dim_names == ("efsdp", "ep") and model[0].dense.weight.device_mesh
                     is fsdp, f"{experts.device_mesh} / {model[0].dense.weight.device_mesh}")
    # the ep ranks of one efsdp coordinate see the same rows (the experts' gradient is
    # whole on each), the efsdp ranks different ones: FSDP averages over each group's mesh
    mine = efsdp.get_local_rank()
    losses = train(model, xs[:, mine * ROWS:(mine + 1) * ROWS])
    mean = torch.stack(losses).clone()
    WORLD.Allreduce(MPI.IN_PLACE, mean.numpy(), op=MPI.SUM)
    assert_close(mean / WORLD.size, torch.stack(ref_losses), atol=1e-6, rtol=1e-5)
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert_close(got.full_tensor(), want.detach(), atol=1e-6, rtol=1e-5)


def test_experts_on_spmd_meshes_match_one_process():
    """torchtitan's ``full_dtensor`` pattern: every parameter a DTensor on its full mesh
    (dense: ``(fsdp,)`` replicated; experts: ``(efsdp, ep)``, ``Shard(0)`` over ep),
    ``fully_shard(..., dp_mesh_dims=...)`` with the experts' ``ShardPlacementResult`` carrying
    torch's mesh info of ``efsdp`` on the sparse mesh (``_get_mesh_info(sparse, dims)``).
    Every rank trains on the same rows: one process's losses and parameters."""
    n = WORLD.size
    ep = 2 if n % 2 == 0 else 1
    world = init_device_mesh("cpu", (n,), mesh_dim_names=("world",))
    dense, sparse = world._unflatten(0, (n,), ("fsdp",)), world._unflatten(0, (n // ep, ep), ("efsdp", "ep"))
    xs = batches(2)
    ref = make_model()
    ref_losses = train(ref, xs)
    model = make_model()
    for block in model:
        block.dense.weight = nn.Parameter(distribute_tensor(block.dense.weight.detach(), dense, [Replicate()]))
        block.dense.bias = nn.Parameter(distribute_tensor(block.dense.bias.detach(), dense, [Replicate()]))
        block.experts = nn.Parameter(distribute_tensor(block.experts.detach(), sparse, [Replicate(), Shard(0)]))
        info = _get_mesh_info(sparse, DataParallelMeshDims(shard="efsdp"))

        def placement(param, experts=block.experts, info=info):
            return ShardPlacementResult(placement=Shard(0), mesh_info=info) if param is experts else None
        fully_shard(block, mesh=dense, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"), shard_placement_fn=placement)
    fully_shard(model, mesh=dense, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    experts = model[0].experts
    assert_all_ranks(experts.device_mesh is sparse and experts.placements[1] == Shard(0), f"{experts.placements}")
    losses = train(model, xs)
    assert_close(torch.stack(losses), torch.stack(ref_losses), atol=1e-6, rtol=1e-5)
    for got, want in zip(model.parameters(), ref.parameters()):
        assert_close(got.full_tensor(), want.detach(), atol=1e-6, rtol=1e-5)
