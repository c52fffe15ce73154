"""PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: positional and keyword
inputs with None entries, single and tuple outputs, use_local_output, and an attention-like
module whose inputs arrive sequence-sharded, are gathered, and whose output is handed back
sequence-sharded; values and gradients equal one process."""
import copy

import pytest
import torch
from torch import nn

from helpers import assert_all_ranks, global_tensor
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from test_parallel import check_against, full_of, tp_mesh  # noqa: F401 (a fixture)



class Mixer(nn.Module):
    """forward(x, scale, mask=None, *, bias=None): positional, non-tensor and keyword inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.proj = nn.Linear(6, 6)
        self.seen = []

    def forward(self, x, scale, mask=None, bias=None):
        self.seen = [type(v).__name__ if not isinstance(v, DTensor) else v.placements for v in (x, mask, bias)]
        y = self.proj(x) * scale
        if mask is not None:
            y = y * mask
        if bias is not None:
            y = y + bias
        return y


def _inputs():
    return global_tensor((2, 5, 6)), global_tensor((2, 5, 6), seed=3).sigmoid(), global_tensor((6,), seed=4)


@pytest.mark.parametrize("use_local_output", [False, True])
def test_positional_with_none_entries(tp_mesh, use_local_output):
    x, mask, _ = _inputs()
    ref = Mixer()
    model = copy.deepcopy(ref)
    style = PrepareModuleInput(
        input_layouts=(Shard(1), None, Shard(1)),
        desired_input_layouts=(Replicate(), None, Replicate()),
        use_local_output=use_local_output,
    )
    parallelize_module(model, tp_mesh, {"": style})
    shard = lambda t: distribute_tensor(t, tp_mesh, [Shard(1)]).to_local()  # noqa: E731
    out = model(shard(x), 0.5, shard(mask))
    want = "Tensor" if use_local_output else (Replicate(),)
    assert_all_ranks(model.seen == [want, want, "NoneType"], str(model.seen))
    check_against(ref, model, ref(x, 0.5, mask), out)


def test_kwargs(tp_mesh):
    x, mask, bias = _inputs()
    ref = Mixer()
    model = copy.deepcopy(ref)
    style = PrepareModuleInput(
        input_layouts=(Shard(0), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"mask": Shard(1), "bias": Shard(0)},
        desired_input_kwarg_layouts={"mask": Replicate(), "bias": Replicate()},
    )
    parallelize_module(model, tp_mesh, style)
    out = model(distribute_tensor(x, tp_mesh, [Shard(0)]).to_local(), 2.0,
                mask=distribute_tensor(mask, tp_mesh, [Shard(1)]).to_local(),
                bias=distribute_tensor(bias, tp_mesh, [Shard(0)]).to_local())
    assert_all_ranks(model.seen == [(Replicate(),)] * 3, str(model.seen))
    check_against(ref, model, ref(x, 2.0, mask=mask, bias=bias), out)
    out = model(distribute_tensor(x, tp_mesh, [Shard(0)]).to_local(), 2.0, mask=None)  # None kwargs pass through
    assert_all_ranks(model.seen == [(Replicate(),), "NoneType", "NoneType"], str(model.seen))


class TwoOut(nn.Module):
    def forward(self, x, y):
        return x * 2, 7, y + 1


@pytest.mark.parametrize("use_local_output", [True, False])
def test_output_tuple_with_none(tp_mesh, use_local_output):
    x, y = global_tensor((5, 4)), global_tensor((3, 5), seed=2)
    model = TwoOut()
    style = PrepareModuleOutput(
        output_layouts=(Replicate(), None, Shard(1)),
        desired_output_layouts=(Shard(0), None, Replicate()),
        use_local_output=use_local_output,
    )
    parallelize_module(model, tp_mesh, style)
    a, seven, b = model(x, distribute_tensor(y, tp_mesh, [Shard(1)]).to_local())
    assert_all_ranks(seven == 7 and isinstance(a, DTensor) != use_local_output, type(a).__name__)
    torch.testing.assert_close(full_of(a, tp_mesh, Shard(0)), x * 2)
    torch.testing.assert_close(full_of(b, tp_mesh, None), y + 1)


def test_single_output(tp_mesh):
    x = global_tensor((2, 7, 6))
    ref = nn.Linear(6, 6)
    model = copy.deepcopy(ref)
    parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    out = model(x)  # a local sequence shard now
    check_against(ref, model, ref(x), full_of(out, tp_mesh, Shard(1)))


class GatedMix(nn.Module):
    """q/k/v column-parallel, o row-parallel, mixed feature by feature (so any split of the
    8 features works); reads (x, freqs), freqs a plain per-feature tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.q, self.k, self.v = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(6, 8)
        self.o = nn.Linear(8, 6)

    def forward(self, x, freqs):
        return self.o(torch.sigmoid(self.q(x) * freqs) * self.k(x) + self.v(x))


def test_region_input_output(tp_mesh):
    """A sequence-parallel region of a transformer: inputs Shard(1) -> Replicate, features
    sharded inside (8 over 2-4 ranks, unevenly at 3), output reduce-scattered to Shard(1)."""
    ref = GatedMix()
    model = copy.deepcopy(ref)
    plan = {
        "": PrepareModuleInputOutput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_input=False,
            output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=False,
        ),
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "o": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, plan)
    x, freqs = global_tensor((2, 7, 6)), global_tensor((8,), seed=5)
    local_freqs = distribute_tensor(freqs, tp_mesh, [Shard(0)]).to_local()  # the q features this rank holds
    out = model(distribute_tensor(x, tp_mesh, [Shard(1)]).to_local(), local_freqs)
    assert_all_ranks(isinstance(out, DTensor) and out.placements == (Shard(1),), repr(out))
    check_against(ref, model, ref(x, freqs), out.full_tensor())
