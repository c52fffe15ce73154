"""c10d calls on the MPI-backed group that the sweep against gloo (test_c10d_sweep.py)
cannot show: parameters made equal across ranks by hand (``broadcast``/``all_reduce`` of
an ``nn.Parameter``, which c10d writes outside autograd), a ``monitored_barrier`` that a
rank misses (torch's ``RuntimeError`` naming it on rank 0, after the timeout), and ranks
whose sizes differ under the debug guard (a ``ValueError`` on every rank); torch's
utilities that need a C++ process group, given a mesh's group under the switch, raise a
``TypeError`` naming themselves."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.comm import guard
from mpidtensor.backend import cpp_groups, distributed as switch_dist
from mpidtensor.compat import importer, views

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank


def test_parameters_made_equal_by_hand(mpi_group):
    """Rank 0's initial weights broadcast into each rank's model, then gradients averaged
    by hand into ``.grad`` and a parameter summed in place: as torch's c10d does it
    (outside autograd), the parameters still parameters that require grad."""
    model = nn.Linear(3, 2)
    torch.manual_seed(RANK)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_()
    want = nn.Linear(3, 2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in want.parameters():
            p.uniform_()
    for p in model.parameters():
        dist.broadcast(p, src=0)
    problems = [name for (name, p), q in zip(model.named_parameters(), want.parameters())
                if not torch.equal(p, q) or not p.requires_grad or type(p) is not nn.Parameter]
    model(torch.ones(4, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    problems += [f"grad {k}" for k, (p, g) in enumerate(zip(model.parameters(), grads)) if not torch.equal(p.grad, g)]
    weight = model.weight
    dist.all_reduce(weight)
    if not torch.equal(weight.detach(), N * want.weight.detach()) or weight.grad_fn is not None:
        problems.append(f"all_reduce of a parameter: {weight}")
    work = dist.all_reduce(model.bias, async_op=True)
    work.wait()
    if not torch.equal(model.bias.detach(), N * want.bias.detach()):
        problems.append(f"async all_reduce of a parameter: {model.bias}")
    assert_all_ranks(not problems, f"{problems}")


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_names_the_rank_that_missed_it(mpi_group, wait_all_ranks):
    """The last rank skips the barrier: rank 0 raises torch's RuntimeError naming it after
    the timeout; the ranks that arrived raise torch's "successfully reached" error."""
    if N == 1:
        pytest.skip("needs a rank to miss the barrier")
    error = None
    if RANK != N - 1:
        try:
            switch_dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=wait_all_ranks)
        except RuntimeError as err:
            error = str(err)
    if RANK == 0:
        missing = f"Ranks {N - 1}" if wait_all_ranks else f"Rank {N - 1}"
        ok = error == f"[Rank 0]: {missing} failed to pass monitoredBarrier in 1000 ms"
    elif RANK == N - 1:
        ok = True
    else:
        ok = error is not None and error.startswith(f"Rank {RANK} successfully reached monitoredBarrier")
    assert_all_ranks(ok, f"got {error!r}")
    switch_dist.monitored_barrier(timeout=timedelta(seconds=60))  # all arrive: passes, the group still usable
    t = torch.ones(1)
    dist.all_reduce(t)
    assert_all_ranks(t.item() == N, f"{t}")


def test_sizes_that_differ_across_ranks_raise_everywhere_under_debug(mpi_group, monkeypatch):
    """One rank's tensor is longer: under the debug guard every rank raises before any data
    moves (torch's gloo gives rank 0 a wrong sum and the others a timeout)."""
    if N == 1:
        pytest.skip("needs ranks to differ")
    monkeypatch.setattr(guard, "ENABLED", True)
    raises_everywhere(ValueError, lambda: dist.all_reduce(torch.ones(3 + (RANK == N - 1))))
    raises_everywhere(ValueError, lambda: dist.broadcast(torch.ones(3 + (RANK == N - 1)), src=0))


@pytest.fixture
def switched():
    """The switch's views of torch.distributed and torch.distributed._composable for one test."""
    views.override("torch.distributed", switch_dist.OVERRIDES)
    views.override("torch.distributed._composable", cpp_groups.COMPOSABLE_OVERRIDES)
    importer.install()
    yield
    importer.uninstall()


def test_utilities_needing_a_cpp_group_name_themselves(switched, mesh1d):
    """Given a mesh or its group (MPI communicators), torch's C++-backed utilities raise a
    TypeError naming the utility and what to use, not pybind's list of signatures."""
    import torch.distributed as user_dist
    from torch.distributed._composable import replicate

    group = mesh1d.get_group()
    calls = {
        "torch.distributed._verify_params_across_processes": lambda: user_dist._verify_params_across_processes(
            group, [torch.ones(2)]),
        "torch.distributed._broadcast_coalesced": lambda: user_dist._broadcast_coalesced(group, [torch.ones(2)], 64, 0),
        "torch.distributed.Reducer": lambda: user_dist.Reducer([torch.ones(2)], [[0]], [64], group),
        "torch.distributed._composable.replicate": lambda: replicate(nn.Linear(2, 2), device_mesh=mesh1d),
    }
    for name, call in calls.items():
        raises_everywhere(TypeError, call, f"{name}")
        raises_everywhere(TypeError, call, "use")


def test_rooted_calls_on_a_mesh_group(switched, mesh1d):
    """``reduce``, ``gather`` and ``scatter`` given a mesh's group (an MPI communicator)
    under the switch: the root's values as torch's, ``dst``/``src`` global ranks, writes
    into a parameter outside autograd; a monitored barrier on it passes."""
    import torch.distributed as user_dist

    group, root = mesh1d.get_group(), N - 1
    problems = []
    t = nn.Parameter(torch.full((2,), RANK + 1.0))
    user_dist.reduce(t, dst=root, group=group)
    if RANK == root and t.tolist() != [N * (N + 1) / 2] * 2:
        problems.append(f"reduce {t}")
    pieces = [torch.zeros(2) for _ in range(N)] if RANK == root else None
    user_dist.gather(torch.full((2,), float(RANK)), pieces, dst=root, group=group)
    if RANK == root and torch.stack(pieces).tolist() != [[float(k)] * 2 for k in range(N)]:
        problems.append(f"gather {pieces}")
    mine = torch.zeros(3, 2)[:, 0]
    user_dist.scatter(mine, [torch.full((3,), 10.0 + k) for k in range(N)] if RANK == root else None, src=root,
                      group=group)
    if mine.tolist() != [10.0 + RANK] * 3:
        problems.append(f"scatter {mine}")
    user_dist.monitored_barrier(group=group, timeout=timedelta(seconds=60))
    assert_all_ranks(not problems, f"{problems}")


def test_all_to_all_single_and_ranks_on_a_mesh_group(switched, mesh1d):
    """transformers' expert parallelism on a mesh's group: the token counts by an even
    ``all_to_all_single``, the tokens by an uneven one (rows a rank sends nobody included),
    the group's global ranks; splits that do not match across ranks, and rows or dtypes only
    the last rank gets wrong, raise everywhere."""
    import torch.distributed as user_dist

    group = mesh1d.get_group()
    problems = []
    counts = torch.tensor([[RANK * 10 + k] for k in range(N)], dtype=torch.long)
    got = torch.empty_like(counts)
    user_dist.all_to_all_single(got, counts, group=group)
    if got.flatten().tolist() != [r * 10 + RANK for r in range(N)]:
        problems.append(f"even {got.flatten().tolist()}")
    sends = [[(r + k) % 3 for k in range(N)] for r in range(N)]
    rows = torch.arange(sum(sends[RANK]), dtype=torch.float64).unsqueeze(1) + 100 * RANK
    out = torch.empty(sum(sends[r][RANK] for r in range(N)), 1, dtype=torch.float64)
    user_dist.all_to_all_single(out, rows, [sends[r][RANK] for r in range(N)], sends[RANK], group=group)
    want = [100 * r + sum(sends[r][:RANK]) + i for r in range(N) for i in range(sends[r][RANK])]
    if out.flatten().tolist() != want:
        problems.append(f"uneven {out.flatten().tolist()} != {want}")
    if user_dist.get_process_group_ranks(group) != list(range(N)):
        problems.append("get_process_group_ranks")
    assert_all_ranks(not problems, f"{problems}")
    if N > 1:
        wrong = [1] * N if RANK == 0 else [0] * N  # rank 0 expects a row from each, nobody sends one
        raises_everywhere(ValueError, lambda: user_dist.all_to_all_single(
            torch.empty(sum(wrong), 1), torch.empty(0, 1), wrong, [0] * N, group=group), "expects")
        rows = N + 1 if RANK == N - 1 else N  # the last rank's rows do not split evenly: it alone could tell
        raises_everywhere(RuntimeError, lambda: user_dist.all_to_all_single(
            torch.empty(N), torch.empty(rows), group=group), f"on rank {N - 1}: Tensor's dim 0 does not divide")
        dtype = torch.float64 if RANK == N - 1 else torch.float32  # torch's own check would raise there alone
        raises_everywhere(RuntimeError, lambda: user_dist.all_to_all_single(
            torch.empty(N, dtype=dtype), torch.empty(N), group=group), f"on rank {N - 1}: input torch.float32 and output")


def test_point_to_point_on_a_mesh_group(switched, mpi_group):
    """transformers' pipeline stages on their mesh's group: ``P2POp`` of the switch's
    ``isend``/``irecv`` through ``batch_isend_irecv``, blocking ``send``/``recv``, ``get_backend``,
    peers as global ranks on a group whose order is not the world's (``group_peer`` too)."""
    import torch.distributed as user_dist

    from mpidtensor import DeviceMesh

    if N < 2:
        pytest.skip("a peer")
    mesh = DeviceMesh("cpu", list(reversed(range(N))))  # group rank g is global rank N - 1 - g
    group, problems = mesh.get_group(), []
    nxt, prv = (RANK - 1) % N, (RANK + 1) % N  # the next group rank's global rank, and the previous one's
    got = torch.zeros(3)
    ops = [user_dist.P2POp(user_dist.isend, torch.full((3,), float(RANK)), nxt, group=group),
           user_dist.P2POp(user_dist.irecv, got, prv, group=group)]
    for work in user_dist.batch_isend_irecv(ops):
        work.wait()
    if got.tolist() != [float(prv)] * 3 or ops[0].group_peer != (mesh.get_local_rank() + 1) % N:
        problems.append(f"batch_isend_irecv {got.tolist()}, group peer {ops[0].group_peer}")
    if user_dist.get_backend(group) != "mpidtensor":
        problems.append(f"get_backend {user_dist.get_backend(group)}")
    into = torch.zeros(2, dtype=torch.complex64)
    if mesh.get_local_rank() % 2 == 0 and mesh.get_local_rank() + 1 < N:
        user_dist.send(torch.full((2,), 1 + 2j, dtype=torch.complex64), group=group,
                       group_dst=mesh.get_local_rank() + 1)
    elif mesh.get_local_rank() % 2 == 1:
        sender = user_dist.recv(into, group=group, group_src=mesh.get_local_rank() - 1)
        if into.tolist() != [1 + 2j] * 2 or sender != RANK + 1:
            problems.append(f"send/recv {into.tolist()} from {sender}")
    # the default group keeps torch's own path, the switch's isend accepted in its P2POp
    got = torch.zeros(1)
    works = user_dist.batch_isend_irecv([user_dist.P2POp(user_dist.isend, torch.ones(1) * RANK, (RANK + 1) % N),
                                         user_dist.P2POp(user_dist.irecv, got, (RANK - 1) % N)])
    for work in works:
        work.wait()
    if got.item() != (RANK - 1) % N:
        problems.append(f"default group {got.item()}")
    assert_all_ranks(not problems, f"{problems}")


@pytest.mark.parametrize("on", ["default group", "mesh group"])
def test_in_place_results_keep_the_version_counter(switched, mpi_group, mesh1d, on):
    """``all_reduce``, ``broadcast``, ``scatter`` and ``all_to_all_single`` write their results
    as gloo does, leaving the tensor's autograd version as it was: a token count saved for
    backward may be all-reduced in place, and the backward reads the reduced value (under
    torch it runs so; a version bump made it ``RuntimeError: ... modified by an inplace
    operation``)."""
    import torch.distributed as user_dist

    group = None if on == "default group" else mesh1d.get_group()
    x = torch.ones(2, requires_grad=True)
    count = torch.tensor(float(RANK + 1))
    loss = (x * count).sum()  # count is saved for the backward
    user_dist.all_reduce(count, group=group)
    problems = []
    try:
        loss.backward()
        if x.grad.tolist() != [N * (N + 1) / 2] * 2:
            problems.append(f"grad {x.grad.tolist()}")
    except RuntimeError as err:
        problems.append(f"backward: {err}")
    b, s, a = torch.zeros(2), torch.zeros(2), torch.zeros(N)
    user_dist.broadcast(b, src=0, group=group)
    user_dist.scatter(s, [torch.full((2,), float(k)) for k in range(N)] if RANK == 0 else None, src=0, group=group)
    user_dist.all_to_all_single(a, torch.full((N,), float(RANK)), group=group)
    versions = [t._version for t in (count, b, s, a)]
    if versions != [0, 0, 0, 0] or s.tolist() != [float(mesh1d.get_local_rank())] * 2 or a.tolist() != list(
            map(float, range(N))):
        problems.append(f"versions {versions} (all_reduce, broadcast, scatter, all_to_all_single), "
                        f"scatter {s.tolist()}, all_to_all_single {a.tolist()}")
    assert_all_ranks(not problems, f"{problems}")
