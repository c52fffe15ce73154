"""The torch.distributed switch (``python -m mpidtensor.run``, ``mpidtensor.compat``).

In process: under the import hook, user code's imports of torch's distributed modules
give mpidtensor's, while ``sys.modules`` and torch's own code keep torch's (torch's
DTensor still works, ``nn.Parameter`` of either kind too); names mpidtensor lacks raise
``NotImplementedError`` naming them; the MPI backend's ``PREMUL_SUM``, point-to-point,
``reduce``/``gather``/``scatter`` and ``init_process_group`` with any backend name.

Sub-jobs: the unmodified torch-only programs of ``tests/programs/`` (written after
pytorch/examples' tensor-parallel, sequence-parallel and FSDP2 examples and PyTorch's
distributed-checkpoint tutorial) under ``mpiexec -n N python -m mpidtensor.run``, their
printed losses compared with the same program on torch's gloo at N ranks
(``programs/torch_gloo.py`` sets the launcher variables from MPI), or, for FSDP2 with
meta-device init, with the switch at one rank: on CPU torch initialises each shard of a
meta-built model from its rank's own generator (its DTensor RNG tracker is off there), so
torch at N ranks differs from one process, while mpidtensor's random ops give the same
global tensor on any layout.
"""
from __future__ import annotations

import importlib
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn as nn
from mpi4py import MPI

import mpidtensor
from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.backend import distributed as switch_dist, mesh_groups, rendezvous
from mpidtensor.compat import importer, views
from mpidtensor.runtime.settings import settings
from subjob import run_command, run_peer

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank
PROGRAMS = Path(__file__).parent / "programs"


@pytest.fixture
def switched():
    """The import hook and the ``torch.distributed`` overrides for one test (the switch
    proper is for a whole program; here the hook must not outlive the test: the views stay,
    unreachable without it)."""
    views.override("torch.distributed", switch_dist.OVERRIDES)
    importer.install()
    yield
    importer.uninstall()


def test_user_imports_get_mpidtensor(switched):
    import importlib as user_importlib

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.tensor
    from torch.distributed import fsdp
    from torch.distributed._composable.fsdp import fully_shard as old_fully_shard
    from torch.distributed._tensor import DTensor as OldDTensor
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import Replicate

    expected = {
        "DTensor": (DTensor, mpidtensor.DTensor), "old DTensor": (OldDTensor, mpidtensor.DTensor),
        "Shard": (Shard, mpidtensor.Shard), "Replicate": (Replicate, mpidtensor.Replicate),
        "distribute_tensor": (distribute_tensor, mpidtensor.distribute_tensor),
        "dcp.save": (dcp.save, mpidtensor.checkpoint.save),
        "fsdp.fully_shard": (fsdp.fully_shard, mpidtensor.fsdp.fully_shard),
        "old fully_shard": (old_fully_shard, mpidtensor.fsdp.fully_shard),
        "get_model_state_dict": (get_model_state_dict, mpidtensor.checkpoint.get_model_state_dict),
        "init_device_mesh": (init_device_mesh, mpidtensor.init_device_mesh),
        "DeviceMesh": (DeviceMesh, mpidtensor.DeviceMesh),
        "CommDebugMode": (CommDebugMode, mpidtensor.debug.CommDebugMode),
        "ColwiseParallel": (ColwiseParallel, mpidtensor.parallel.ColwiseParallel),
        "dist.fsdp": (dist.fsdp.fully_shard, mpidtensor.fsdp.fully_shard),
        "torch.distributed.tensor.DTensor": (torch.distributed.tensor.DTensor, mpidtensor.DTensor),
        "import_module": (user_importlib.import_module("torch.distributed.fsdp").fully_shard,
                          mpidtensor.fsdp.fully_shard),
        "dist.init_process_group": (dist.init_process_group, switch_dist.init_process_group),
        "torch.nn (not aliased)": (torch.nn, nn),
        "dist.all_gather_object (torch's)": (dist.all_gather_object, torch_dist.all_gather_object),
        "dist.all_reduce (mesh groups too)": (dist.all_reduce, mesh_groups.all_reduce),
        "dist.all_to_all_single (mesh groups too)": (dist.all_to_all_single, mesh_groups.all_to_all_single),
    }
    import torch.distributed.pipelining as pipelining  # mpidtensor's once it exists, until then torch's

    try:
        user_importlib.import_module("mpidtensor.pipelining")
        expected["pipelining"] = (pipelining.__alias_of__, "mpidtensor.pipelining")
    except ModuleNotFoundError:
        expected["pipelining"] = (pipelining, sys.modules["torch.distributed.pipelining"])
    wrong = [name for name, (got, want) in expected.items() if got is not want and got != want]
    assert_all_ranks(not wrong, f"not mpidtensor's under the switch: {wrong}")


def test_torch_internals_keep_torch(switched, mpi_group, mesh1d):
    """sys.modules and modules under torch / mpidtensor keep torch's modules; both kinds of
    DTensor work side by side, ``nn.Parameter`` of each included (torch's C++ reads
    ``torch.distributed.tensor.DTensor._op_dispatcher`` by module path)."""
    torch_dtensor_class = sys.modules["torch.distributed.tensor"].DTensor
    problems = []
    if torch_dtensor_class is mpidtensor.DTensor or not torch_dtensor_class.__module__.startswith("torch."):
        problems.append(f"sys.modules holds {torch_dtensor_class}")
    for importer_name in ("torch.distributed.fake", "mpidtensor.fake"):
        space = {"__name__": importer_name}
        exec("from torch.distributed.tensor import DTensor", space)
        if space["DTensor"] is not torch_dtensor_class:
            problems.append(f"{importer_name} got {space['DTensor']}")
    mine = nn.Parameter(mpidtensor.distribute_tensor(torch.arange(2.0 * N), mesh1d, [mpidtensor.Shard(0)]))
    if type(mine) is not mpidtensor.DTensor or not torch.equal(mine.full_tensor(), torch.arange(2.0 * N)):
        problems.append(f"nn.Parameter(mpidtensor DTensor): {type(mine)}")
    from torch.distributed.tensor import DTensor as Mine

    torch_mesh = sys.modules["torch.distributed.device_mesh"].init_device_mesh("cpu", (N,))
    theirs = nn.Parameter(torch_dtensor_class.from_local(torch.full((2,), float(RANK)), torch_mesh,
                                                         [sys.modules["torch.distributed.tensor"].Shard(0)]))
    if type(theirs) is not torch_dtensor_class or isinstance(theirs, Mine):
        problems.append(f"nn.Parameter(torch DTensor): {type(theirs)}")
    doubled = theirs * 2  # through torch's C++ DTensor dispatcher (no collective: the MPI backend, a Python
    # ProcessGroup, is reached by torch's functional collectives only where torch lets Python override them)
    if type(doubled) is not torch_dtensor_class or not torch.equal(doubled.to_local(), torch.full((2,), 2.0 * RANK)):
        problems.append(f"torch's DTensor computed wrongly: {doubled}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_what_mpidtensor_lacks_raises_naming_it(switched):
    from torch.distributed.checkpoint import save_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    raises_everywhere(NotImplementedError, lambda: FullyShardedDataParallel(nn.Linear(2, 2)),
                      "torch.distributed.fsdp.FullyShardedDataParallel is not provided by mpidtensor")
    raises_everywhere(NotImplementedError, lambda: ShardingStrategy.FULL_SHARD, "torch.distributed.fsdp.ShardingStrategy")
    raises_everywhere(NotImplementedError, lambda: save_state_dict({}), "torch.distributed.checkpoint.save_state_dict")

    def import_absent():
        from torch.distributed.tensor import no_such_name  # noqa: F401

    raises_everywhere(ImportError, import_absent, "no_such_name")
    raises_everywhere(AttributeError, lambda: importlib.import_module("mpidtensor").no_such_name, "no_such_name")


def test_kept_torch_objects_are_torch_own(switched):
    """What mpidtensor lacks but runs no collective is torch's own under the switch:
    ``OptimStateKeyType`` and FSDP1's static ``rekey_optim_state_dict`` (Lightning's Trainer
    re-keys its full optimizer state with them), while ``FullyShardedDataParallel`` itself
    still refuses. Re-keyed to ids and back, a plain model's state dict is the same."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType

    torch_fsdp = sys.modules["torch.distributed.fsdp.fully_sharded_data_parallel"]
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    osd = {"state": {"0.weight": {"step": torch.tensor(1.0)}},
           "param_groups": [{"lr": 0.1, "params": ["0.weight", "0.bias", "1.weight", "1.bias"]}]}
    by_id = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, model)
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    assert_all_ranks(OptimStateKeyType is torch_fsdp.OptimStateKeyType
                     and FSDP.rekey_optim_state_dict is torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict
                     and by_id["param_groups"][0]["params"] == [0, 1, 2, 3] and list(by_id["state"]) == [0]
                     and sorted(back["param_groups"][0]["params"]) == sorted(osd["param_groups"][0]["params"]))
    raises_everywhere(NotImplementedError, lambda: FSDP(nn.Linear(2, 2)), "FullyShardedDataParallel is not provided")
    raises_everywhere(NotImplementedError, lambda: FSDP.state_dict_type, "FullyShardedDataParallel is not provided")


def test_init_optim_state_is_torch_own(switched, mesh1d):
    """torch's private ``checkpoint.state_dict._init_optim_state`` (torchtune 0.6.1 calls it
    before loading a full optimizer state) runs no collective: under the switch it is torch's
    own, and on sharded parameters it creates AdamW's state in their layout, leaving the
    parameters unchanged and no gradients."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    weight = nn.Parameter(distribute_tensor(torch.randn(2 * N, 3), mesh1d, [Shard(0)]))
    before = weight.full_tensor().clone()
    optim = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.1)
    try:
        _init_optim_state(optim)
        state = optim.state[weight]
        problem = None
        if _init_optim_state is not sys.modules["torch.distributed.checkpoint.state_dict"]._init_optim_state:
            problem = f"not torch's own: {_init_optim_state}"
        elif not (isinstance(state["exp_avg"], mpidtensor.DTensor) and state["exp_avg"].placements == (Shard(0),)):
            problem = f"exp_avg: {type(state['exp_avg'])}"
        elif weight.grad is not None or not torch.equal(weight.full_tensor(), before) or optim.param_groups[0]["lr"] != 0.1:
            problem = "the parameter, its gradient or the learning rate changed"
    except Exception as err:  # noqa: BLE001 (reported on every rank)
        problem = f"{type(err).__name__}: {err}"
    assert_all_ranks(problem is None, problem or "")


def test_compile_through_the_torch_proxy(switched):
    """``import torch.x`` in user code binds the proxy of ``torch``: a plain module that
    torch.compile traces through."""
    space = {"__name__": "user_program"}
    exec("import torch.distributed.tensor\ndef f(x):\n    return torch.sin(x) * 2 + torch.ones_like(x)", space)
    compiled = torch.compile(space["f"], backend="eager")
    x = torch.linspace(0, 1, 5)
    assert_all_ranks(space["torch"] is not torch and torch.equal(compiled(x), torch.sin(x) * 2 + 1))


def test_init_process_group_with_any_backend(switched):
    import torch.distributed as dist

    if torch_dist.is_initialized():
        pytest.fail("a torch.distributed group is already up")
    problems = []
    forms = [dict(backend="nccl"), dict(backend="gloo", init_method="tcp://127.0.0.1:1"),
             dict(backend="cpu:gloo,cuda:nccl", world_size=N, rank=RANK), dict(),
             dict(backend=None, store=torch_dist.HashStore(), timeout=__import__("datetime").timedelta(seconds=5))]
    with settings.override(timeout=settings.timeout):  # the form with a timeout sets the watchdog's
        for form in forms:
            dist.init_process_group(**form)
            t = torch.ones(1)
            dist.all_reduce(t)
            if (dist.get_world_size(), dist.get_rank(), dist.get_backend(), t.item()) != (N, RANK, "mpidtensor", N):
                problems.append(f"{form}: {dist.get_world_size()} ranks, backend {dist.get_backend()}, sum {t.item()}")
            if "timeout" in form and settings.timeout != 5.0:
                problems.append(f"init_process_group(timeout=5 s) left the watchdog's at {settings.timeout}")
            dist.destroy_process_group()
    assert_all_ranks(not problems, "; ".join(problems))
    raises_everywhere(ValueError, lambda: dist.init_process_group("nccl", world_size=N + 1), f"world_size={N + 1}")
    if N > 1:
        raises_everywhere(ValueError, lambda: dist.init_process_group(rank=1 if RANK == 0 else RANK), "rank=1")
    assert_all_ranks(not torch_dist.is_initialized(), "a group was made despite the error")


def test_collectives_on_a_mesh_group(switched, mpi_group, mesh1d):
    """torch.distributed's c10d calls given ``mesh.get_group()`` (an MPI communicator under
    the switch; torchtitan's ``clip_grad_norm_`` passes its pp mesh's): the values torch
    gives, in place, ``async_op`` works returned, ``src`` a global rank; the default group
    still goes to torch's backend."""
    import torch.distributed as dist

    group = mesh1d.get_group()
    n, r = WORLD.size, WORLD.rank
    problems = []
    t = torch.tensor([float(r + 1), 2.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() != [float(n), 2.0]:
        problems.append(f"all_reduce max {t.tolist()}")
    t = torch.tensor([float(r + 1)])
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    if t.item() != n * (n + 1) / 2:
        problems.append(f"all_reduce sum {t.item()}")
    t = torch.full((3,), float(r))
    dist.broadcast(t, src=n - 1, group=group)
    if t.tolist() != [float(n - 1)] * 3:
        problems.append(f"broadcast {t.tolist()}")
    out = torch.empty(n, 2)
    dist.all_gather_into_tensor(out, torch.tensor([float(r), -float(r)]), group=group)
    if out[:, 0].tolist() != [float(i) for i in range(n)]:
        problems.append(f"all_gather_into_tensor {out.tolist()}")
    pieces = [torch.empty(1) for _ in range(n)]
    dist.all_gather(pieces, torch.tensor([float(r)]), group=group)
    if [p.item() for p in pieces] != list(range(n)):
        problems.append(f"all_gather {pieces}")
    got = torch.empty(2)
    dist.reduce_scatter_tensor(got, torch.arange(2.0 * n), group=group)
    if got.tolist() != [n * 2.0 * r, n * (2.0 * r + 1)]:
        problems.append(f"reduce_scatter_tensor {got.tolist()}")
    dist.barrier(group=group)
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the default group: torch's function, the MPI backend
    if t.item() != n:
        problems.append(f"default group {t.item()}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_launcher_environment():
    found = rendezvous.launcher_environment()
    seen = WORLD.allgather((found["MASTER_ADDR"], found["MASTER_PORT"]))
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    want = {"RANK": str(RANK), "WORLD_SIZE": str(N), "LOCAL_RANK": str(node.rank), "LOCAL_WORLD_SIZE": str(node.size)}
    node.Free()
    wrong = {k: (found[k], v) for k, v in want.items() if found[k] != v}
    assert_all_ranks(not wrong and len(set(seen)) == 1 and int(found["MASTER_PORT"]) > 0, f"{wrong} {seen}")


def test_backend_premul_sum_p2p_and_rooted(switched, mpi_group):
    import torch.distributed as dist

    bad = []

    def check(name, got, want):
        if not torch.allclose(torch.as_tensor(got), torch.as_tensor(want)):
            bad.append(f"{name}: {got} != {want}")

    t = torch.full((3,), RANK + 1.0)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    check("all_reduce premul_sum", t, torch.full((3,), 0.5 * N * (N + 1) / 2))
    t = torch.full((2,), RANK + 1.0, dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.25])))
    check("all_reduce premul_sum bf16, tensor factor", t.float(), torch.full((2,), 0.25 * N * (N + 1) / 2))
    out = torch.zeros(2)
    dist.reduce_scatter_single(out, torch.arange(2.0 * N), op=dist._make_nccl_premul_sum(1.0 / N))
    check("reduce_scatter_single premul_sum", out, torch.arange(2.0 * RANK, 2.0 * RANK + 2))
    # point-to-point: a ring both ways at once (non-blocking), an odd size, a non-contiguous receiver
    send = torch.arange(1001.0) + RANK
    into = torch.zeros(1001, 2)[:, 0]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (RANK + 1) % N),
                                    dist.P2POp(dist.irecv, into, (RANK - 1) % N)])
    for work in works:
        work.wait()
    check("batch_isend_irecv ring", into, torch.arange(1001.0) + (RANK - 1) % N)
    if N > 1 and RANK < 2:
        got = torch.zeros(3)
        if RANK == 0:
            dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1)
            dist.recv(got, src=1)
        else:
            dist.recv(got, src=0)
            dist.send(got * 2, dst=0)
        check("send/recv", got, torch.tensor([1.0, 2.0, 3.0]) * (2 if RANK == 0 else 1))
    root = N - 1
    pieces = [torch.zeros(2) for _ in range(N)] if RANK == root else None
    dist.gather(torch.full((2,), float(RANK)), pieces, dst=root)
    if RANK == root:
        check("gather", torch.stack(pieces), torch.arange(float(N)).repeat_interleave(2).view(N, 2))
    mine = torch.zeros(3)
    dist.scatter(mine, [torch.full((3,), 10.0 + k) for k in range(N)] if RANK == root else None, src=root)
    check("scatter", mine, torch.full((3,), 10.0 + RANK))
    t = torch.tensor([RANK + 1.0])
    dist.reduce(t, dst=0)
    if RANK == 0:
        check("reduce", t, torch.tensor([N * (N + 1) / 2]))
    outs = [torch.zeros(1) for _ in range(N)]
    dist.all_to_all(outs, [torch.tensor([10.0 * RANK + k]) for k in range(N)])
    check("all_to_all", torch.cat(outs), 10.0 * torch.arange(float(N)) + RANK)
    assert_all_ranks(not bad, "; ".join(bad))


# --- unmodified programs in sub-jobs -----------------------------------------------------------
def _figures(output: str) -> dict[str, float]:
    """The ``LOSS step value`` and ``CHECKSUM value`` lines a program printed."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^((?:LOSS \d+)|CHECKSUM) (\S+)$", output, re.M)}


def _switch(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "mpidtensor.run", str(PROGRAMS / script), *args]


def _gloo(script: str, *args: str) -> list[str]:
    return [sys.executable, str(PROGRAMS / "torch_gloo.py"), str(PROGRAMS / script), *args]


# (case, program under the switch, reference, reference's ranks: None = N). The programs get
# "--backend nccl" / "--device cpu" through their own arguments where they take one.
CASES = {
    "tensor_parallel": (_switch("tp_example.py", "--iters", "4"), _gloo("tp_example.py", "--iters", "4"), None),
    "tensor_parallel_as_module": ([sys.executable, "-m", "mpidtensor.run", "-m", "tp_example", "--iters", "2"],
                                  _gloo("tp_example.py", "--iters", "2"), None),
    "sequence_parallel": (_switch("sp_example.py", "--iters", "4"), _gloo("sp_example.py", "--iters", "4"), None),
    "fsdp2_cpu_init_bf16": (_switch("fsdp2_example.py", "--backend", "nccl", "--cpu-init", "--mixed-precision"),
                            _gloo("fsdp2_example.py", "--cpu-init", "--mixed-precision"), None),
    "fsdp2_meta_init": (_switch("fsdp2_example.py", "--backend", "nccl"),
                        _switch("fsdp2_example.py", "--backend", "nccl"), 1),
    "dcp_tutorial": (_switch("dcp_example.py", "{dir}/switch", "--backend", "cpu:gloo,cuda:nccl"),
                     _gloo("dcp_example.py", "{dir}/gloo"), None),
}


@pytest.mark.timeout(900)  # sub-jobs of up to 4 ranks on shared cores: minutes each
@pytest.mark.quick_at(2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_unmodified_program(case):
    ours, reference, reference_ranks = CASES[case]
    if reference_ranks == N:
        pytest.skip(f"the reference is this program at {N} rank(s)")
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpidtensor-switch-") if RANK == 0 else None)
    ours, reference = ([a.replace("{dir}", folder) for a in argv] for argv in (ours, reference))
    start = time.monotonic()
    ran = run_command(ours, ranks=N, timeout=400, cwd=PROGRAMS)
    on_torch = str(PROGRAMS / "torch_gloo.py") in reference  # torch's gloo: a peer, retried once if it fails
    peer = (run_peer if on_torch else run_command)(reference, ranks=reference_ranks or N, timeout=400, cwd=PROGRAMS)
    status, output, ref_status, ref_output = ran.returncode, ran.output, peer.returncode, peer.output
    got, want = _figures(output), _figures(ref_output)
    problems = []
    if status != 0 or ref_status != 0:
        problems.append(f"exit {status} / reference {ref_status} after {time.monotonic() - start:.0f} s:\n"
                        f"{output[-3000:]}\n--- reference:\n{ref_output[-3000:]}")
    elif not want or got.keys() != want.keys():
        problems.append(f"figures {sorted(got)} against {sorted(want)}:\n{output[-2000:]}")
    else:
        problems += [f"{k}: {got[k]} != {want[k]}" for k in want
                     if not math.isclose(got[k], want[k], rel_tol=1e-5, abs_tol=1e-5)]
    assert_all_ranks(not problems, "; ".join(problems))
