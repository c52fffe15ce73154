"""The flows of PyTorch's recipes "Getting Started with Distributed Checkpoint (DCP)" and
"Asynchronous Saving with DCP", with only the module paths swapped: an ``AppState``
(``Stateful``) holding an FSDP model and its optimizer through ``get_state_dict`` /
``set_state_dict``; saved on all ranks (1-D FSDP, or HSDP on a 2x2 mesh at 4 ranks)
and loaded at every smaller world size (FSDP over a sub-communicator), in a plain
``python`` process without a launcher (where save, async_save and no_dist are checked
too), and converted to and from ``torch.save``."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, bcast_after_rank0
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, init_device_mesh
from mpidtensor.tools import launcher
from mpidtensor.checkpoint.format_utils import torch_save_to_dcp
from mpidtensor.checkpoint.state_dict import get_state_dict, set_state_dict
from mpidtensor.checkpoint.stateful import Stateful
from mpidtensor.fsdp import fully_shard

WORLD = MPI.COMM_WORLD


class AppState(Stateful):
    """The recipes' wrapper: DCP calls state_dict() / load_state_dict() on it."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def make(mesh, seed=0):
    torch.manual_seed(seed)
    model = fully_shard(ToyModel(), mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train_step(model, optimizer, step):
    optimizer.zero_grad()
    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(step))
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    return loss.detach()


def full_state(model, optimizer) -> dict:
    """Parameters and Adam state as whole tensors (collective over the model's mesh)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().clone()
        for k, v in optimizer.state[p].items():
            out[f"{name}.{k}"] = v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
    return out


def check_state(model, optimizer, expected: dict, comm) -> None:
    actual = full_state(model, optimizer)
    ok = actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    assert_all_ranks(ok, f"{sorted(actual)} vs {sorted(expected)}", comm)


def save_mesh(kind: str):
    if kind == "hsdp":
        if WORLD.size != 4:
            pytest.skip("HSDP on a 2x2 mesh runs with 4 ranks")
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (WORLD.size,))


def sub_communicators():
    """For each size 1..N-1: the communicator of ranks 0..size-1 (COMM_NULL elsewhere)."""
    for size in range(1, WORLD.size):
        yield size, WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_getting_started_save_and_load_at_other_world_sizes(ckpt_dir, kind):
    """Saved with AppState on all ranks; loaded into a fresh FSDP model on 1..N-1 ranks
    (and on all): parameters and optimizer state equal, the next step's loss too."""
    model, optimizer = make(save_mesh(kind))
    train_step(model, optimizer, 0)
    expected = full_state(model, optimizer)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=ckpt_dir)
    next_loss = train_step(model, optimizer, 1)

    for size, comm in [*sub_communicators(), (WORLD.size, WORLD)]:
        if comm == MPI.COMM_NULL:
            assert_all_ranks(True)
            continue
        fresh, fresh_opt = make(init_device_mesh("cpu", (size,), comm=comm), seed=1)
        dcp.load({"app": AppState(fresh, fresh_opt)}, checkpoint_id=ckpt_dir, process_group=comm)
        check_state(fresh, fresh_opt, expected, comm)
        loss = train_step(fresh, fresh_opt, 1)
        ok = torch.allclose(loss, next_loss, atol=1e-5, rtol=1e-5)
        assert_all_ranks(ok, f"next loss {loss} != {next_loss} at {size} ranks", comm)
        if comm != WORLD:
            comm.Free()
        assert_all_ranks(True)


def test_async_recipe_each_checkpoint_holds_its_step(ckpt_dir):
    """The async recipe's loop: train, wait for the previous save, async_save; each
    step's checkpoint holds the state at its call, the last one is loaded elsewhere."""
    model, optimizer = make(save_mesh("fsdp"))
    future, expected = None, []
    for step in range(3):
        train_step(model, optimizer, step)
        if future is not None:
            future.result()
        expected.append(full_state(model, optimizer))
        future = dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=f"{ckpt_dir}_step{step}")
    train_step(model, optimizer, 3)  # changes the parameters while the last save may be in flight
    future.result()
    for step in range(3):
        size = max(1, WORLD.size - 1)
        comm = WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
        if comm != MPI.COMM_NULL:
            fresh, fresh_opt = make(init_device_mesh("cpu", (size,), comm=comm), seed=2)
            dcp.load({"app": AppState(fresh, fresh_opt)}, checkpoint_id=f"{ckpt_dir}_step{step}", process_group=comm)
            check_state(fresh, fresh_opt, expected[step], comm)
            comm.Free()
        assert_all_ranks(True)


PLAIN_PROCESS = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import mpidtensor.checkpoint as dcp
    from mpidtensor.checkpoint.state_dict import get_state_dict, set_state_dict
    from mpidtensor.checkpoint.stateful import Stateful
    from mpi4py import MPI
    assert MPI.COMM_WORLD.size == 1
    path, expected_path, out = sys.argv[1:4]
    expected = torch.load(expected_path)

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1, self.relu, self.net2 = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)

    class AppState(Stateful):
        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer
        def state_dict(self):
            m, o = get_state_dict(self.model, self.optimizer)
            return {"model": m, "optim": o}
        def load_state_dict(self, sd):
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    # the recipe's non-distributed load: a plain model's state_dict() as the target
    model = ToyModel()
    state_dict = {"app": {"model": model.state_dict()}}
    dcp.load(state_dict=state_dict, checkpoint_id=path)
    model.load_state_dict(state_dict["app"]["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name
    # and the whole AppState, optimizer included
    model = ToyModel()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    dcp.load({"app": AppState(model, optim)}, checkpoint_id=path)
    for name, p in model.named_parameters():
        assert torch.equal(optim.state[p]["exp_avg"], expected[name + ".exp_avg"]), name
    dcp.dcp_to_torch_save(path, out + "/plain.pt")
    from mpidtensor.checkpoint.format_utils import main  # python -m mpidtensor.checkpoint.format_utils
    assert main(["dcp_to_torch", path, out + "/cli.pt"]) == 0

    # the rest of the non-distributed mode: save, async_save (the checkpoint holds the
    # values of the call), no_dist, DTensors on a one-process mesh
    from mpi4py import MPI
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from mpidtensor import Shard, distribute_tensor, init_device_mesh
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    model = torch.nn.Linear(4, 3)
    mesh = init_device_mesh("cpu", (1,))
    state = {"model": model, "w": distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)]), "step": 7}
    dcp.save(state, checkpoint_id=out + "/sync")
    before = model.weight.detach().clone()
    future = dcp.async_save(state, checkpoint_id=out + "/async")
    with torch.no_grad():
        model.weight.add_(1)  # after the call: not in the checkpoint
    assert future.result().state_dict_metadata["step"] == BytesStorageMetadata()
    dcp.save({"x": torch.ones(2)}, out + "/nodist", no_dist=True)
    for name in ("sync", "async"):
        fresh = torch.nn.Linear(4, 3)
        target = {"model": fresh, "w": torch.zeros(3, 4), "step": 0}
        dcp.load(target, checkpoint_id=out + "/" + name)
        assert torch.equal(fresh.weight, before) and not torch.equal(model.weight, before), name
        assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4)) and target["step"] == 7, name
    target = {"x": torch.zeros(2)}
    dcp.load(target, out + "/nodist", no_dist=True)
    assert torch.equal(target["x"], torch.ones(2))
    dcp.async_save({"last": torch.ones(3)}, checkpoint_id=out + "/last")  # never waited for: done at exit
    print("plain process ok")
""")


@pytest.mark.quick_at(3)  # a fresh process importing torch; 3 ranks save uneven shards
def test_plain_process_without_launcher(ckpt_dir):
    """In ``python -c`` with no mpiexec (MPI's singleton start: a world of one process,
    MPI_THREAD_MULTIPLE): the job's checkpoint loads into a plain model (the recipe's
    non-distributed load) and with AppState, converts with dcp_to_torch_save and the
    command line's main(); save / async_save / load / no_dist work, and an async_save
    never waited for is committed before the process exits. Back in the job,
    torch_save_to_dcp's checkpoint loads sharded."""
    model, optimizer = make(save_mesh("fsdp"))
    train_step(model, optimizer, 0)
    expected = full_state(model, optimizer)
    dcp.save({"app": AppState(model, optimizer)}, ckpt_dir)
    base = os.path.dirname(ckpt_dir)
    verdict = None
    if WORLD.rank == 0:
        torch.save(expected, os.path.join(base, "expected.pt"))
        proc = subprocess.run([sys.executable, "-c", PLAIN_PROCESS, ckpt_dir, os.path.join(base, "expected.pt"), base],
                              env=launcher.nested_env(), capture_output=True, text=True, timeout=240)
        if proc.returncode != 0 or "plain process ok" not in proc.stdout:
            verdict = f"the plain process failed ({proc.returncode}): {proc.stderr[-3000:]}"
        elif not (os.path.exists(os.path.join(base, "last", "index.json"))
                  and torch.equal(dcp.load_plain(os.path.join(base, "last"))["last"], torch.ones(3))):
            verdict = "the async_save that the plain process did not wait for was not committed at its exit"
        else:
            plain, cli = (torch.load(os.path.join(base, f"{n}.pt")) for n in ("plain", "cli"))
            weight = plain["app"]["model"]["net1.weight"]
            if not (torch.equal(weight, expected["net1.weight"]) and torch.equal(cli["app"]["model"]["net1.weight"],
                                                                                 weight)):
                verdict = "the converted files do not hold the saved weights"
            torch_save_to_dcp(os.path.join(base, "cli.pt"), os.path.join(base, "back"))
    verdict = bcast_after_rank0(verdict)
    assert_all_ranks(verdict is None, verdict or "")
    fresh, fresh_opt = make(save_mesh("fsdp"), seed=3)
    dcp.load({"app": AppState(fresh, fresh_opt)}, checkpoint_id=os.path.join(base, "back"))
    check_state(fresh, fresh_opt, expected, WORLD)


WHOLE_UNDER_SWITCH = textwrap.dedent("""
import sys
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

expected = torch.load(sys.argv[3])
for path in sys.argv[1:3]:
    whole = {}
    _load_state_dict(whole, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    model, optim = whole["app"]["model"], whole["app"]["optim"]
    for name in ("net1.weight", "net1.bias", "net2.weight", "net2.bias"):
        assert type(model[name]) is torch.Tensor and torch.equal(model[name], expected[name]), (path, name)
        assert torch.equal(optim["state"][name]["exp_avg"], expected[name + ".exp_avg"]), (path, name)
print("whole ok")
""")


@pytest.mark.quick_at(3)  # a fresh process under the switch; 3 ranks save uneven shards
def test_switch_reads_checkpoint_whole_with_torch_private_loader(ckpt_dir):
    """Under the switch, one process reads a sharded checkpoint (native, and torch DCP's
    layout) whole the way torch's dcp_to_torch_save and Lightning's consolidate_checkpoint
    do: ``state_dict_loader._load_state_dict({}, FileSystemReader(dir),
    planner=format_utils._EmptyStateDictLoadPlanner(), no_dist=True)``; the tensors equal
    the saved model's and Adam state's whole tensors."""
    model, optimizer = make(save_mesh("fsdp"))
    train_step(model, optimizer, 0)
    expected = full_state(model, optimizer)
    base = os.path.dirname(ckpt_dir)
    torch_layout = os.path.join(base, "torch-layout")
    dcp.save({"app": AppState(model, optimizer)}, ckpt_dir)
    dcp.save({"app": AppState(model, optimizer)}, storage_writer=dcp.FileSystemWriter(torch_layout))
    verdict = None
    if WORLD.rank == 0:
        script, saved = os.path.join(base, "whole.py"), os.path.join(base, "expected.pt")
        torch.save(expected, saved)
        with open(script, "w") as f:
            f.write(WHOLE_UNDER_SWITCH)
        proc = subprocess.run([sys.executable, "-m", "mpidtensor.run", script, ckpt_dir, torch_layout, saved],
                              env=launcher.nested_env(), capture_output=True, text=True, timeout=240)
        if proc.returncode != 0 or "whole ok" not in proc.stdout:
            verdict = f"reading the checkpoint whole under the switch failed ({proc.returncode}): {proc.stderr[-3000:]}"
    verdict = bcast_after_rank0(verdict)
    assert_all_ranks(verdict is None, verdict or "")
