"""parallelize_module with ColwiseParallel/RowwiseParallel: same outputs and gradients as one process."""
import copy

import torch
from torch import nn

from helpers import assert_close, global_tensor
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 9)
        self.fc2 = nn.Linear(9, 5)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def test_colwise_rowwise_mlp(mesh1d):
    ref = MLP()
    model = parallelize_module(
        copy.deepcopy(ref), mesh1d, {"emb": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    ids = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(1))
    weight = global_tensor((4, 3, 5))
    out_ref, out = ref(ids), model(ids)
    assert_close(out, out_ref, atol=1e-5, rtol=1e-5)  # a plain, replicated tensor
    (out_ref * weight).sum().backward()
    (out * weight).sum().backward()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p.grad.full_tensor(), p_ref.grad, atol=1e-5, rtol=1e-5)
