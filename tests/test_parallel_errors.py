"""Bad input to the tensor-parallel API: a clear ValueError/TypeError on every rank, and a
plan that fails anywhere changes nothing (no parameter distributed, no hook registered)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, global_tensor
from mpidtensor import Partial, Replicate, Shard, distribute_tensor
from mpidtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from helpers import raises_everywhere
from test_parallel import untouched

WORLD = MPI.COMM_WORLD


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.fc1 = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


BAD_PLANS = {
    "unknown name": ({"fc1": ColwiseParallel(), "fc3": RowwiseParallel()}, ValueError, "names no submodule"),
    "colwise on LayerNorm": ({"fc1": ColwiseParallel(), "norm": ColwiseParallel()}, TypeError, "nn.Linear"),
    "rowwise on the root": ({"fc1": ColwiseParallel(), "": RowwiseParallel()}, TypeError, "got Net"),
    "sequence on Linear": ({"norm": SequenceParallel(), "fc2": SequenceParallel()}, TypeError, "LayerNorm"),
    "two owners": ({"fc1": ColwiseParallel(), "fc?": RowwiseParallel()}, ValueError, "two styles"),
    "owner inside owner": ({"fc1": ColwiseParallel(), "": SequenceParallel()}, TypeError, "got Net"),
    "style not a style": ({"fc1": ColwiseParallel(), "fc2": "rowwise"}, TypeError, "ParallelStyle"),
    "key not a name": ({"fc1": ColwiseParallel(), 2: RowwiseParallel()}, TypeError, "keys"),
}


class Linear(nn.Module):
    """A wrapper named like the module it wraps (as peft's LoRA ``Linear`` is)."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.base_layer(x)


def test_look_alike_module_named_with_its_origin(mesh1d):
    """The refusal names where the class comes from: "got Linear" alone reads as nonsense."""
    model = nn.Sequential(Linear())
    raises_everywhere(TypeError, lambda: parallelize_module(model, mesh1d, {"0": ColwiseParallel()}),
                      f"got Linear (from {__name__})")


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_changes_nothing(mesh1d, case):
    plan, exc, match = BAD_PLANS[case]
    ref = Net()
    model = copy.deepcopy(ref)
    raises_everywhere(exc, lambda: parallelize_module(model, mesh1d, plan), match)
    assert_all_ranks(untouched(model, ref), "the model was changed")


def test_plan_of_wrong_type(mesh1d):
    raises_everywhere(TypeError, lambda: parallelize_module(Net(), mesh1d, [ColwiseParallel()]))
    raises_everywhere(ValueError, lambda: parallelize_module(Net(), None, {"fc1": ColwiseParallel()}))


def test_parallelized_twice(mesh1d):
    model = parallelize_module(Net(), mesh1d, {"fc1": ColwiseParallel(output_layouts=Replicate())})
    raises_everywhere(ValueError, lambda: parallelize_module(model, mesh1d, {"fc1": RowwiseParallel()}), "already")
    x = global_tensor((3, 4))
    torch.testing.assert_close(model(x).shape, torch.Size([3, 4]))  # still one working model
    norm = parallelize_module(nn.LayerNorm(4), mesh1d, SequenceParallel())
    raises_everywhere(ValueError, lambda: parallelize_module(norm, mesh1d, SequenceParallel()), "already")


@pytest.mark.parametrize(
    "style",
    [ColwiseParallel(), RowwiseParallel(), SequenceParallel(),
     PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
     PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate())],
    ids=lambda s: type(s).__name__,
)
def test_2d_mesh_refused(mesh2d, style):
    ref = Net()
    model = copy.deepcopy(ref)
    target = "norm" if isinstance(style, SequenceParallel) else "fc1"
    raises_everywhere(ValueError, lambda: parallelize_module(model, mesh2d, {target: style}), "1-D mesh")
    assert_all_ranks(untouched(model, ref), "the model was changed")


def test_bad_style_arguments():
    raises_everywhere(TypeError, lambda: ColwiseParallel(input_layouts="replicate"))
    raises_everywhere(TypeError, lambda: RowwiseParallel(output_layouts=(Shard(0), Shard(1))))
    raises_everywhere(ValueError, lambda: ColwiseParallel(output_layouts=Partial()), "Partial")
    raises_everywhere(TypeError, lambda: SequenceParallel(sequence_dim="1"))
    raises_everywhere(ValueError, lambda: PrepareModuleInput(input_layouts=(Shard(0), None),
                                                             desired_input_layouts=(Replicate(),)))
    raises_everywhere(ValueError, lambda: PrepareModuleInput(input_layouts=Shard(0)))
    raises_everywhere(ValueError, lambda: PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)},
                                                             desired_input_kwarg_layouts={"b": Replicate()}))
    raises_everywhere(TypeError, lambda: PrepareModuleInput(input_kwarg_layouts=[Shard(0)]))
    raises_everywhere(ValueError, lambda: PrepareModuleOutput(output_layouts=(Shard(0),),
                                                              desired_output_layouts=(None,)))


def test_prepare_input_count_mismatch(mesh1d):
    model = parallelize_module(nn.Linear(4, 4), mesh1d,
                               PrepareModuleInput(input_layouts=(Replicate(), None),
                                                  desired_input_layouts=(Replicate(), None)))
    raises_everywhere(ValueError, lambda: model(global_tensor((2, 4))), "positional inputs")


def test_prepare_input_not_a_tensor(mesh1d):
    model = parallelize_module(nn.Identity(), mesh1d,
                               PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()))
    raises_everywhere(TypeError, lambda: model("text"), "torch.Tensor")


def test_loss_parallel_bad_logits(mesh1d):
    logits, target = global_tensor((4, 7)), torch.tensor([1, 2, 3, 4])

    def loss_of(x, t=target):
        with loss_parallel():
            return F.cross_entropy(x, t)

    raises_everywhere(ValueError, lambda: loss_of(distribute_tensor(logits, mesh1d, [Shard(0)])), "class dim")
    raises_everywhere(ValueError, lambda: loss_of(distribute_tensor(logits, mesh1d, [Replicate()])), "class dim")
    raises_everywhere(TypeError, lambda: loss_of(logits), "DTensor")
    probs = torch.softmax(global_tensor((4, 7), seed=3), dim=1)
    raises_everywhere(ValueError, lambda: loss_of(distribute_tensor(logits, mesh1d, [Shard(1)]), probs), "class-index")


def test_loss_parallel_class_dim_twice(mesh2d):
    logits = distribute_tensor(global_tensor((4, 7)), mesh2d, [Shard(1), Shard(1)])
    with loss_parallel():
        raises_everywhere(ValueError, lambda: F.cross_entropy(logits, torch.tensor([1, 2, 3, 4])), "exactly one")
