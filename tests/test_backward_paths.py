"""Backward paths of the FSDP x TP step: the local sequence-parallel norms refuse a double
backward (``once_differentiable``) and give the plain gradient under ``create_graph``, and
FSDP's blocking reduce-scatter runs through a prepared collective, one per group size
(gradients equal one process's over several steps and two group sizes; one post-backward
per backward)."""
import copy

import pytest
import torch
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Shard, distribute_tensor
from mpidtensor.fsdp import fully_shard
from mpidtensor.runtime import progress
from mpidtensor.parallel import SequenceParallel, parallelize_module
from test_parallel import tp_mesh  # noqa: F401 (a fixture)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_local_norm_double_backward_refused(tp_mesh, kind):
    """A first backward with ``create_graph`` works and equals the plain one; differentiating
    its gradients again raises, as ``once_differentiable`` does."""
    torch.manual_seed(3)
    ref = nn.RMSNorm(6) if kind == "rms" else nn.LayerNorm(6)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, SequenceParallel())
    x = distribute_tensor(global_tensor((2, 5, 6)), tp_mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(global_tensor((2, 5, 6), seed=5), tp_mesh, [Shard(1)]).requires_grad_()
    (g_plain,) = torch.autograd.grad((model(x) * w).sum(), x)
    (g,) = torch.autograd.grad((model(x) * w).sum(), x, create_graph=True)  # its output gradient needs grad
    assert_close(g.full_tensor(), g_plain.full_tensor(), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 10), nn.Linear(10, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_fsdp_prepared_reduce_scatter_matches_plain(mesh1d):
    """Blocking (progress off) FSDP gradients over three steps, each layer its own group
    (two reduce-scatter sizes), equal one process's; each backward runs each group's
    post-backward once (one reduce-scatter per group)."""
    assert progress.mode() == "off"
    mesh = mesh1d
    torch.manual_seed(0)
    ref = _Two()
    model = copy.deepcopy(ref)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    group = model.a._fsdp_state.group
    original = group.post_backward
    group.post_backward = lambda: (calls.append(1), original())[1]
    for step in range(3):
        x = global_tensor((4, 6), seed=step)
        ref(x).square().sum().backward()
        model(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-6)
            p.grad, q.grad = None, None
    assert_all_ranks(len(calls) == 3, str(calls))
