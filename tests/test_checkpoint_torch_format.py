"""torch DCP's file layout, against torch.distributed.checkpoint itself, both ways:
torch writes (its DTensors over all ranks, or one process with no_dist) and mpidtensor
reads into other layouts on meshes over fewer ranks and 2x2; mpidtensor writes from
fewer ranks and torch reads over all; model + AdamW state; a failed save keeps the
previous checkpoint; missing, corrupt and mismatching checkpoints fail on every rank."""
import os

import pytest
import torch
import torch.distributed.checkpoint as tdcp
import torch.distributed.tensor as tdt
from mpi4py import MPI
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_mesh

from helpers import assert_all_ranks, global_tensor, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.checkpoint import CheckpointError, get_state_dict, set_state_dict
from mpidtensor.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from mpidtensor.checkpoint.metadata import torch_leaves
from mpidtensor.testing.gloo import init_gloo_process_group

WORLD = MPI.COMM_WORLD
R = Replicate()
SHAPES = {"w": (13, 6), "v": (7,), "m": (5, 9)}


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed on gloo over the MPI ranks (rank 0 picks the port): torch's mesh;
    taken down after the module when it set it up (later modules may expect none)."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    init_gloo_process_group(WORLD)
    yield torch_mesh("cpu", (WORLD.size,))
    if owned:
        WORLD.Barrier()
        dist.destroy_process_group()


def sub_mesh(shape):
    """An mpidtensor mesh of ``shape`` over the first ranks (None on the others)."""
    n = 1
    for s in shape:
        n *= s
    sub = WORLD.Split(0 if WORLD.rank < n else MPI.UNDEFINED, WORLD.rank)
    if sub == MPI.COMM_NULL:
        return None
    return init_device_mesh("cpu", shape, comm=sub)


def tensors():
    return {k: global_tensor(s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}


def values():
    return {"step": 11, "names": ["a", "b"], "betas": (0.9, 0.95), "groups": [{"lr": 0.5, "ids": [1, 2]}]}


def torch_state(tmesh):
    return {"model": {k: tdt.distribute_tensor(t, tmesh, [tdt.Shard(0)]) for k, t in tensors().items()},
            "scalar": torch.tensor(2.5), **values()}


def blank_values():
    return {"step": 0, "names": [], "betas": (0, 0), "groups": [{"lr": 0.0, "ids": []}]}


def state_problem(state, what):
    """What differs from the saved state (None: nothing); collective over the state's mesh."""
    problems = []
    for k, t in tensors().items():
        got = state["model"][k]
        got = got.full_tensor() if isinstance(got, (DTensor, tdt.DTensor)) else got
        if not torch.equal(got, t):
            problems.append(k)
    if "scalar" in state and not torch.equal(state["scalar"], torch.tensor(2.5)):
        problems.append("scalar")
    problems += [k for k in values() if state[k] != values()[k]]
    return f"{what}: {problems} differ" if problems else None


def check_state(state, what):
    problem = state_problem(state, what)
    assert_all_ranks(problem is None, problem or "")


def test_flattening_matches_torch():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    state = {"a": {"b": torch.ones(2), 3: [torch.ones(1), {"c": 1}]}, "l": [1, [2, 3]], "t": (torch.ones(1), 2),
             "e": {}, "x": [[torch.ones(1)], 4]}
    flat, mapping = flatten_state_dict(state)
    leaves = torch_leaves(state)
    assert [leaf.fqn for leaf in leaves] == list(flat)
    assert {leaf.fqn: leaf.path for leaf in leaves} == mapping


def test_torch_writes_mpidtensor_reads_resharded(gloo, ckpt_dir):
    """torch saves Shard(0) DTensors over all ranks; mpidtensor reads them into other
    placements on meshes over every rank count up to the world size, and 2x2."""
    tdcp.save(torch_state(gloo), checkpoint_id=ckpt_dir)
    assert_all_ranks(FileSystemReader.recognizes(ckpt_dir), "not recognized")
    layouts = [([WORLD.size - k], [[Shard(1)], [Shard(0)], [R]]) for k in range(WORLD.size)]
    if WORLD.size == 4:
        layouts.append(([2, 2], [[Shard(1), Shard(0)], [Shard(0), Shard(0)], [R, Shard(1)]]))
    for shape, placements in layouts:
        mesh, problem = sub_mesh(shape), None
        if mesh is not None:
            state = {"model": {k: distribute_tensor(torch.zeros(t.shape), mesh, p)
                               for (k, t), p in zip(tensors().items(), placements)},
                     "scalar": torch.tensor(0.0), **blank_values()}
            FileSystemReader(ckpt_dir).read(state, mesh.comm)
            problem = state_problem(state, f"mesh {shape}")
        assert_all_ranks(problem is None, problem or "")


def test_mpidtensor_writes_torch_reads(gloo, ckpt_dir):
    """mpidtensor saves from a mesh over min(2, world) ranks (uneven Shard(1) too);
    torch reads it over all ranks into its DTensors and into plain tensors."""
    mesh = sub_mesh([min(2, WORLD.size)])
    if mesh is not None:
        placements = [[Shard(0)], [Shard(0)], [Shard(1)]]
        state = {"model": {k: distribute_tensor(t, mesh, p) for (k, t), p in zip(tensors().items(), placements)},
                 "scalar": torch.tensor(2.5), **values()}
        FileSystemWriter(ckpt_dir).write(state, mesh.comm)
    WORLD.Barrier()
    names = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(names == [".metadata"] + [f"__{r}_0.distcp" for r in range(min(2, WORLD.size))], str(names))
    sharded = {"model": {k: tdt.distribute_tensor(torch.zeros(t.shape), gloo, [tdt.Shard(0)])
                         for k, t in tensors().items()}, "scalar": torch.tensor(0.0), **blank_values()}
    tdcp.load(sharded, checkpoint_id=ckpt_dir)
    check_state(sharded, "torch DTensors")
    plain = {"model": {k: torch.zeros(t.shape) for k, t in tensors().items()}, **blank_values()}
    tdcp.load(plain, checkpoint_id=ckpt_dir)
    check_state(plain, "torch plain tensors")


def test_no_dist_torch_checkpoint(ckpt_dir):
    """torch's one-process save (no_dist=True) read into Shard(0) over all ranks."""
    if WORLD.rank == 0:
        tdcp.save({"model": tensors(), **values()}, checkpoint_id=ckpt_dir, no_dist=True)
    WORLD.Barrier()
    mesh = init_device_mesh("cpu", (WORLD.size,))
    state = {"model": {k: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(0)]) for k, t in tensors().items()},
             **blank_values()}
    FileSystemReader(ckpt_dir).read(state, WORLD)
    check_state(state, "no_dist")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1 = nn.Linear(6, 12)  # 12 rows: even Shard(0) at 1-4 ranks (torch's AdamW needs it)
        self.fc2 = nn.Linear(12, 12)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def trained(distribute, step_fn):
    """A Net whose parameters ``distribute`` made DTensors, after two AdamW steps."""
    model = Net()
    for module in (model.fc1, model.fc2):
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute(p.detach())))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):
        step_fn(model, optim, step)
    return model, optim


def _step(model, optim, step, mesh):
    gen = torch.Generator().manual_seed(step)
    x = distribute_tensor(torch.randn(4, 6, generator=gen), mesh, [R])
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad()


def _full(t):
    return t.full_tensor() if isinstance(t, (DTensor, tdt.DTensor)) else t


def test_model_and_optimizer_state_both_ways(gloo, ckpt_dir):
    """torch trains (params Shard(0) over all ranks) and saves model + AdamW state by its
    get_state_dict; mpidtensor loads on a mesh over one rank fewer (Shard(1)), goes on
    training and saves; torch loads that over all ranks: every step matches torch."""
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get, set_state_dict as torch_set

    def torch_input(x):
        return tdt.distribute_tensor(x, gloo, [tdt.Replicate()])

    def torch_step(model, optim, step):
        gen = torch.Generator().manual_seed(step)
        x = torch_input(torch.randn(4, 6, generator=gen))
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()

    model, optim = trained(lambda p: tdt.distribute_tensor(p, gloo, [tdt.Shard(0)]), torch_step)
    msd, osd = torch_get(model, optim)
    tdcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    reference = {k: _full(v).clone() for k, v in model.state_dict().items()}
    ref_state = {(n, k): _full(v).clone() for n, p in model.named_parameters()
                 for k, v in optim.state[p].items()}

    first = os.path.join(ckpt_dir, "first")
    mesh = sub_mesh([max(WORLD.size - 1, 1)])
    if mesh is not None:
        mine, my_optim = trained(lambda p: distribute_tensor(p, mesh, [Shard(1)] if p.ndim == 2 else [R]),
                                 lambda *a: None)
        m_sd, o_sd = get_state_dict(mine, my_optim)
        state = {"model": m_sd, "optim": o_sd}
        FileSystemReader(ckpt_dir).read(state, mesh.comm)
        set_state_dict(mine, my_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        ok = all(torch.equal(_full(v), reference[k]) for k, v in mine.state_dict().items())
        ok &= all(torch.equal(_full(v), ref_state[(n, k)]) for n, p in mine.named_parameters()
                  for k, v in my_optim.state[p].items())
        ok &= my_optim.param_groups[0]["lr"] == 0.1 and my_optim.param_groups[0]["betas"] == (0.9, 0.999)
        _step(mine, my_optim, 2, mesh)
        m_sd, o_sd = get_state_dict(mine, my_optim)
        FileSystemWriter(first).write({"model": m_sd, "optim": o_sd}, mesh.comm)
        after = {k: _full(v) for k, v in mine.state_dict().items()}
    else:
        ok, after = True, None
    assert_all_ranks(ok, "mpidtensor's load of torch's model + optimizer state differs")
    after = WORLD.bcast(after)

    torch_step(model, optim, 2)  # torch goes on the same way: the reference for the step
    expected = {k: _full(v).clone() for k, v in model.state_dict().items()}
    assert_all_ranks(all(torch.allclose(after[k], expected[k], atol=1e-6) for k in expected), "step 2 differs")
    fresh, fresh_optim = trained(lambda p: tdt.distribute_tensor(p, gloo, [tdt.Shard(0)]), lambda *a: None)
    msd, osd = torch_get(fresh, fresh_optim)
    tdcp.load({"model": msd, "optim": osd}, checkpoint_id=first)
    torch_set(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)
    got = {k: _full(v) for k, v in fresh.state_dict().items()}
    assert_all_ranks(all(torch.equal(got[k], after[k]) for k in after), "torch's load of mpidtensor's save differs")
    torch_step(fresh, fresh_optim, 3)
    torch_step(model, optim, 3)
    same = all(torch.allclose(_full(a), _full(b), atol=1e-6)
               for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert_all_ranks(same, "training after torch's load differs")


def test_failed_save_keeps_previous_checkpoint(ckpt_dir, monkeypatch):
    mesh = init_device_mesh("cpu", (WORLD.size,))
    state = {"model": {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in tensors().items()}, **values()}
    FileSystemWriter(ckpt_dir).write(state, WORLD)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if WORLD.rank == WORLD.size - 1:
            raise OSError("disk full")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    changed = {"model": {k: distribute_tensor(t + 1, mesh, [Shard(0)]) for k, t in tensors().items()}, **values()}
    raises_everywhere(OSError, lambda: FileSystemWriter(ckpt_dir).write(changed, WORLD), "disk full")
    monkeypatch.undo()
    target = {"model": {k: torch.zeros(t.shape) for k, t in tensors().items()}, **blank_values()}
    FileSystemReader(ckpt_dir).read(target, WORLD)
    check_state(target, "previous checkpoint")
    FileSystemWriter(ckpt_dir).write(changed, WORLD)  # a good save replaces it and its files
    WORLD.Barrier()
    names = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(names == [".metadata"] + sorted(f"__{r}_1.distcp" for r in range(WORLD.size)), str(names))


def _saved(ckpt_dir):
    mesh = init_device_mesh("cpu", (WORLD.size,))
    state = {"model": {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in tensors().items()}, **values()}
    FileSystemWriter(ckpt_dir).write(state, WORLD)
    return {"model": {k: torch.zeros(t.shape) for k, t in tensors().items()}, **blank_values()}


def test_missing_metadata(ckpt_dir):
    target = _saved(ckpt_dir)
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.remove(os.path.join(ckpt_dir, ".metadata"))
    WORLD.Barrier()
    raises_everywhere(FileNotFoundError, lambda: FileSystemReader(ckpt_dir).read(target, WORLD), ".metadata")
    assert_all_ranks(not FileSystemReader.recognizes(ckpt_dir))


@pytest.mark.parametrize("damage", ["garbage", "truncate", "remove", "metadata"])
def test_damaged_files(ckpt_dir, damage):
    target = _saved(ckpt_dir)
    WORLD.Barrier()
    victim = os.path.join(ckpt_dir, ".metadata" if damage == "metadata" else "__0_0.distcp")
    if WORLD.rank == 0:
        if damage == "garbage":  # the first chunk's torch.save archive, past the values
            info = tdcp.FileSystemReader(ckpt_dir).read_metadata().storage_data
            offset = next(i.offset for k, i in info.items() if k.fqn == "model.w")
            with open(victim, "r+b") as f:
                f.seek(offset)
                f.write(b"\x00garbage" * 8)
        elif damage == "truncate":
            os.truncate(victim, os.path.getsize(victim) // 2)
        elif damage == "remove":
            os.remove(victim)
        else:
            os.truncate(victim, 20)
    WORLD.Barrier()
    exc = FileNotFoundError if damage == "remove" else CheckpointError
    raises_everywhere(exc, lambda: FileSystemReader(ckpt_dir).read(target, WORLD), victim)


@pytest.mark.parametrize("problem", ["missing", "shape", "dtype", "kind"])
def test_mismatching_target(ckpt_dir, problem):
    target = _saved(ckpt_dir)
    expected = {"missing": "missing key 'model.extra'", "shape": "shape mismatch for 'model.v'",
                "dtype": "dtype mismatch for 'model.w'", "kind": "'step' is a tensor"}[problem]
    if problem == "missing":
        target["model"]["extra"] = torch.zeros(2)
    elif problem == "shape":
        target["model"]["v"] = torch.zeros(8)
    elif problem == "dtype":
        target["model"]["w"] = torch.zeros(SHAPES["w"], dtype=torch.float64)
    else:
        target["step"] = torch.zeros(1)
    raises_everywhere(CheckpointError, lambda: FileSystemReader(ckpt_dir).read(target, WORLD), expected)


def test_through_save_and_load(gloo, ckpt_dir):
    """``checkpoint.load(checkpoint_id=...)`` finds torch's layout on its own; ``save``
    with ``storage_writer=FileSystemWriter`` goes back to torch."""
    import mpidtensor.checkpoint as dcp

    tdcp.save(torch_state(gloo), checkpoint_id=ckpt_dir)
    mesh = init_device_mesh("cpu", (WORLD.size,))
    state = {"model": {k: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(t.ndim - 1)])
                       for k, t in tensors().items()}, "scalar": torch.tensor(0.0), **blank_values()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    check_state(state, "load")
    back = os.path.join(ckpt_dir, "back")
    dcp.save(state, storage_writer=FileSystemWriter(back))
    target = {"model": {k: torch.zeros(t.shape) for k, t in tensors().items()}, **blank_values()}
    tdcp.load(target, checkpoint_id=back)
    check_state(target, "torch's load")


def test_torch_safetensors_shards_both_ways(gloo, ckpt_dir):
    """torch's HuggingFaceStorageWriter(save_distributed=True) shard files (offsets in
    the header metadata) read here into Shard(1); mpidtensor's read by torch's reader."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchHFReader
    from torch.distributed.checkpoint import HuggingFaceStorageWriter as TorchHFWriter

    from mpidtensor.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

    torch_sd = {k: tdt.distribute_tensor(t, gloo, [tdt.Shard(0)]) for k, t in tensors().items()}
    tdcp.save(torch_sd, storage_writer=TorchHFWriter(ckpt_dir, save_distributed=True))
    mesh = init_device_mesh("cpu", (WORLD.size,))
    state = {"model": {k: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(t.ndim - 1)])
                       for k, t in tensors().items()}}
    HuggingFaceStorageReader(ckpt_dir).read(state["model"], WORLD)
    check_state({**state, **values()}, "torch's shard files")
    mine = os.path.join(ckpt_dir, "mine")
    HuggingFaceStorageWriter(mine, save_distributed=True).write(state["model"], WORLD)
    target = {"model": {k: tdt.distribute_tensor(torch.zeros(t.shape), gloo, [tdt.Shard(0)])
                        for k, t in tensors().items()}}
    tdcp.load(target["model"], storage_reader=TorchHFReader(mine))
    check_state({**target, **values()}, "torch's read of mpidtensor's shard files")
