"""Constant padding (``F.pad``, ``aten.constant_pad_nd``) of DTensors: a DTensor back, equal to
one process, with torch's placements (shards of unpadded dims kept, padded dims gathered, a
Partial kept where padding commutes with its reduction) and gradients equal to one process."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("placement,pad,want", [
    (Shard(0), [1, 2], Shard(0)), (Shard(1), [1, 2], Replicate()), (Shard(1), [0, 0, 1, 0], Shard(1)),
    (Shard(0), [0, 0, 1, 0], Replicate()), (Shard(1), [-1, 1], Replicate()), (Replicate(), [2, 2], Replicate())])
def test_pad_shards(mesh1d, placement, pad, want):
    full = global_tensor((7, 5))  # 7 and 5 rows split unevenly over 2-4 ranks
    d = distribute_tensor(full, mesh1d, [placement])
    out = F.pad(d, pad, value=0.5)
    assert_all_ranks(isinstance(out, DTensor) and out.placements == (want,), f"{type(out).__name__} "
                     f"{getattr(out, 'placements', None)}")
    assert_close(out.full_tensor(), F.pad(full, pad, value=0.5))


@pytest.mark.parametrize("reduce_op,value,keeps", [("sum", 0.0, True), ("sum", 1.0, False), ("max", 3.0, True),
                                                   ("avg", 2.0, True), ("min", -1.0, True)])
def test_pad_partial(mesh1d, reduce_op, value, keeps):
    full = global_tensor((4, 6))
    parts = DTensor.from_local(_term(full, reduce_op), mesh1d, [Partial(reduce_op)])
    out = F.pad(parts, [1, 1], value=value)
    assert_all_ranks(out.placements == ((Partial(reduce_op),) if keeps else (Replicate(),)), str(out.placements))
    assert_close(out.full_tensor(), F.pad(full, [1, 1], value=value))


def _term(full: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """This rank's term of ``full`` under ``reduce_op``."""
    if reduce_op == "sum":
        return full / WORLD.size
    if reduce_op == "max":
        return full - WORLD.rank  # rank 0 holds the max
    if reduce_op == "min":
        return full + WORLD.rank
    return full.clone()  # avg of equal terms


def test_pad_gradient(mesh1d):
    full = global_tensor((6, 5))
    weight = global_tensor((6, 9), seed=3)
    x = distribute_tensor(full, mesh1d, [Shard(0)]).requires_grad_()
    (F.pad(x, [1, 3], value=2.0) * distribute_tensor(weight, mesh1d, [Shard(0)])).sum().backward()
    assert_close(x.grad.full_tensor(), weight[:, 1:6])


def test_pad_2d_mesh(mesh2d):
    full = global_tensor((5, 7, 3))
    d = distribute_tensor(full, mesh2d, [Shard(0), Shard(2)])
    out = F.pad(d, [1, 1], value=-1.0)
    assert_all_ranks(out.placements == (Shard(0), Replicate()), str(out.placements))
    assert_close(out.full_tensor(), F.pad(full, [1, 1], value=-1.0))
