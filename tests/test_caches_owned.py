"""Every cache owned (``mpidtensor.runtime.caches``): what ``clear_cache()``, a freed mesh
and a changed sharding rule reach. ``fully_shard`` without a mesh works again after its
default mesh was freed; a parallel module's fast path follows a rule ``register_sharding``
changes; the communicators compiled graphs call are dropped once their mesh is freed."""
import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidtensor
from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.comm import compiled
from mpidtensor.experimental import register_sharding
from mpidtensor.fast.linear import LINEAR
from mpidtensor.fast.norm import NORM
from mpidtensor.fsdp import fully_shard
from mpidtensor.ops import registry
from mpidtensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module
from mpidtensor.runtime import caches

WORLD = MPI.COMM_WORLD
aten = torch.ops.aten


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def test_fully_shard_without_a_mesh_after_its_default_mesh_was_freed():
    """The default mesh is freed (and the caches cleared): the next ``fully_shard`` builds a
    new one instead of raising that the mesh was freed, and trains like one process."""
    first = fully_shard(_mlp())
    mesh = first[0].weight.device_mesh
    mesh.free()
    mpidtensor.clear_cache()
    ref, model = _mlp(), fully_shard(_mlp())
    assert_all_ranks(model[0].weight.device_mesh is not mesh, "the freed default mesh was given again")
    x = torch.randn(3, 6, dtype=torch.double, generator=torch.Generator().manual_seed(1))
    assert_close(model(x), ref(x))


@pytest.fixture
def rule_of():
    """Gives an op's rule back (and clears the caches) after a test replaced it."""
    saved = {}

    def save(op):
        return saved.setdefault(op, registry.rule_for(op))
    yield save
    for op, rule in saved.items():
        registry.restore_rule(op, rule)
    caches.clear_all()


def _replicate_everything(n_out: int, args: list):
    return lambda *a, **k: [([Replicate()] * n_out, [Replicate() if i in args else None for i in range(len(a))])]


def test_linear_fast_path_follows_a_changed_rule(rule_of):
    """``register_sharding`` gives aten.mm a rule that replicates: the Colwise Linear's cached
    verdict is dropped, so it takes the general path (same result); with the built-in rule
    back, the local path again."""
    mesh = init_device_mesh("cpu", (WORLD.size,))
    ref = nn.Linear(6, 5).double()
    model = parallelize_module(nn.Linear(6, 5).double(), mesh, ColwiseParallel(output_layouts=Replicate()))
    model.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in ref.state_dict().items()})
    x = torch.randn(4, 6, dtype=torch.double, generator=torch.Generator().manual_seed(2))

    def hits_of_a_call() -> int:
        before = LINEAR.hits
        assert_close(model(x), ref(x))
        return LINEAR.hits - before

    local = hits_of_a_call()
    built_in = rule_of(aten.mm.default)
    register_sharding(aten.mm.default)(_replicate_everything(1, [0, 1]))
    general = hits_of_a_call()
    registry.restore_rule(aten.mm.default, built_in)
    mpidtensor.clear_cache()
    again = hits_of_a_call()
    assert_all_ranks((local, general, again) == (1, 0, 1),
                     f"fast-path hits {local} with the built-in rule, {general} after, {again} with it back")


def test_norm_fast_path_follows_a_changed_rule(rule_of):
    """The same for a sequence-parallel LayerNorm and aten.native_layer_norm's rule."""
    mesh = init_device_mesh("cpu", (WORLD.size,))
    torch.manual_seed(4)
    ref = nn.LayerNorm(6).double()
    model = parallelize_module(nn.LayerNorm(6).double(), mesh, SequenceParallel())
    model.load_state_dict({k: distribute_tensor(v, mesh, [Replicate()]) for k, v in ref.state_dict().items()})
    x = torch.randn(2, 2 * WORLD.size + 1, 6, dtype=torch.double, generator=torch.Generator().manual_seed(5))

    def hits_of_a_call() -> int:
        before = NORM.hits
        out = model(distribute_tensor(x, mesh, [Shard(1)]))
        assert_close(out.full_tensor() if isinstance(out, DTensor) else out, ref(x))
        return NORM.hits - before

    local = hits_of_a_call()
    rule_of(aten.native_layer_norm.default)
    register_sharding(aten.native_layer_norm.default)(_replicate_everything(3, [0, 2, 3]))
    general = hits_of_a_call()
    assert_all_ranks((local, general) == (1, 0), f"fast-path hits {local} with the built-in rule, {general} after")


def test_compiled_graphs_forget_communicators_of_freed_meshes():
    """A communicator a compiled graph called stays while its mesh lives (``clear_cache``
    keeps it: the graph may run again) and is dropped when the mesh is freed; a graph that
    still calls it gets a ``RuntimeError`` naming why."""
    mesh = init_device_mesh("cpu", (WORLD.size,))
    index = compiled._comm_id(mesh.comm)
    mpidtensor.clear_cache()
    kept = index in compiled._COMMS
    mesh.free()
    dropped = index not in compiled._COMMS
    try:
        compiled._comm(index)
        verdict = "no error"
    except RuntimeError as err:
        verdict = None if "freed" in str(err) else str(err)
    assert_all_ranks(kept and dropped and verdict is None, f"kept {kept}, dropped {dropped}, {verdict}")
