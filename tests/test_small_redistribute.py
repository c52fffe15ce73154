"""Redistribution's prepared fast path (``comm.prepared.Prepared``, kept on a plan's steps).

The first run of a cached plan prepares each collective; later runs go straight to MPI.
Checked here: every placement pair (1-D, uneven lengths at 3 ranks, a 2x2 mesh) gives the
torch.chunk layout of the input's ``full_tensor()`` on every call, not only the first;
results handed back are never overwritten by later calls; later calls skip the general
collective functions; and every input the fast path does not take (non-contiguous,
debug mode, changed thresholds, a dtype reduced in another one) still gives the right result.
"""
import sys

import pytest
import torch
from mpi4py import MPI

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.comm import alltoall, base, buffers, collectives, guard
from mpidtensor import clear_cache

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank
CALLS = 3  # the first prepares, the others take the fast path


def refuse(monkeypatch, kind: str, refused) -> None:
    """Replace the general function ``kind`` where callers reach it (``collectives``) and where
    its prepared form falls back to it (its kind's module)."""
    monkeypatch.setattr(sys.modules[getattr(collectives, kind).__module__], kind, refused)
    monkeypatch.setattr(collectives, kind, refused)


def placement(text: str):
    return {"R": Replicate(), "P": Partial(), "A": Partial("avg")}.get(text) or Shard(int(text[1:]))


def source(full: torch.Tensor, mesh, text: str) -> DTensor:
    """``full`` with ``text``'s placements. Over the Partial mesh dims the k ranks hold
    ``full`` times weights summing to 1 (sum) or to k (avg), their block of it where sharded."""
    placements = [placement(p) for p in text.split(",")]
    if not any(p.is_partial() for p in placements):
        return distribute_tensor(full, mesh, placements)
    index, k = 0, 1
    for size, c, p in zip(mesh.shape, mesh.get_coordinate(), placements):
        if p.is_partial():
            index, k = index * size + c, k * size
    weight = (index + 1) / (k * (k + 1) / 2)
    if placements[0] == Partial("avg"):
        weight *= k
    return DTensor.from_local(expected(full * weight, mesh, text), mesh, placements, shape=full.shape,
                              stride=full.stride())


def expected(full: torch.Tensor, mesh, text: str) -> torch.Tensor:
    """This rank's block of ``full`` under ``text`` (torch.chunk per mesh dim, outer first)."""
    local = full
    for size, c, p in zip(mesh.shape, mesh.get_coordinate(), text.split(",")):
        if p.startswith("S"):
            chunks = local.chunk(size, int(p[1]))
            local = chunks[c] if c < len(chunks) else local.narrow(int(p[1]), 0, 0)
    return local


def check_repeated(x: DTensor, mesh, dst: str, calls: int = CALLS) -> None:
    """``calls`` redistributions of ``x`` to ``dst``: each the right block, none overwritten
    by a later one, no two sharing memory."""
    whole = x.full_tensor()
    want = expected(whole, mesh, dst)
    target = [placement(p) for p in dst.split(",")]
    got = [x.redistribute(mesh, target).to_local() for _ in range(calls)]
    for g in got:
        assert_close(g, want, atol=1e-5, rtol=1e-5)
    if communicates(x, target):  # each result a buffer of its own (else views of the input, as in torch)
        pointers = [g.data_ptr() for g in got if g.numel()]
        assert_all_ranks(len(set(pointers)) == len(pointers), "two results share memory")


def communicates(x: DTensor, target) -> bool:
    """Whether a mesh dim of more than one rank changes other than Replicate -> Shard."""
    return any(n > 1 and a != b and not (a.is_replicate() and b.is_shard())
               for n, a, b in zip(x.device_mesh.shape, x.placements, target))


SHAPES = [(4 * N, 6), (2 * N + 1, 5), (3, 2 * N + 1)]  # even, uneven rows, uneven columns


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", ["S0", "S1", "R", "P", "A"])
@pytest.mark.parametrize("dst", ["S0", "S1", "R"])
def test_every_1d_pair_on_every_call(mesh1d, shape, src, dst):
    full = global_tensor(shape)
    check_repeated(source(full, mesh1d, src), mesh1d, dst)


@pytest.mark.parametrize("src,dst", [
    ("S0,S0", "R,R"), ("S0,S1", "R,R"), ("P,P", "R,R"), ("R,S0", "S0,R"), ("S0,R", "S0,S1"),
    ("S1,S0", "S0,S1"), ("P,S0", "R,S1"), ("P,R", "S0,S0"), ("S0,S0", "S1,R"),
])
@pytest.mark.parametrize("shape", [(8, 6), (5, 7)])
def test_every_2d_pair_on_every_call(mesh2d, src, dst, shape):
    full = global_tensor(shape)
    check_repeated(source(full, mesh2d, src), mesh2d, dst)


def test_held_results_survive_more_calls_than_the_pool_keeps(mesh1d):
    full = global_tensor((2 * N + 1, 4))
    x = source(full, mesh1d, "S1")
    held = [x.redistribute(mesh1d, [Replicate()]).to_local() for _ in range(7)]
    view = x.redistribute(mesh1d, [Replicate()]).to_local()[1:]
    again = [(x * 2).redistribute(mesh1d, [Replicate()]).to_local() for _ in range(3)]
    for h in held:
        assert_close(h, full)
    assert_close(view, full[1:])
    for a in again:
        assert_close(a, full * 2)


@pytest.mark.parametrize("src,dst,kind", [
    ("S0", "R", "all_gather"), ("S1", "R", "all_gather"), ("S0", "S1", "all_to_all"),
    ("P", "R", "all_reduce"), ("P", "S0", "reduce_scatter"),
])
def test_later_calls_skip_the_general_functions(mesh1d, monkeypatch, src, dst, kind):
    if N == 1:
        pytest.skip("nothing to communicate on one rank")
    full = global_tensor((2 * N + 1, 2 * N))
    x = source(full, mesh1d, src)
    target = [placement(dst)]
    first = x.redistribute(mesh1d, target).to_local()  # prepares the collective

    def refused(*args, **kwargs):
        raise AssertionError(f"{kind}: the general function ran on a prepared step")
    refuse(monkeypatch, kind, refused)
    with CollectiveLog() as log:
        second = x.redistribute(mesh1d, target).to_local()
    assert_all_ranks(log.calls == [kind], f"collectives {log.calls}")
    assert_close(second, first)


@pytest.mark.parametrize("shape,src,dst", [
    *[(shape, a, b) for shape in SHAPES for a, b in (("S0", "S1"), ("S1", "S0"))],
    *[(shape, a, b) for shape in [(2 * N, 3 * N, 2), (2 * N + 1, 3, N + 2)]
      for a, b in (("S0", "S1"), ("S1", "S0"), ("S1", "S2"), ("S2", "S0"))],
    # a size-1 leading dim: the pieces land on the leading dim of length > 1, split strided
    *[((1, 3 * N, 2 * N + 1), a, b) for a, b in (("S1", "S2"), ("S2", "S1"))],
])
def test_prepared_packed_all_to_all(mesh1d, monkeypatch, shape, src, dst):
    """The packed all-to-all (the default from 64 or 256 KiB per rank) prepared: the right
    block on every call, later calls without the general function, even and uneven pieces
    (empty ones at 4 ranks), the split and the concatenated dim leading or not, size-1 dims."""
    monkeypatch.setattr(base, "ALLTOALL_PACKED_MIN", ((1, 0),))
    monkeypatch.setattr(base, "ALLTOALL_PACK_SEND_MIN", ((1, 0),))
    clear_cache()  # plans prepared under the default thresholds
    try:
        x = source(global_tensor(shape), mesh1d, src)
        check_repeated(x, mesh1d, dst, calls=1)  # prepares the collective
        refuse(monkeypatch, "all_to_all", lambda *a, **k: pytest.fail("the general all_to_all ran"))
        check_repeated(x, mesh1d, dst)
    finally:
        clear_cache()


def test_non_contiguous_input_is_staged(mesh1d):
    full = global_tensor((6, 2 * N + 1))
    local = expected(full.t().contiguous(), mesh1d, "S0").t()  # a transposed block: not C-contiguous
    x = DTensor.from_local(local, mesh1d, [Shard(1)], shape=full.shape, stride=(1, 6))
    for _ in range(CALLS):
        assert_close(x.redistribute(mesh1d, [Replicate()]).to_local(), full)


def test_debug_mode_takes_the_checked_path(mesh1d, monkeypatch):
    full = global_tensor((2 * N + 1, 3))
    x = source(full, mesh1d, "S0")
    check_repeated(x, mesh1d, "R", calls=1)  # prepared
    monkeypatch.setattr(guard, "ENABLED", True)
    checks = []
    real = guard.check
    monkeypatch.setattr(guard, "check", lambda *a, **k: (checks.append(a[0]), real(*a, **k)))
    check_repeated(x, mesh1d, "R", calls=2)
    assert_all_ranks(checks == (["all_gather"] * 3 if N > 1 else []), f"guard checks {checks}")  # with full_tensor()


def test_changed_thresholds_are_followed(mesh1d, monkeypatch):
    full = global_tensor((2 * N, 3 * N))
    x = source(full, mesh1d, "S0")
    check_repeated(x, mesh1d, "S1", calls=1)  # prepared with the Alltoallw path
    packed = []
    real = alltoall._packed_runner
    monkeypatch.setattr(alltoall, "_packed_runner", lambda *a: (packed.append(1), real(*a))[1])
    monkeypatch.setattr(base, "ALLTOALL_PACKED_MIN", ((1, 0),))
    monkeypatch.setattr(base, "ALLTOALL_PACK_SEND_MIN", ((1, 0),))
    check_repeated(x, mesh1d, "S1", calls=2)
    assert_all_ranks(len(packed) == (2 if N > 1 else 0), f"packed all-to-alls: {len(packed)}")


def test_prepared_gather_owns_its_datatype(mesh1d):
    """A prepared typed all-gather (a small S(1) -> R) keeps a datatype of its own: the shared
    cache of derived datatypes frees what it evicts, and filling it leaves the step working."""
    if N == 1:
        pytest.skip("nothing to communicate on one rank")
    full = global_tensor((3, 2 * N))
    x = source(full, mesh1d, "S1")
    check_repeated(x, mesh1d, "R", calls=1)  # prepared
    for k in range(buffers.derived._maxsize + 1):
        buffers.derived(("filler", k), lambda k=k: MPI.BYTE.Create_contiguous(k + 1))
    check_repeated(x, mesh1d, "R")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("src,dst", [("P", "R"), ("P", "S0"), ("S1", "R"), ("S0", "S1")])
def test_dtypes(mesh1d, dtype, src, dst):
    full = global_tensor((2 * N + 1, N + 2), dtype)
    if src == "P":  # exact in every dtype: one rank holds the value, the others zero
        local = full if RANK == 0 else torch.zeros_like(full)
        x = DTensor.from_local(local, mesh1d, [Partial()], shape=full.shape, stride=full.stride())
    else:
        x = source(full, mesh1d, src)
    check_repeated(x, mesh1d, dst)


@pytest.mark.parametrize("src,dst", [("S0", "R"), ("S1", "R"), ("S0", "S1"), ("R", "S1")])
def test_gradients_on_every_call(mesh1d, src, dst):
    full = global_tensor((2 * N + 1, N + 1))
    weight = global_tensor(full.shape, seed=5)
    for _ in range(CALLS):
        x = source(full, mesh1d, src).detach().requires_grad_()
        y = x.redistribute(mesh1d, [placement(dst)])
        loss = (y.full_tensor() * weight).sum()
        loss.backward()
        assert_close(x.grad.full_tensor(), weight)


@pytest.mark.parametrize("typed_max", [0, 1 << 20])  # interleaving copy; resized vector datatype
@pytest.mark.parametrize("shape,dim", [((5, 2 * N), 1), ((3, 4, 2 * N), 2), ((3, 2 * N, 2), 1), ((4, N), 1)])
def test_gather_along_a_later_dim_both_ways(mesh1d, monkeypatch, typed_max, shape, dim):
    monkeypatch.setattr(base, "GATHER_TYPED_MAX", typed_max)
    full = global_tensor(shape)
    x = source(full, mesh1d, f"S{dim}")
    check_repeated(x, mesh1d, "R")
    local = expected(full, mesh1d, f"S{dim}").contiguous()
    assert_close(collectives.all_gather(local, WORLD, dim=dim, sizes=[shape[dim] // N] * N), full)
