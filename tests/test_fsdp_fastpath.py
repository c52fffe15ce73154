"""FSDP's strided copies between a parameter and its rank chunks (``packing.chunk_layout``):
the gradient pack for the reduce-scatter and its inverse, the all-gather's copy-out, checked
against ``torch.chunk`` at world sizes 1-5 with uneven and empty chunks; the copy-out of a
group that mixes dim-0 and dim-1 sharding (FSDP x TP's layout) under a full step; and FSDP's
registered fast paths (``FSDP_PATHS``) against the general path, fast paths on and off."""
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor import Shard
from mpidtensor.comm import placed
from mpidtensor.fast import registry
from mpidtensor.fsdp import MixedPrecisionPolicy, fully_shard
from mpidtensor.fsdp.packing import chunk_views, pack_ranks
from mpidtensor.runtime.settings import settings

WORLD = MPI.COMM_WORLD

SHAPES = [(1, 8, 3), (2, 7, 3), (3, 2, 5), (1, 1, 4), (4, 9, 1), (2, 0, 3)]


def stub(pre: int, rows: int, post: int, world: int) -> SimpleNamespace:
    """The layout fields of an ``FSDPParam`` sharding dim 1 of a (pre, rows, post) tensor."""
    pad = -(-rows // world)
    return SimpleNamespace(pre=pre, rows=rows, post=post, pad_rows=pad, shard_numel=pre * pad * post)


def expected_rows(t: torch.Tensor, world: int, pad: int) -> list[torch.Tensor]:
    """Rank r's padded piece: its ``torch.chunk`` of dim 1, contiguous, then zeros."""
    pieces = list(torch.chunk(t, world, dim=1)) if t.size(1) else []
    rows = []
    for r in range(world):
        piece = pieces[r].reshape(-1) if r < len(pieces) else t.new_zeros(0)
        rows.append(torch.cat([piece, t.new_zeros(t.size(0) * pad * t.size(2) - piece.numel())]))
    return rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_pack_ranks_is_torch_chunk_zero_padded(world):
    """Several gradients (some uneven, one empty) packed into (world, total) rows, cast to the
    buffer's dtype; the padding is zeroed over whatever the buffer held."""
    params = [stub(*shape, world) for shape in SHAPES]
    grads = [torch.randn(p.pre, p.rows, p.post, dtype=torch.float64) for p in params]
    total = sum(p.shard_numel for p in params)
    per_rank = torch.full((world, total), float("nan"))
    pack_ranks(per_rank, list(zip(params, grads)))
    col = 0
    for p, g in zip(params, grads):
        want = torch.stack(expected_rows(g, world, p.pad_rows)).float()
        assert torch.equal(per_rank[:, col:col + p.shard_numel], want)
        col += p.shard_numel


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_chunk_views_invert_the_pack(world):
    """The all-gather's direction: every parameter rebuilt from the rank rows, bit for bit,
    with the buffer's columns offset (a parameter after others) and a strided row."""
    params = [stub(*shape, world) for shape in SHAPES]
    grads = [torch.randn(p.pre, p.rows, p.post) for p in params]
    total = sum(p.shard_numel for p in params)
    wide = torch.zeros(world, total + 6)
    per_rank = wide[:, 3:3 + total]  # a row stride longer than the row, a storage offset
    pack_ranks(per_rank, list(zip(params, grads)))
    col = 0
    for p, g in zip(params, grads):
        out = torch.full((p.pre, p.rows, p.post), float("nan"))
        parts, places = chunk_views((p.pre, p.rows, p.post), p.pad_rows, out, per_rank, col)
        if parts:
            torch._foreach_copy_(parts, places)
        assert torch.equal(out, g)
        col += p.shard_numel


def test_pack_ranks_even_dim0_is_one_cat():
    """Gradients split evenly along dim 0 in the buffer's dtype take the ``torch.cat`` path:
    the same rows as the strided one."""
    world = 2
    params = [stub(1, 4, 3, world), stub(1, 6, 1, world)]
    grads = [torch.randn(4, 3), torch.randn(6)]
    per_rank = torch.empty(world, sum(p.shard_numel for p in params))
    pack_ranks(per_rank, list(zip(params, grads)))
    want = torch.cat([torch.stack(expected_rows(g.reshape(1, p.rows, p.post), world, p.pad_rows))
                      for p, g in zip(params, grads)], dim=1)
    assert torch.equal(per_rank, want)


def dim1_for_matrices(param):
    return Shard(1) if param.ndim > 1 else Shard(0)


def test_mixed_dims_group_matches_full_tensor(mesh1d):
    """A group mixing dim-1 sharded matrices (uneven at 3 ranks) and dim-0 sharded vectors:
    the unsharded parameters equal the full tensors every step (the all-gather's copy-out),
    and the sharded gradients equal a single process's (the gradient pack)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    net.load_state_dict(ref.state_dict())
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    x = torch.randn(4, 5)
    ref(x).pow(2).sum().backward()
    fully_shard(net, mesh=mesh1d, shard_placement_fn=dim1_for_matrices)
    ok = net[0].weight.placements == (Shard(1),) and net[0].bias.placements == (Shard(0),)
    for _ in range(2):
        net.unshard()
        ok &= all(torch.equal(p.detach(), full[n]) for n, p in net.named_parameters())
        net.reshard()
        net.zero_grad()
        net(x).pow(2).sum().backward()
    ok &= all(torch.allclose(dict(net.named_parameters())[n].grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)
              for n, p in ref.named_parameters())
    assert_all_ranks(ok, "a group of dim-1 and dim-0 shards")


def test_large_unsharded_storage_asks_for_huge_pages(mesh1d, monkeypatch):
    """A group's unsharded storage of ``HUGE_PAGES_MIN`` bytes or more is advised for huge
    pages when it is made and again each time a reshard has freed it (the allocator hands
    new memory), before the all-gather writes it; the reshard itself advises nothing."""
    from mpidtensor.comm import pool as pool_module

    calls = []
    monkeypatch.setattr(pool_module, "_MADVISE", lambda start, length, advice: calls.append((start, length)))
    side = 1024  # a 4 MiB float32 weight: HUGE_PAGES_MIN
    net = torch.nn.Linear(side, side, bias=False)
    fully_shard(net, mesh=mesh1d)
    group = net._fsdp_state.group
    covered, at_reshard = [], []
    for _ in range(2):
        calls.clear()
        net.unshard()
        flat = group.unsharded_flat
        covered.append(any(s <= flat.data_ptr() + flat.nbytes - 1 and s + n == flat.data_ptr() + flat.nbytes
                           for s, n in calls))
        calls.clear()
        net.reshard()
        at_reshard.append(len(calls))  # freed storage: nothing to advise
    assert_all_ranks(all(covered) and at_reshard == [0, 0],
                     f"unsharded storage advised per gather: {covered}; madvise calls at reshard {at_reshard}")


# --- FSDP's registered fast paths, on against off --------------------------------------------------
FSDP_PATHS = {"fsdp.posted_gather", "fsdp.placed_gather", "fsdp.prepared_scatter"}  # tests/test_fast_paths.py checks every registered path has a case


def blocks() -> torch.nn.Sequential:
    """Two Linears of 7 and 3 output rows: uneven dim-0 shards at 2-4 ranks (empty at 4)."""
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def same_size_blocks() -> torch.nn.Sequential:
    """Three groups of one size (prefetched two at once: receive buffers of one pool size)."""
    return torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 5))


GATHER_CASES = {  # name: (build, fully_shard keywords): each group kind the posted all-gather takes
    "one weight in place": (lambda: torch.nn.Sequential(torch.nn.Linear(5, 12, bias=False), torch.nn.Tanh(),
                                                        torch.nn.Linear(12, 12, bias=False)), {}),
    "bfloat16 packed": (blocks, {"mp_policy": "bf16"}),
    "dim-1 shards": (blocks, {"shard_placement_fn": dim1_for_matrices}),  # a (7, 5) weight: pieces on every row
    "same-size groups prefetched": (same_size_blocks, {"prefetch": 2, "mp_policy": "bf16"}),
}
PLACED_CASES = {  # name: (build, fully_shard keywords): each group kind the placed all-gather takes
    "uneven blocks": (blocks, {}),
    "even blocks": (lambda: torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12)), {}),
    "kept after forward": (blocks, {"reshard_after_forward": False}),
    "same-size groups prefetched": (same_size_blocks, {"prefetch": 2}),
}


def fsdp_steps(build, options: dict, mesh, fast: bool, steps: int = 3):
    """Losses, final sharded gradients and parameters (full tensors) of ``steps`` AdamW steps of
    ``build()`` with every Linear and the root ``fully_shard``-ed, and the FSDP paths' hits."""
    torch.manual_seed(0)
    net = build()
    options = dict(options)  # (the case's own stays as it is for the other run)
    if options.get("mp_policy") == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    elif options.get("mp_policy") == "bf16, reduce f32":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    prefetch = options.pop("prefetch", 0)
    unsynced = options.pop("unsynced", 0)  # backwards without gradient sync before each synced one
    factor = options.pop("divide_factor", None)  # set_gradient_divide_factor on every module
    layers = [layer for layer in net if isinstance(layer, torch.nn.Linear)]
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(net, mesh=mesh, **options)
    if factor is not None:
        for module in layers + [net]:
            module.set_gradient_divide_factor(factor)
    if prefetch:
        layers[0].set_modules_to_forward_prefetch(layers[1:1 + prefetch])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(WORLD.rank)
    before = {p.name: p.hits for p in registry.paths() if p.name in FSDP_PATHS}
    losses = []
    with settings.override(fast_paths=fast):
        for _ in range(steps):
            for sync in [False] * unsynced + [True]:
                net.set_requires_gradient_sync(sync)
                loss = net(torch.randn(4, 5, generator=gen)).float().pow(2).sum()
                loss.backward()
            grads = [p.grad.full_tensor() for p in net.parameters()]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    hits = {p.name: p.hits - before[p.name] for p in registry.paths() if p.name in FSDP_PATHS}
    return losses, grads, [p.full_tensor() for p in net.parameters()], hits


def check_on_equals_off(build, options: dict, mesh, path: str, what: str, runs: bool) -> None:
    """``fsdp_steps`` with fast paths on and off: the same bytes move, so losses, gradients and
    parameters are bit-equal; ``path`` ran when on iff ``runs``, never when off."""
    on, off = fsdp_steps(build, options, mesh, True), fsdp_steps(build, options, mesh, False)
    same = on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1] + on[2], off[1] + off[2]))
    assert_all_ranks(same, f"{what}: losses {on[0]} vs {off[0]}, or gradients / parameters differ")
    assert_all_ranks((on[3][path] > 0) == runs and not off[3][path], f"{what}: hits on {on[3]}, off {off[3]}")


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_posted_all_gather_equals_the_general_one(mesh1d, case):
    """``fsdp.posted_gather`` (the all-gather prepared once per group) against
    ``collectives.start_all_gather`` (fast paths off); it runs on 2+ ranks only."""
    check_on_equals_off(*GATHER_CASES[case], mesh1d, "fsdp.posted_gather", case, WORLD.size > 1)


BY_PIECE = {"one Ialltoallw": 1 << 62, "an Iallgatherv per piece": 0}  # placed.BY_PIECE_MIN for each form


def placed_runs(form: str) -> bool:
    """Whether FSDP places its all-gathers in ``form`` at this world size (``placed.pays``:
    the one ``Ialltoallw`` from 3 ranks, by piece from 2)."""
    return WORLD.size > 2 or (WORLD.size == 2 and form == "an Iallgatherv per piece")


def test_placed_pays_from_three_ranks_or_by_piece():
    """``placed.pays``: a two-rank layout is placed only by piece (from ``BY_PIECE_MIN``
    bytes for the largest source), a larger one always."""
    small, large = [[(0, 64)], [(64, 64)]], [[(0, placed.BY_PIECE_MIN)], [(placed.BY_PIECE_MIN, 8)]]
    assert not placed.pays(small) and placed.pays(large) and placed.pays(small + [[(128, 64)]])


@pytest.mark.parametrize("form", list(BY_PIECE))
@pytest.mark.parametrize("case", list(PLACED_CASES))
def test_placed_all_gather_equals_the_general_one(mesh1d, case, form, monkeypatch):
    """``fsdp.placed_gather`` (each rank's shards put in the unsharded parameters by MPI's
    datatypes, or by one all-gather per parameter) against the general all-gather and copy
    out (fast paths off); from 3 ranks, or 2 by piece (``placed_runs``)."""
    monkeypatch.setattr(placed, "BY_PIECE_MIN", BY_PIECE[form])
    made, by_piece = [], placed._by_piece  # each PlacedAllGather's choice
    monkeypatch.setattr(placed, "_by_piece", lambda *args: made.append(by_piece(*args)) or made[-1])
    check_on_equals_off(*PLACED_CASES[case], mesh1d, "fsdp.placed_gather", f"{case}, {form}", placed_runs(form))
    per_piece = form == "an Iallgatherv per piece"
    assert_all_ranks(not placed_runs(form) or (made and all((m is not None) == per_piece for m in made)),
                     f"{case}: {len(made)} placed all-gathers made, by piece: {[m is not None for m in made]}")


SCATTER_CASES = {  # name: (build, fully_shard keywords): each group kind the prepared reduce-scatter takes
    "uneven dim-0 shards": (blocks, {}),  # uneven at 2-4 ranks (pack_ranks' copies)
    "even dim-0 shards": (lambda: torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12),
                                                      torch.nn.Tanh(), torch.nn.Linear(12, 12)), {}),  # one cat
    "bfloat16": GATHER_CASES["bfloat16 packed"],  # reduced in float32 by the prepared collective's general call
    "bfloat16, reduce float32": (blocks, {"mp_policy": "bf16, reduce f32"}),
    "accumulated without sync": (blocks, {"unsynced": 2}),
    "divide factor before the sum": (blocks, {"divide_factor": 5.0}),  # PREMUL_SUM's scaling
}


@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_prepared_reduce_scatter_equals_the_general_one(mesh1d, case):
    """``fsdp.prepared_scatter`` (a group's reduce-scatter worked out once) against
    ``collectives.start_reduce_scatter`` (fast paths off); it runs on 2+ ranks only."""
    check_on_equals_off(*SCATTER_CASES[case], mesh1d, "fsdp.prepared_scatter", case, WORLD.size > 1)


@pytest.mark.parametrize("form", list(BY_PIECE))
def test_placed_all_gather_matches_one_process(mesh1d, form, monkeypatch):
    """Three AdamW steps of ``blocks`` under FSDP (the placed all-gather in either form,
    uneven shards at 3 and 4 ranks, an empty one at 4), each rank a slice of one batch,
    against one process on the whole batch: gradients and parameters equal to rounding."""
    monkeypatch.setattr(placed, "BY_PIECE_MIN", BY_PIECE[form])
    torch.manual_seed(0)
    ref = blocks()
    net = blocks()
    net.load_state_dict(ref.state_dict())
    for layer in (net[0], net[2], net):
        fully_shard(layer, mesh=mesh1d)
    opts = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen, world = torch.Generator().manual_seed(7), WORLD.size
    hits = {p.name: p.hits for p in registry.paths()}
    ok = True
    for _ in range(3):
        batch = torch.randn(4 * world, 5, generator=gen)
        ref(batch).pow(2).sum().div(world).backward()  # FSDP averages the ranks' gradients
        net(batch[4 * WORLD.rank:4 * WORLD.rank + 4]).pow(2).sum().backward()
        ok &= all(torch.allclose(b.grad.full_tensor(), a.grad, rtol=1e-5, atol=1e-6)
                  for a, b in zip(ref.parameters(), net.parameters()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ok &= all(torch.allclose(b.full_tensor(), a, rtol=1e-5, atol=1e-6) for a, b in zip(ref.parameters(), net.parameters()))
    ran = {p.name: p.hits - hits[p.name] for p in registry.paths()}["fsdp.placed_gather"]
    assert_all_ranks(ok and (ran > 0) == placed_runs(form), f"gradients / parameters differ, or placed all-gathers {ran}")


def test_prepared_reduce_scatter_hsdp(mesh2d):
    """HSDP on the 2x2 mesh (replicate x shard): the prepared reduce-scatter over the shard
    ranks, then the all-reduce over the replicas, bit-equal to the general path."""
    check_on_equals_off(*SCATTER_CASES["uneven dim-0 shards"], mesh2d, "fsdp.prepared_scatter", "HSDP", True)
