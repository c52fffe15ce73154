"""Pickling DTensors, meshes and placements, as torch's pickle (``torch.save`` per rank).

A round trip gives a DTensor on the live mesh (the same object), bit-equal, with its
placements, global shape and stride; sub-meshes, flattened and unflattened meshes come back
as the program's own; a mesh the program no longer holds is rebuilt; ``nn.Parameter`` stays
a Parameter. An FSDP x TP model's ``state_dict`` saved per rank resumes training exactly.
A job of another size (a single process included) raises the same clear error on every
rank; ``torch.load(weights_only=True)`` loads DTensors and still refuses other globals.
"""
import copy
import gc
import io
import os
import pickle
import weakref

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidtensor
from helpers import assert_all_ranks, global_tensor, raises_everywhere
from mpidtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.mesh.pickling import restore_mesh
from mpidtensor.runtime import effects
from mpidtensor.tensor.placements import Placement, _StridedShard
from subjob import run_job
from test_fsdp import batch
from test_fsdp_tp import fsdp_net, tp_net

WORLD = MPI.COMM_WORLD
SAFE_GLOBALS = "safe globals for torch.load"


def round_trip(obj, weights_only: bool = False):
    """``obj`` through ``torch.save`` and ``torch.load`` in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def same_dtensor(loaded, x: DTensor) -> str | None:
    """What differs between ``loaded`` and ``x`` (None: bit-equal on the same mesh)."""
    if type(loaded) is not DTensor:
        return f"got {type(loaded).__name__}"
    if loaded.device_mesh is not x.device_mesh:
        return f"mesh {loaded.device_mesh} is not the live {x.device_mesh}"
    got = (loaded.placements, loaded.shape, loaded.stride(), loaded.dtype, loaded.requires_grad)
    want = (x.placements, x.shape, x.stride(), x.dtype, x.requires_grad)
    if got != want:
        return f"{got} != {want}"
    if not torch.equal(loaded.to_local(), x.to_local()) or loaded.to_local().stride() != x.to_local().stride():
        return "local tensors differ"
    return None


@pytest.fixture(scope="module")
def mesh3d():
    """(dp, cp, tp) = (W/2, 1, 2) at even world sizes, else (W, 1, 1): slices, flattens and
    unflattens at every size."""
    tp = 2 if WORLD.size % 2 == 0 else 1
    return init_device_mesh("cpu", (WORLD.size // tp, 1, tp), mesh_dim_names=("dp", "cp", "tp"))


# --- placements and specs ------------------------------------------------------------------------
def test_placements_pickle(mesh1d):  # the first mesh registers the safe globals
    kinds = [Shard(0), Shard(2), Shard(-1), Replicate(), Partial(), Partial("max"), Partial("avg"),
             _StridedShard(1, split_factor=2)]
    for p in kinds:
        for weights_only in (False, True):
            back = round_trip([p], weights_only)[0] if weights_only else pickle.loads(pickle.dumps(p))
            assert_all_ranks(back == p and type(back) is type(p), f"{p} came back as {back!r}")


def test_every_placement_class_is_a_safe_global(mesh1d):
    """New placement classes (another module's subclasses of Placement) need no listing."""
    safe = set(torch.serialization.get_safe_globals())
    todo, missing = [Placement], []
    while todo:
        cls = todo.pop()
        missing += [] if cls in safe else [cls.__name__]
        todo += cls.__subclasses__()
    assert_all_ranks(not missing and SAFE_GLOBALS in effects.installed(), f"not registered: {missing}")


# --- round trips ------------------------------------------------------------------------------------
SHAPES = [(7, 5), (3,), (2, 9, 4)]  # uneven at 2-4 ranks; one dim shorter than 4 ranks


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("placement", [Shard(0), Shard(-1), Replicate(), Partial(), Partial("max"),
                                       _StridedShard(0, split_factor=2)], ids=repr)
def test_round_trip_1d(mesh1d, placement, shape, weights_only):
    full = global_tensor(shape)
    if isinstance(placement, Partial):
        x = DTensor.from_local(full * (WORLD.rank + 1), mesh1d, [placement])
    else:
        x = distribute_tensor(full, mesh1d, [placement])
    loaded = round_trip({"x": x}, weights_only)["x"]
    problem = same_dtensor(loaded, x)
    assert_all_ranks(problem is None, str(problem))
    assert_all_ranks(torch.equal(loaded.full_tensor(), x.full_tensor()), "full tensors differ")


PLACEMENTS_2D = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)],
                 [Shard(1), Partial()], [Partial(), Replicate()], [_StridedShard(0, split_factor=2), Shard(0)]]


@pytest.mark.parametrize("placements", PLACEMENTS_2D, ids=str)
def test_round_trip_2d(mesh2d, placements):
    full = global_tensor((5, 7))
    if any(isinstance(p, Partial) for p in placements):
        local = distribute_tensor(full, mesh2d, [Replicate() if p.is_partial() else p for p in placements])
        x = DTensor.from_local(local.to_local() * (WORLD.rank + 1), mesh2d, placements, shape=full.shape,
                               stride=full.stride())
    else:
        x = distribute_tensor(full, mesh2d, placements)
    loaded = round_trip([x, x], weights_only=True)
    problem = same_dtensor(loaded[0], x)
    assert_all_ranks(problem is None and loaded[1] is loaded[0], f"{problem}; one object stays one")
    assert_all_ranks(torch.equal(loaded[0].full_tensor(), x.full_tensor()), "full tensors differ")


def test_sub_flattened_and_unflattened_meshes(mesh3d):
    derived = {"dp": mesh3d["dp"], "tp": mesh3d["tp"], "dp,tp": mesh3d["dp", "tp"],
               "dp_cp": mesh3d["dp", "cp"]._flatten("dp_cp"), "all": mesh3d._flatten("all"),
               "unflattened": mesh3d._flatten("all")._unflatten(0, mesh3d.shape, ("a", "b", "c")),
               "whole": mesh3d}
    full = global_tensor((9, 5))
    tensors = {name: distribute_tensor(full, m, [Shard(0)] + [Shard(1)] * (m.ndim - 1))
               for name, m in derived.items()}
    for weights_only in (False, True):
        loaded = round_trip(tensors, weights_only)
        problems = {name: same_dtensor(loaded[name], x) for name, x in tensors.items()}
        problems = {name: p for name, p in problems.items() if p}
        assert_all_ranks(not problems, f"weights_only={weights_only}: {problems}")
    meshes = pickle.loads(pickle.dumps(list(derived.values())))
    assert_all_ranks(all(a is b for a, b in zip(meshes, derived.values())), "meshes alone are the live ones")


def test_a_mesh_no_longer_held_is_rebuilt(mesh1d):
    """Freed, or dropped (kept only by a garbage cycle: a mesh and its sub-mesh), the
    root is rebuilt on every rank, with its sub-mesh, in the same layout."""
    names = ("a", "b")
    for how in ("free", "drop"):
        root = DeviceMesh("cpu", torch.arange(WORLD.size).reshape(1, WORLD.size), mesh_dim_names=names)
        sub = root["b"]
        data = pickle.dumps([root, sub])
        old = weakref.ref(root)
        if how == "free":
            root.free()
        del root, sub
        new_root, new_sub = pickle.loads(data)
        same_layout = (new_root.mesh.tolist(), new_root.mesh_dim_names, new_sub.mesh.tolist()) == \
            ([list(range(WORLD.size))], names, list(range(WORLD.size)))
        fresh = not new_root._freed and old() is not new_root and new_sub._parent is new_root
        fresh = fresh and (how == "free" or old() is None)  # the garbage cycle was collected, not found
        assert_all_ranks(same_layout and fresh, f"{how}: {new_root}, {new_sub}")
        total = WORLD.allreduce(new_sub.comm.allreduce(1))
        assert_all_ranks(total == WORLD.size ** 2, f"{how}: the rebuilt sub-mesh's communicator: {total}")
        new_root.free()
        gc.collect()


def test_of_equal_roots_the_pickled_one_comes_back(mesh1d):
    """Two roots of one layout: each pickle gives back its own; once one is freed, its
    pickles give the one still held."""
    first, second = (init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("x",)) for _ in range(2))
    data = pickle.dumps([first, second])
    back = pickle.loads(data)
    assert_all_ranks(back[0] is first and back[1] is second, f"{[id(m) for m in back]} for {id(first), id(second)}")
    second.free()
    back = pickle.loads(data)
    assert_all_ranks(back[0] is first and back[1] is first, "a freed root's pickle does not give the live one")
    first.free()


def test_clear_cache_keeps_the_live_meshes(mesh1d):
    """The roots are a registry, not a cache: ``mpidtensor.clear_cache()`` (also run when
    ``settings.fast_paths`` changes) between a save and a load still gives the live mesh."""
    x = distribute_tensor(global_tensor((5,)), mesh1d, [Shard(0)])
    data = pickle.dumps(x)
    mpidtensor.clear_cache()
    back = pickle.loads(data)
    assert_all_ranks(back.device_mesh is mesh1d, "a load after clear_cache built a second mesh")


def test_a_mesh_of_unknown_origin_is_rebuilt_as_its_group(mesh3d):
    """A mesh derived in a way pickling does not know (here: a slice whose parent link is
    cut) is rebuilt from its own ranks: an equal mesh over the same group."""
    sub = mesh3d["tp"]
    stray = DeviceMesh._from_cart("cpu", sub.mesh.clone(), sub.mesh_dim_names, WORLD, sub.comm.Dup())
    back = pickle.loads(pickle.dumps(stray))
    ok = back is not stray and back == stray and back.comm.allreduce(WORLD.rank) == sub.comm.allreduce(WORLD.rank)
    assert_all_ranks(ok, f"{back} for {stray}")
    back.free()
    stray.free()


def test_parameters_views_and_grad_flags(mesh1d):
    full = global_tensor((6, 4))
    param = nn.Parameter(distribute_tensor(full, mesh1d, [Shard(0)]))
    param.extra = "kept"  # __dict__ state pickles, as torch's
    buffer = distribute_tensor(full, mesh1d, [Replicate()])
    base = torch.arange(12.0)
    a = DTensor.from_local(base[:6].view(2, 3), mesh1d, [Replicate()])
    b = DTensor.from_local(base[6:].view(2, 3), mesh1d, [Replicate()])
    loaded = round_trip({"param": param, "buffer": buffer, "a": a, "b": b})
    p = loaded["param"]
    problems = [same_dtensor(loaded[k], v) for k, v in (("param", param), ("buffer", buffer), ("a", a), ("b", b))]
    problems = [x for x in problems if x]
    ok = isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad and p.extra == "kept"
    shared = loaded["a"].to_local().untyped_storage().data_ptr() == loaded["b"].to_local().untyped_storage().data_ptr()
    assert_all_ranks(ok and shared and not problems, f"param {type(p)} {p.requires_grad}; shared {shared}; {problems}")


def test_copies_of_a_mesh_are_the_mesh(mesh1d):
    assert_all_ranks(copy.copy(mesh1d) is mesh1d and copy.deepcopy(mesh1d) is mesh1d, "a copy is another mesh")


# --- weights_only ----------------------------------------------------------------------------------
def test_weights_only_refuses_other_globals(mesh1d):
    x = distribute_tensor(global_tensor((5, 3)), mesh1d, [Shard(0)])
    raises_everywhere(pickle.UnpicklingError, lambda: round_trip({"x": x, "obj": _NotSafe()}, weights_only=True),
                      match="_NotSafe")
    raises_everywhere(ValueError, lambda: restore_mesh(DeviceMesh, ("not", "a", "mesh")), match="not a DeviceMesh")


class _NotSafe:
    pass


# --- a model's state dict, resumed ---------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_tp():
    """(dp, tp): 2x2 at 4 ranks, (1, 2) at 2, (W, 1) otherwise."""
    tp = 2 if WORLD.size % 2 == 0 else 1
    return init_device_mesh("cpu", (WORLD.size // tp, tp), mesh_dim_names=("dp", "tp"))


def _fsdp_tp_model(mesh):
    net = tp_net(mesh)
    fsdp_net(net, mesh["dp"], net.blocks)
    return net, torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1)


def _steps(net, opt, n, mesh):
    (_, _), (x, target) = batch(mesh.size(0), mesh.get_local_rank("dp"))
    losses = []
    for _ in range(n):
        loss = torch.nn.functional.cross_entropy(net(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_fsdp_tp_state_dict_resumes_exactly_2d(dp_tp, ckpt_dir):
    """``torch.save({model, optim})`` per rank after 2 steps, ``torch.load`` into a fresh
    model and optimizer: the next 2 losses equal the uninterrupted run's, bit for bit."""
    net, opt = _fsdp_tp_model(dp_tp)
    _steps(net, opt, 2, dp_tp)
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"rank{WORLD.rank}.pt")
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, path)
    straight = _steps(net, opt, 2, dp_tp)

    fresh, fresh_opt = _fsdp_tp_model(dp_tp)
    state = torch.load(path, weights_only=False)
    params = dict(fresh.named_parameters())
    on_live = all(v.device_mesh is params[k].device_mesh for k, v in state["model"].items() if isinstance(v, DTensor))
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    resumed = _steps(fresh, fresh_opt, 2, dp_tp)
    assert_all_ranks(on_live, "loaded DTensors are not on the live meshes")
    assert_all_ranks(torch.equal(resumed, straight), f"resumed {resumed.tolist()} != {straight.tolist()}")

    again = torch.load(path, weights_only=True)
    differ = [k for k, v in state["model"].items() if same_dtensor(again["model"][k], v)]
    assert_all_ranks(not differ, f"weights_only=True loads differ: {differ}")


# --- another job -------------------------------------------------------------------------------------
LOAD = """
import torch
from mpi4py import MPI
from mpidtensor.runtime import effects
rank = MPI.COMM_WORLD.rank
effects.install("safe globals for torch.load")  # weights_only loads before the first mesh
for weights_only in (False, True):
    try:
        state = torch.load(f"{DIR}/rank{rank % SAVED}.pt", weights_only=weights_only)
        x = state["x"]
        print(f"rank {rank} loaded {type(x).__name__} {x.device_mesh} {x.placements} "
              f"sum={x.full_tensor().sum().item()}", flush=True)
    except ValueError as err:
        print(f"rank {rank} weights_only={weights_only} ValueError: {err}", flush=True)
"""


@pytest.mark.quick_at(2)  # separate jobs: the same at every size
def test_loading_in_a_job_of_another_size_raises_on_every_rank(ckpt_dir, tmp_path):
    mesh = init_device_mesh("cpu", (1, WORLD.size), mesh_dim_names=("dp", "tp"))
    full = global_tensor((5, 3))
    x = distribute_tensor(full, mesh["tp"], [Shard(0)])
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.save({"x": x}, os.path.join(ckpt_dir, f"rank{WORLD.rank}.pt"))
    WORLD.Barrier()
    script = LOAD.replace("{DIR}", ckpt_dir).replace("SAVED", str(WORLD.size))
    saved = f"saved on DeviceMesh('cpu', shape (1, {WORLD.size}), names ('dp', 'tp'))['tp'] of {WORLD.size} ranks"
    for ranks in sorted({1, WORLD.size + 1} - {WORLD.size}):  # a single process, a larger job
        result = run_job(script, tmp_path, ranks=ranks, timeout=180)
        problems = [] if result.returncode == 0 else [f"exit {result.returncode}"]
        for r in range(ranks):
            for weights_only in (False, True):
                line = f"rank {r} weights_only={weights_only} ValueError: this DTensor or DeviceMesh was {saved}; " \
                       f"this job has {ranks} rank{'' if ranks == 1 else 's'}"
                problems += [] if line in result.output else [f"no {line!r}"]
        assert_all_ranks(not problems, f"{ranks} ranks: {problems}\n{result.output[-3000:]}")
    result = run_job(script, tmp_path, ranks=WORLD.size, timeout=180)
    want = [f"rank {r} loaded DTensor DeviceMesh('cpu', {list(range(WORLD.size))}, mesh_dim_names=('tp',)) "
            f"(S(0),) sum={full.sum().item()}" for r in range(WORLD.size)]
    missing = [w for w in want if result.output.count(w) != 2]
    assert_all_ranks(result.returncode == 0 and not missing, f"{missing}\n{result.output[-3000:]}")
    mesh.free()
