"""``DTensor(local, spec, requires_grad=...)`` with torch's ``DTensorSpec`` / ``TensorMeta``
over mpidtensor's mesh and placements, as torch's test_dtensor builds it (issue 38): the
global shape, a leaf that requires grad, torch's warning when ``requires_grad`` disagrees
with the local tensor's, gradients through an op; torch's spec over torch's mesh is refused."""
from __future__ import annotations

import warnings

import torch
from mpi4py import MPI
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor import DeviceMesh, DTensor, Shard

N = MPI.COMM_WORLD.size


def test_constructor_with_torch_spec():
    mesh = DeviceMesh("cpu", list(range(N)))
    local = torch.randn(3, 3, requires_grad=True)
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size([3 * N, 3]), local.stride(), local.dtype))
    d = DTensor(local, spec, requires_grad=True)
    problems = []
    if type(d) is not DTensor or d.shape != (3 * N, 3) or not (d.requires_grad and d.is_leaf):
        problems.append(f"{type(d)} {d.shape} requires_grad {d.requires_grad} leaf {d.is_leaf}")
    if d.placements != (Shard(0),) or d.device_mesh is not mesh or not torch.equal(d.to_local(), local):
        problems.append(f"placements {d.placements}, mesh {d.device_mesh}")
    (d * 2).to_local().sum().backward()
    if d.grad is None or not torch.equal(d.grad.to_local(), torch.full((3, 3), 2.0)):
        problems.append(f"grad {d.grad}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DTensor(local, spec, requires_grad=False)
    if not any("To construct" in str(w.message) for w in caught):
        problems.append("no warning for requires_grad=False over a local tensor that requires grad")
    assert_all_ranks(not problems, "; ".join(problems))
    no_meta = DTensorSpec(mesh, (Shard(0),))
    raises_everywhere(ValueError, lambda: DTensor(torch.ones(2), no_meta, requires_grad=False), "tensor_meta")
