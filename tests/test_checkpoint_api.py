"""save / load with torch's call shape: checkpoint_id positional or by keyword, storage
objects, process_group (and the older comm), planners; Stateful objects anywhere in
the state dict and their failures on one rank; the format found from the directory;
no_dist under a launcher (the plain ``python`` process without one:
test_checkpoint_recipes.py)."""
import os

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, global_tensor, raises_everywhere
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor
from mpidtensor.checkpoint import io as ckpt_io
from mpidtensor.checkpoint.formats import native
from mpidtensor.checkpoint.stateful import Stateful

WORLD = MPI.COMM_WORLD


class Counter:
    """A Stateful (by its methods, as torch's runtime-checkable protocol sees it) that
    records its calls; ``fail`` makes the named method raise on the last rank."""

    def __init__(self, weight: torch.Tensor, step: int, fail: str = "") -> None:
        self.weight, self.step, self.fail, self.calls = weight, step, fail, []

    def state_dict(self):
        self.calls.append("state_dict")
        if self.fail == "state_dict" and WORLD.rank == WORLD.size - 1:
            raise RuntimeError("state_dict broke")
        return {"weight": self.weight, "step": self.step}

    def load_state_dict(self, state_dict):
        self.calls.append("load_state_dict")
        if self.fail == "load_state_dict" and WORLD.rank == WORLD.size - 1:
            raise KeyError("no such thing")
        self.step = state_dict["step"]  # the weight was filled in place: it is the target


def sharded(mesh, shape=(7, 5), seed=1, placements=(Shard(0),)):
    return distribute_tensor(global_tensor(shape, seed=seed), mesh, list(placements))


def test_stateful_protocol_is_structural():
    assert_all_ranks(isinstance(Counter(torch.zeros(1), 0), Stateful) and isinstance(torch.nn.Linear(2, 2), Stateful)
                     and not isinstance({"state_dict": 1}, Stateful))


def test_nested_stateful_objects(mesh1d, ckpt_dir):
    """Stateful objects in a dict, a list and a tuple: save calls state_dict(); load calls
    state_dict() for the targets, then load_state_dict() with them filled; the plain
    values beside them are replaced in the caller's containers."""
    saved = {"a": Counter(sharded(mesh1d), 3), "nest": {"l": [Counter(global_tensor((4,), seed=2), 4), 9],
                                                          "t": (Counter(sharded(mesh1d, (3, 2), 3), 5), "x")}}
    dcp.save(saved, ckpt_dir)
    calls = [saved["a"].calls, saved["nest"]["l"][0].calls, saved["nest"]["t"][0].calls]
    assert_all_ranks(calls == [["state_dict"]] * 3, f"{calls}")
    state = {"a": Counter(distribute_tensor(torch.zeros(7, 5), mesh1d, [Replicate()]), 0),
             "nest": {"l": [Counter(torch.zeros(4), 0), 0], "t": (Counter(sharded(mesh1d, (3, 2), 9), 0), "")}}
    inner_list = state["nest"]["l"]
    dcp.load(state, checkpoint_id=ckpt_dir)
    objects = [state["a"], state["nest"]["l"][0], state["nest"]["t"][0]]
    assert_all_ranks(all(o.calls == ["state_dict", "load_state_dict"] for o in objects),
                     f"{[o.calls for o in objects]}")
    assert_all_ranks([o.step for o in objects] == [3, 4, 5] and state["nest"]["l"][1] == 9
                     and state["nest"]["t"][1] == "x" and state["nest"]["l"] is inner_list)
    assert_all_ranks(torch.equal(objects[0].weight.full_tensor(), global_tensor((7, 5), seed=1))
                     and torch.equal(objects[1].weight, global_tensor((4,), seed=2))
                     and torch.equal(objects[2].weight.full_tensor(), global_tensor((3, 2), seed=3)))


def test_call_forms(mesh1d, ckpt_dir):
    """checkpoint_id positional or keyword, NativeWriter/NativeReader (checkpoint_id
    replaces their path, as torch's reset does), process_group and comm, planners."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    state = {"w": sharded(mesh1d), "n": 1}
    dcp.save(state, ckpt_dir)
    dcp.save(state, checkpoint_id=ckpt_dir + "-kw", planner=DefaultSavePlanner())
    dcp.save(state, ckpt_dir + "-other", storage_writer=dcp.NativeWriter(ckpt_dir + "-unused"))
    dcp.save(state, storage_writer=dcp.NativeWriter(ckpt_dir + "-writer"), process_group=WORLD)
    for path in ("", "-kw", "-other", "-writer"):
        target = {"w": distribute_tensor(torch.zeros(7, 5), mesh1d, [Shard(1)]), "n": 0}
        dcp.load(target, storage_reader=dcp.NativeReader(ckpt_dir + path), planner=DefaultLoadPlanner())
        assert_all_ranks(torch.equal(target["w"].full_tensor(), global_tensor((7, 5), seed=1)) and target["n"] == 1)
    assert_all_ranks(not os.path.exists(ckpt_dir + "-unused"))
    comm = WORLD.Split(0 if WORLD.rank == 0 else MPI.UNDEFINED, 0)
    if comm != MPI.COMM_NULL:  # the older comm= keyword, on a one-rank communicator
        target = {"w": torch.zeros(7, 5), "n": 0}
        dcp.load(target, ckpt_dir, comm=comm)
        assert torch.equal(target["w"], global_tensor((7, 5), seed=1))
        comm.Free()
    raises_everywhere(TypeError, lambda: dcp.save(state, ckpt_dir, comm=WORLD, process_group=WORLD), "not both")
    raises_everywhere(TypeError, lambda: dcp.load(state, ckpt_dir, process_group=mesh1d), "intracommunicator")
    raises_everywhere(ValueError, lambda: dcp.save(state), "checkpoint_id")
    raises_everywhere(ValueError, lambda: dcp.load(state), "checkpoint_id")
    raises_everywhere(ValueError, lambda: dcp.save(state, ckpt_dir, planner=object()), "planner object")
    partial_planner = DefaultLoadPlanner(allow_partial_load=True)
    raises_everywhere(ValueError, lambda: dcp.load(state, ckpt_dir, planner=partial_planner), "is not supported")
    raises_everywhere(TypeError, lambda: dcp.save(state, storage_writer=ckpt_dir), "storage_writer must be")


def test_stateful_failure_on_one_rank(mesh1d, ckpt_dir):
    """state_dict() raising on the last rank fails the save everywhere (the previous
    checkpoint stays); load_state_dict() raising there fails the load everywhere; both
    errors name the object and the rank."""
    dcp.save({"app": Counter(sharded(mesh1d), 1)}, ckpt_dir)
    before = native.read_index(ckpt_dir)
    last = WORLD.size - 1
    raises_everywhere(dcp.CheckpointError, lambda: dcp.save({"app": Counter(sharded(mesh1d, seed=5), 2, "state_dict")},
                                                            ckpt_dir),
                      f"state_dict() of 'app': RuntimeError: state_dict broke (on rank {last})")
    assert_all_ranks(native.read_index(ckpt_dir) == before, "the failed save changed the index")
    target = {"app": Counter(distribute_tensor(torch.zeros(7, 5), mesh1d, [Shard(1)]), 0, "load_state_dict")}
    raises_everywhere(dcp.CheckpointError, lambda: dcp.load(target, ckpt_dir),
                      f"load_state_dict() of 'app': KeyError: 'no such thing' (on rank {last})")
    target = {"app": Counter(distribute_tensor(torch.zeros(7, 5), mesh1d, [Shard(1)]), 0)}
    dcp.load(target, ckpt_dir)
    restored = target["app"]
    assert_all_ranks(restored.step == 1 and torch.equal(restored.weight.full_tensor(), global_tensor((7, 5), seed=1)))


def test_mismatch_fails_before_load_state_dict(mesh1d, ckpt_dir):
    """A missing key or a shape or dtype mismatch inside a Stateful's state raises,
    naming the dotted key, on every rank; load_state_dict() is never called."""
    dcp.save({"app": Counter(sharded(mesh1d), 1)}, ckpt_dir)
    cases = [(torch.zeros(7, 4), "shape mismatch for 'app.weight'"),
             (torch.zeros(7, 5, dtype=torch.float64), "dtype mismatch for 'app.weight'")]
    for weight, message in cases:
        target = {"app": Counter(weight, 0)}
        raises_everywhere(dcp.CheckpointError, lambda: dcp.load(target, ckpt_dir), message)
        assert_all_ranks(target["app"].calls == ["state_dict"], f"{target['app'].calls}")
    raises_everywhere(dcp.CheckpointError, lambda: dcp.load({"app": {"other": torch.zeros(1)}}, ckpt_dir),
                      "missing key 'app.other'")


def test_format_is_found_from_the_directory(mesh1d, ckpt_dir):
    """No checkpoint, or a half-written first save (a data file and no index): an error
    naming the directory on every rank. A torch DCP directory is read by its reader."""
    raises_everywhere(FileNotFoundError, lambda: dcp.load({"w": torch.zeros(2)}, ckpt_dir), repr(ckpt_dir))
    if WORLD.rank == 0:
        os.makedirs(ckpt_dir)
        with open(os.path.join(ckpt_dir, native.data_name(ckpt_io.new_token(), 0)), "wb") as f:
            f.write(b"\0" * 64)
    WORLD.Barrier()
    raises_everywhere(FileNotFoundError, lambda: dcp.load({"w": torch.zeros(2)}, ckpt_dir), "neither")
    import torch.distributed.checkpoint as torch_dcp

    torch_dir = ckpt_dir + "-torch"
    saved = {"w": global_tensor((7, 5), seed=8), "n": 4, "m": {"l": [global_tensor((3,), seed=9), "x"]}}
    converted = True
    if WORLD.rank == 0:
        with pytest.warns(UserWarning):  # torch: one process (whether or not a test set up gloo)
            torch_dcp.save(saved, checkpoint_id=torch_dir, no_dist=True)
        dcp.dcp_to_torch_save(torch_dir, ckpt_dir + "-torch.pt")  # through the same reader, nested back
        whole = torch.load(ckpt_dir + "-torch.pt")
        converted = (whole.keys() == saved.keys() and torch.equal(whole["w"], saved["w"]) and whole["n"] == 4
                     and torch.equal(whole["m"]["l"][0], saved["m"]["l"][0]) and whole["m"]["l"][1] == "x")
    WORLD.Barrier()
    target = {"w": distribute_tensor(torch.zeros(7, 5), mesh1d, [Shard(0)]), "n": 0}
    dcp.load(target, checkpoint_id=torch_dir)
    assert_all_ranks(torch.equal(target["w"].full_tensor(), global_tensor((7, 5), seed=8)) and target["n"] == 4)
    assert_all_ranks(converted, "dcp_to_torch_save of a torch DCP directory")


def test_no_dist_under_a_launcher(mesh1d, ckpt_dir):
    """Every rank saves and loads its own tensors alone; a sharded DTensor is refused on
    save; a load fills each rank's shard of a DTensor target from the files alone."""
    mine = f"{ckpt_dir}-rank{WORLD.rank}"
    value = global_tensor((6, 3), seed=10 + WORLD.rank)
    dcp.save({"w": value, "r": DTensor.from_local(value, mesh1d, [Replicate()]), "rank": WORLD.rank},
             checkpoint_id=mine, no_dist=True)
    target = {"w": torch.zeros(6, 3), "r": torch.zeros(6, 3), "rank": -1}
    dcp.load(target, checkpoint_id=mine, no_dist=True)
    assert_all_ranks(torch.equal(target["w"], value) and torch.equal(target["r"], value)
                     and target["rank"] == WORLD.rank)
    raises_everywhere(ValueError, lambda: dcp.save({"s": sharded(mesh1d)}, mine, no_dist=True), "'s' is a DTensor")
    dcp.save({"s": sharded(mesh1d)}, ckpt_dir)
    target = {"s": distribute_tensor(torch.zeros(7, 5), mesh1d, [Shard(1)])}
    dcp.load(target, ckpt_dir, no_dist=True)  # no collective: each rank reads its own box
    assert_all_ranks(torch.equal(target["s"].full_tensor(), global_tensor((7, 5), seed=1)))
