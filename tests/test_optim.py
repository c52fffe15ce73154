"""torch.optim on sharded parameters: no communication, the same numbers as on full tensors."""
import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
def test_optimizer_steps(mesh1d, cls, kwargs, foreach, monkeypatch):
    monkeypatch.setenv("MPIDTENSOR_STRICT", "1")
    shapes_placements = [((7, 5), [Shard(0)]), ((5, 3), [Shard(1)]), ((9,), [Replicate()])]
    ref = [torch.nn.Parameter(global_tensor(s, seed=i)) for i, (s, _) in enumerate(shapes_placements)]
    dist = [torch.nn.Parameter(distribute_tensor(global_tensor(s, seed=i), mesh1d, p))
            for i, (s, p) in enumerate(shapes_placements)]
    ref_opt = cls(ref, foreach=foreach, **kwargs)
    dist_opt = cls(dist, foreach=foreach, **kwargs)
    for step in range(3):
        for i, (r, d) in enumerate(zip(ref, dist)):
            g = global_tensor(r.shape, seed=100 * step + i)
            r.grad = g.clone()
            d.grad = distribute_tensor(g, mesh1d, d.placements)
        ref_opt.step()
        with CommDebugMode() as comm:
            dist_opt.step()
        assert_all_ranks(comm.get_total_counts() == 0, f"optimizer step communicated: {comm.get_comm_counts()}")
    for r, d in zip(ref, dist):
        assert_close(d.full_tensor(), r.detach(), atol=1e-6, rtol=1e-5)


def test_dtensor_parameters_get_the_foreach_kernels_plain_ones_get(mesh1d):
    """As with torch's DTensor: the optimizers' and clip_grad_norm_'s choice of the
    multi-tensor kernels treats a DTensor like a plain tensor on its device."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support

    p = distribute_tensor(torch.randn(8, 3), mesh1d, [Shard(0)])
    plain = torch.randn(8, 3)
    assert_all_ranks(_default_to_fused_or_foreach([p], False) == _default_to_fused_or_foreach([plain], False)
                     and _has_foreach_support([p], p.device) == _has_foreach_support([plain], plain.device),
                     "DTensor is not a foreach-supported type")
