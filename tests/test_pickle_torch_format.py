"""DTensors in torch's pickle format: what ``torch.save`` writes under the switch
(:mod:`mpidtensor.compat.serialization`, :mod:`mpidtensor.tensor.torch_format`).

The file names only torch's classes; a plain torch process (no mpidtensor, no MPI) loads it
with ``torch.load(weights_only=True)`` after ``import torch.distributed.tensor`` (this rank's
local tensor, placements and global shape) and without the import fails with torch's own
message. Loaded back by mpidtensor (the switch's ``torch.load``, both unpicklers) it is
mpidtensor's DTensor on the live mesh, bit-equal; a mesh torch saved maps to the program's
root mesh; files in mpidtensor's own format still load.
"""
import io
import os
import pickletools
import sys
import zipfile

import pytest
import torch
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.compat import serialization
from mpidtensor.tensor import torch_format
from mpidtensor.tensor.placements import _StridedShard
from subjob import run_command
from test_pickle import mesh3d, same_dtensor  # noqa: F401  (mesh3d: a fixture)

WORLD = MPI.COMM_WORLD


def round_trip(obj, weights_only: bool):
    """``obj`` through the switch's ``torch.save`` and ``torch.load`` in memory."""
    buf = io.BytesIO()
    serialization.save(obj, buf)
    buf.seek(0)
    return serialization.load(buf, weights_only=weights_only)


def pickled_globals(obj) -> set[str]:
    """The global names in the pickle the switch's ``torch.save`` writes for ``obj``."""
    buf = io.BytesIO()
    serialization.save(obj, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return {arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}


def dtensor(full: torch.Tensor, mesh, placements) -> DTensor:
    """``full`` laid out as ``placements``; a Partial holds rank-dependent terms."""
    if not any(isinstance(p, Partial) for p in placements):
        return distribute_tensor(full, mesh, placements)
    base = distribute_tensor(full, mesh, [Replicate() if isinstance(p, Partial) else p for p in placements])
    return DTensor.from_local(base.to_local() * (WORLD.rank + 1), mesh, placements, shape=full.shape,
                              stride=full.stride())


PLACEMENTS = [Shard(0), Shard(-1), Replicate(), Partial(), Partial("max"), _StridedShard(0, split_factor=2)]


def test_the_file_names_only_torch(mesh1d):
    tensors = [dtensor(global_tensor((7, 5)), mesh1d, [p]) for p in PLACEMENTS]
    names = pickled_globals({"tensors": tensors, "param": nn.Parameter(tensors[0])})
    ours = sorted(n for n in names if "mpidtensor" in n)
    assert_all_ranks(not ours and "torch.distributed.tensor DTensor" in names, f"{ours}; {sorted(names)}")


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("shape", [(7, 5), (3,)], ids=str)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=repr)
def test_round_trip_1d(mesh1d, placement, shape, weights_only):
    x = dtensor(global_tensor(shape), mesh1d, [placement])
    loaded = round_trip({"x": x, "again": x}, weights_only)
    problem = same_dtensor(loaded["x"], x)
    assert_all_ranks(problem is None and loaded["again"] is loaded["x"], f"{problem}; one object stays one")
    assert_all_ranks(torch.equal(loaded["x"].full_tensor(), x.full_tensor()), "full tensors differ")


def test_sub_and_flattened_meshes(mesh3d):  # noqa: F811
    derived = {"dp": mesh3d["dp"], "tp": mesh3d["tp"], "dp,tp": mesh3d["dp", "tp"],
               "dp_cp": mesh3d["dp", "cp"]._flatten("dp_cp"), "whole": mesh3d}
    full = global_tensor((9, 5))
    tensors = {name: dtensor(full, m, [Shard(0)] + [Partial()] * (m.ndim - 1)) for name, m in derived.items()}
    for weights_only in (False, True):
        loaded = round_trip(tensors, weights_only)
        problems = {name: same_dtensor(loaded[name], x) for name, x in tensors.items()}
        problems = {name: p for name, p in problems.items() if p}
        assert_all_ranks(not problems, f"weights_only={weights_only}: {problems}")


def test_parameters_and_grad_flags(mesh1d):
    full = global_tensor((6, 4))
    param = nn.Parameter(distribute_tensor(full, mesh1d, [Shard(0)]))
    param.extra = "kept"
    frozen = distribute_tensor(full, mesh1d, [Replicate()])
    for weights_only in (False, True):
        loaded = round_trip({"param": param, "frozen": frozen}, weights_only)
        p, f = loaded["param"], loaded["frozen"]
        problems = [x for x in (same_dtensor(p, param), same_dtensor(f, frozen)) if x]
        ok = isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad and p.extra == "kept"
        assert_all_ranks(ok and not f.requires_grad and not problems, f"{type(p)} {p.requires_grad}; {problems}")


def test_files_in_mpidtensors_format_still_load(mesh1d):
    x = dtensor(global_tensor((5, 3)), mesh1d, [Shard(0)])
    buf = io.BytesIO()
    torch.save({"x": x}, buf)  # outside the switch: mpidtensor's format, as files written before
    names = pickled_globals(x)
    for weights_only in (False, True):
        buf.seek(0)
        problem = same_dtensor(serialization.load(buf, weights_only=weights_only)["x"], x)
        assert_all_ranks(problem is None, f"weights_only={weights_only}: {problem}")
    buf.seek(0)
    assert_all_ranks(b"mpidtensor" in buf.getvalue() and not any("mpidtensor" in n for n in names),
                     "torch.save outside the switch keeps mpidtensor's format; the switch's save does not")


def test_a_mesh_torch_saved_maps_to_the_root(mesh1d, monkeypatch):
    """A torch mesh without mpidtensor's description: the program's root of its ranks and names."""
    made = torch_format._torch_mesh

    def as_torch_saves_it(mesh):
        torch_mesh = made(mesh)
        del torch_mesh._mpidtensor_mesh
        return torch_mesh

    monkeypatch.setattr(torch_format, "_torch_mesh", as_torch_saves_it)
    full = global_tensor((7, 3))
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    for weights_only in (False, True):
        loaded = round_trip(x, weights_only)
        ok = type(loaded) is DTensor and loaded.device_mesh == mesh1d and loaded.placements == x.placements
        assert_all_ranks(ok and torch.equal(loaded.full_tensor(), full), f"{loaded!r:.300}")


# --- a program under the switch, its files loaded by plain torch ---------------------------------
SWITCH_PROGRAM = """
import sys
import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor, init_device_mesh

out, world = sys.argv[1], torch.distributed.get_world_size()
rank = torch.distributed.get_rank()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
full = torch.arange(35.0).reshape(7, 5)
x = distribute_tensor(full, mesh, [Shard(0)])
p = DTensor.from_local(torch.ones(2, 3) * (rank + 1), mesh, [Partial()])
torch.save({"x": x, "p": p}, f"{out}/rank{rank}.pt")
torch.save({"local": x.to_local()}, f"{out}/local{rank}.pt")
for weights_only in (False, True):
    back = torch.load(f"{out}/rank{rank}.pt", weights_only=weights_only)
    y = back["x"]
    ok = (type(y).__module__.startswith("mpidtensor") and torch.equal(y.full_tensor(), full)
          and y.device_mesh is mesh and torch.equal(back["p"].full_tensor(), p.full_tensor()))
    print(f"rank {rank} weights_only={weights_only} loaded ok={ok}", flush=True)
"""

PLAIN_LOAD = """
import sys
import torch
if sys.argv[3] == "import":
    import torch.distributed.tensor
out, world = sys.argv[1], int(sys.argv[2])
assert "mpidtensor" not in sys.modules and "mpi4py" not in sys.modules
for rank in range(world):
    try:
        state = torch.load(f"{out}/rank{rank}.pt", weights_only=True)
    except Exception as err:
        print(f"rank {rank} {type(err).__name__}: {err}".splitlines()[0], flush=True)
        continue
    x, p, local = state["x"], state["p"], torch.load(f"{out}/local{rank}.pt")["local"]
    ok = (type(x).__module__ == "torch.distributed.tensor" and torch.equal(x.to_local(), local)
          and x.shape == (7, 5) and str(x.placements) == "(Shard(dim=0),)"
          and x.device_mesh.mesh.tolist() == list(range(world)) and x.device_mesh.mesh_dim_names == ("dp",)
          and torch.equal(p.to_local(), torch.ones(2, 3) * (rank + 1)) and p.placements[0].is_partial())
    print(f"rank {rank} plain torch ok={ok}", flush=True)
"""


@pytest.mark.quick_at(2)  # separate jobs: the same at every size
def test_saved_under_the_switch_loads_in_plain_torch(ckpt_dir, tmp_path):
    os.makedirs(ckpt_dir, exist_ok=True)
    program, loader = tmp_path / "program.py", tmp_path / "plain_load.py"
    if WORLD.rank == 0:
        program.write_text(SWITCH_PROGRAM)
        loader.write_text(PLAIN_LOAD)
    WORLD.Barrier()
    size = WORLD.size
    result = run_command([sys.executable, "-m", "mpidtensor.run", str(program), ckpt_dir], ranks=size, timeout=300)
    want = [f"rank {r} weights_only={w} loaded ok=True" for r in range(size) for w in (False, True)]
    missing = [w for w in want if w not in result.output]
    assert_all_ranks(result.returncode == 0 and not missing, f"{missing}\n{result.output[-3000:]}")
    for how in ("import", "no-import"):
        result = run_command([sys.executable, str(loader), ckpt_dir, str(size), how], ranks=None, timeout=300)
        want = [f"rank {r} plain torch ok=True" if how == "import" else
                f"rank {r} UnpicklingError: Weights only load failed. ``torch.distributed.tensor`` must be "
                f"imported to load DTensors" for r in range(size)]
        missing = [w for w in want if w not in result.output]
        assert_all_ranks(result.returncode == 0 and not missing, f"{how}: {missing}\n{result.output[-3000:]}")
