"""Reduction ops on DTensors against plain torch: every op over all dims, a sharded dim,
an unsharded dim and negative dims, keepdim both ways; inputs S(0), S(1), R and Partial
(1-D mesh) and [S(0),S(1)], [S(0),S(0)], [R,S(1)], [P,S(0)] (2x2 mesh); odd sizes, so
2-4 ranks give uneven and empty shards; forward and gradients. Then the communication
each layout costs: none where a Partial or a kept shard carries the result."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from helpers import CollectiveLog as Collectives
from op_check import check_op
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor import clear_cache
from mpidtensor.ops import reductions

P1 = [[Shard(0)], [Shard(1)], [Replicate()]]
P2 = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]]


def as_partial(x: DTensor, op: str = "sum", mesh_dim: int = 0) -> DTensor:
    """``x`` (replicated along ``mesh_dim``) as a Partial(op) there: each rank holds the
    value at every n-th element and the op's neutral filler elsewhere, so every rank
    contributes. Differentiable. Plain tensors (check_op's reference run) pass through."""
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    n, r = mesh.shape[mesh_dim], mesh._coord[mesh_dim]
    grad_placements = list(x.placements)
    grad_placements[mesh_dim] = Partial()
    local = x.to_local(grad_placements=grad_placements)
    mine = torch.arange(local.numel()).reshape(local.shape) % n == r
    if op == "sum":
        filler = torch.zeros_like(local)
    elif op == "product":
        filler = torch.ones_like(local)
    elif local.dtype == torch.bool:
        filler = torch.full_like(local, op == "min")
    else:
        filler = (local - 1 if op == "max" else local + 1).detach()
    placements = list(x.placements)
    placements[mesh_dim] = Partial(op)
    return _WholeGrad.apply(DTensor.from_local(torch.where(mine, local, filler), mesh, placements, shape=x.shape,
                                                       stride=x.stride()))


class _WholeGrad(torch.autograd.Function):
    """Identity whose backward reduces a Partial gradient: ``from_local`` hands a gradient
    with the input's own Partial placement through as its local pieces (as torch does),
    while ``as_partial`` needs the whole gradient on every rank."""

    @staticmethod
    def forward(ctx, t: DTensor) -> DTensor:
        ctx.set_materialize_grads(False)  # no gradient (e.g. the 0-"norm"): pass none on
        return DTensor(t._local_tensor, t._spec, requires_grad=t.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor | None) -> DTensor | None:
        if grad is None:
            return None
        whole = [Replicate() if p.is_partial() else p for p in grad.placements]
        return grad.redistribute(grad.device_mesh, whole)


# --- ops ------------------------------------------------------------------------------------------

INF = math.inf
FLOAT_OPS = {
    "sum": lambda x: x.sum(),
    "sum_0": lambda x: x.sum(0),
    "sum_-1_keep": lambda x: x.sum(-1, keepdim=True),
    "sum_01_f64": lambda x: x.sum((0, -1), dtype=torch.float64),
    "mean": lambda x: x.mean(),
    "mean_0_keep": lambda x: x.mean(0, keepdim=True),
    "mean_-1": lambda x: x.mean(-1),
    "amax_0": lambda x: x.amax(0),
    "amin_-1_keep": lambda x: x.amin(-1, keepdim=True),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "max_0": lambda x: x.max(0),
    "min_-1_keep": lambda x: x.min(-1, keepdim=True),
    "var": lambda x: x.var(),
    "var_0": lambda x: x.var(0),
    "std_-1_keep": lambda x: x.std(-1, keepdim=True),
    "var_1_corr0": lambda x: x.var(1, correction=0),
    "var_mean_0": lambda x: torch.var_mean(x, 0),
    "std_mean_-1_keep": lambda x: torch.std_mean(x, -1, keepdim=True),
    "norm": lambda x: x.norm(),
    "norm_0": lambda x: torch.linalg.vector_norm(x, dim=0),
    "norm1_-1_keep": lambda x: torch.linalg.vector_norm(x, 1, dim=-1, keepdim=True),
    "norminf": lambda x: torch.linalg.vector_norm(x, INF),
    "norm-inf_0": lambda x: torch.linalg.vector_norm(x, -INF, dim=0),
    "norm0_1": lambda x: torch.linalg.vector_norm(x, 0, dim=1),
    "norm3_0": lambda x: torch.linalg.vector_norm(x, 3, dim=0),
    "prod": lambda x: x.prod(),
    "prod_-1_keep": lambda x: x.prod(-1, keepdim=True),
    "logsumexp_0": lambda x: x.logsumexp(0),
    "logsumexp_-1_keep": lambda x: x.logsumexp(-1, keepdim=True),
    "cumsum_0": lambda x: x.cumsum(0),
    "cumprod_-1": lambda x: x.cumprod(-1),
}
INDEX_OPS = {
    "argmax": lambda x: x.argmax(),
    "argmax_keep": lambda x: x.argmax(keepdim=True),
    "argmin_0": lambda x: x.argmin(0),
    "argmax_-1_keep": lambda x: x.argmax(-1, keepdim=True),
    "max_0": lambda x: x.max(0),
    "min_1": lambda x: x.min(1),
}
BOOL_OPS = {
    "any": lambda x: x.any(),
    "any_0": lambda x: x.any(0),
    "all_-1_keep": lambda x: x.all(-1, keepdim=True),
    "all_01": lambda x: torch.all(x, (0, 1)),
}


def _ids(ops: dict) -> list:
    return [pytest.param(fn, id=name) for name, fn in ops.items()]


@pytest.mark.parametrize("fn", _ids(FLOAT_OPS))
def test_float_ops_1d(mesh1d, fn):
    x = global_tensor((5, 7))
    for placements in P1:
        check_op(fn, [x], [placements], mesh1d)


@pytest.mark.parametrize("fn", _ids(FLOAT_OPS))
def test_float_ops_empty_shards(mesh1d, fn):
    """Two rows over 3 or 4 ranks: some blocks are empty."""
    check_op(fn, [global_tensor((2, 3), seed=5)], [[Shard(0)]], mesh1d)


# Ops that combine shards with collectives inside the op when the reduced dim is long
# (on short dims, as above, moving the input's shards away is cheaper and chosen instead).
COMBINING_OPS = {
    name: FLOAT_OPS[name]
    for name in ("max", "max_0", "min_-1_keep", "var", "var_0", "std_-1_keep", "var_1_corr0", "var_mean_0",
                 "std_mean_-1_keep", "norm_0", "norm3_0", "logsumexp_0", "logsumexp_-1_keep", "cumsum_0",
                 "cumprod_-1")
}


@pytest.mark.parametrize("fn", _ids(COMBINING_OPS))
def test_long_dims(mesh1d, fn):
    """Long sharded dims: the shards are combined inside the op (see test_collectives_inside)."""
    check_op(fn, [global_tensor((37, 4))], [[Shard(0)]], mesh1d)
    check_op(fn, [global_tensor((4, 37))], [[Shard(1)]], mesh1d)


@pytest.mark.parametrize("fn", _ids(COMBINING_OPS))
def test_long_dims_2d(mesh2d, fn):
    check_op(fn, [global_tensor((37, 4))], [[Shard(0), Shard(0)]], mesh2d)
    check_op(fn, [global_tensor((4, 37))], [[Replicate(), Shard(1)]], mesh2d)


@pytest.fixture
def always_combine(monkeypatch):
    """Force the combine-inside-the-op path, whatever the cost (plans made meanwhile are dropped)."""
    monkeypatch.setattr(reductions, "_cheapest_way", lambda call, lay, *args: lay)
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("fn", _ids({**COMBINING_OPS, **INDEX_OPS}))
def test_combining_with_empty_shards(mesh1d, always_combine, fn):
    """The combining path on short dims, where blocks are empty at 3 and 4 ranks."""
    for shape in ((2, 3), (5, 7)):
        for placements in ([Shard(0)], [Shard(1)]):
            check_op(fn, [global_tensor(shape)], [placements], mesh1d)


@pytest.mark.parametrize("fn", _ids({**COMBINING_OPS, **INDEX_OPS}))
def test_combining_with_empty_shards_2d(mesh2d, always_combine, fn):
    check_op(fn, [global_tensor((2, 3))], [[Shard(0), Shard(0)]], mesh2d)
    check_op(fn, [global_tensor((5, 7))], [[Shard(1), Shard(0)]], mesh2d)


@pytest.mark.parametrize("fn", _ids(FLOAT_OPS))
def test_float_ops_2d(mesh2d, fn):
    x = global_tensor((5, 7))
    for placements in P2:
        check_op(fn, [x], [placements], mesh2d)


# The 0-"norm" has no gradient: torch leaves it undefined, the Partial construction a zero.
PARTIAL_GRAD = {name: name != "norm0_1" for name in FLOAT_OPS}


@pytest.mark.parametrize("name", FLOAT_OPS)
def test_float_ops_partial(mesh1d, name):
    """A Partial(sum) input: sum/mean/cumsum keep it, the others reduce it first."""
    x, fn = global_tensor((5, 7)), FLOAT_OPS[name]
    check_op(lambda t: fn(as_partial(t)), [x], [[Replicate()]], mesh1d, grad=PARTIAL_GRAD[name])


@pytest.mark.parametrize("name", ["sum_0", "mean", "min", "max_0", "var_0", "norm_0", "prod", "logsumexp_-1_keep",
                                  "cumsum_0", "cumprod_-1"])
def test_float_ops_partial_2d(mesh2d, name):
    x, fn = global_tensor((5, 7)), FLOAT_OPS[name]
    check_op(lambda t: fn(as_partial(t)), [x], [[Replicate(), Shard(0)]], mesh2d)


@pytest.mark.parametrize("op, fn", [
    ("max", lambda x: x.amax(0)), ("max", lambda x: x.max()), ("min", lambda x: x.amin(-1)),
    ("product", lambda x: x.prod(0)), ("product", lambda x: x.cumprod(1)), ("max", lambda x: x.max(1)),
    ("max", lambda x: x.var(0)),
])
def test_other_partials(mesh1d, op, fn):
    x = global_tensor((5, 7))
    check_op(lambda t: fn(as_partial(t, op)), [x], [[Replicate()]], mesh1d, grad=op == "product")


def test_3d_renumbering(mesh1d):
    """Shards of kept dims move down past the reduced dims when keepdim=False."""
    x = global_tensor((5, 3, 7))
    ops = [
        lambda t: t.sum((0, 2)), lambda t: t.mean((0, -1)), lambda t: t.amax(0), lambda t: t.var((0, 2)),
        lambda t: t.max(0), lambda t: t.argmin(1), lambda t: torch.linalg.vector_norm(t, dim=(0, 1)),
        lambda t: t.cumsum(1), lambda t: t.logsumexp((1, 2)), lambda t: t.prod(1),
    ]
    for fn in ops:
        for placements in ([Shard(1)], [Shard(2)]):
            check_op(fn, [x], [placements], mesh1d)


@pytest.mark.parametrize("fn", _ids(INDEX_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("combine", [False, True], ids=["cheapest", "combine"])
def test_index_ops_ties(request, mesh1d, fn, dtype, combine):
    """Many equal values: the first global index must win, whichever rank holds it."""
    if combine:
        request.getfixturevalue("always_combine")
    x = (torch.arange(35).reshape(5, 7) * 7 % 3).to(dtype)
    for placements in P1:
        check_op(fn, [x], [placements], mesh1d, grad=False)


@pytest.mark.parametrize("fn", _ids(INDEX_OPS))
@pytest.mark.parametrize("combine", [False, True], ids=["cheapest", "combine"])
def test_index_ops_nan(request, mesh1d, fn, combine):
    """A NaN wins over every number (torch's rule), also from a later shard."""
    if combine:
        request.getfixturevalue("always_combine")
    x = global_tensor((5, 7))
    x[3, 5] = x[4, 2] = math.nan
    expected = fn(x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for placements in P1:
        out = fn(distribute_tensor(x, mesh1d, placements))
        for got, want in zip(out if isinstance(out, tuple) else (out,), expected):
            assert_close(got.full_tensor(), want, equal_nan=True)


@pytest.mark.parametrize("fn", _ids(INDEX_OPS))
def test_index_ops_2d(mesh2d, fn):
    x = (torch.arange(35).reshape(5, 7) * 7 % 4).float()
    for placements in P2:
        check_op(fn, [x], [placements], mesh2d, grad=False)


@pytest.mark.parametrize("fn", _ids(BOOL_OPS))
def test_bool_ops(mesh1d, fn):
    x = global_tensor((5, 7), torch.bool)
    for placements in P1:
        check_op(fn, [x], [placements], mesh1d)
    for op in ("max", "min"):
        check_op(lambda t: fn(as_partial(t, op)), [x], [[Replicate()]], mesh1d)
    rare = torch.zeros(5, 7, dtype=torch.bool)
    rare[4, 6] = True  # a single True in the last block
    check_op(fn, [rare], [[Shard(0)]], mesh1d)
    check_op(fn, [~rare], [[Shard(1)]], mesh1d)


@pytest.mark.parametrize("fn", _ids(BOOL_OPS))
def test_bool_ops_2d(mesh2d, fn):
    x = global_tensor((5, 7), torch.bool)
    for placements in P2:
        check_op(fn, [x], [placements], mesh2d)


def test_integer_ops(mesh1d):
    x = global_tensor((5, 7), torch.int32)
    ops = [lambda t: t.sum(0), lambda t: t.prod(1), lambda t: t.amax(0), lambda t: t.max(), lambda t: t.cumsum(0),
           lambda t: t.sum(1, dtype=torch.int16)]
    for fn in ops:
        for placements in P1:
            check_op(fn, [x], [placements], mesh1d)


def test_half_precision(mesh1d):
    """float16/bfloat16 accumulate in float32 across shards, as torch does locally."""
    for dtype in (torch.float16, torch.bfloat16):
        x = global_tensor((5, 7), dtype)
        for fn in (lambda t: t.mean(0), lambda t: t.var(0), lambda t: t.norm(), lambda t: t.logsumexp(0)):
            check_op(fn, [x], [[Shard(0)]], mesh1d, grad=False, atol=1e-2, rtol=1e-2)


def test_decomposed_reductions(mesh1d):
    """Reductions torch decomposes into the ops above also run without falling back."""
    x = global_tensor((5, 7))
    ops = [lambda t: t.nansum(0), lambda t: t.count_nonzero(0), lambda t: torch.aminmax(t, dim=0),
           lambda t: t.std(0, unbiased=False), lambda t: torch.norm(t, dim=1)]
    for fn in ops:
        for placements in P1:
            check_op(fn, [x], [placements], mesh1d, grad=False)


# --- communication ---------------------------------------------------------------------------------


def _run(fn, x):
    with Collectives() as seen:
        out = fn(x)
    outs = out if isinstance(out, tuple) else (out,)
    return seen.calls, [o.placements for o in outs]


@pytest.mark.parametrize("fn, expected", [
    (lambda t: t.sum(0), (Partial("sum"),)),
    (lambda t: t.sum(), (Partial("sum"),)),
    (lambda t: t.mean(0), (Partial("sum"),)),
    (lambda t: t.amax(0), (Partial("max"),)),
    (lambda t: t.min(), (Partial("min"),)),
    (lambda t: t.prod(0), (Partial("product"),)),
    (lambda t: (t > 0).any(0), (Partial("max"),)),
    (lambda t: (t > 0).all(), (Partial("min"),)),
    (lambda t: torch.linalg.vector_norm(t, 1, dim=0), (Partial("sum"),)),
    (lambda t: torch.linalg.vector_norm(t, INF), (Partial("max"),)),
    (lambda t: t.sum(1), (Shard(0),)),
    (lambda t: t.var(1), (Shard(0),)),
    (lambda t: t.max(1), (Shard(0),)),
    (lambda t: t.cumsum(1), (Shard(0),)),
])
def test_no_communication(mesh1d, fn, expected):
    """A reduction over a sharded dim gives a Partial, one over a kept dim keeps the shard:
    neither communicates."""
    x = distribute_tensor(global_tensor((5, 7)), mesh1d, [Shard(0)])
    if (x > 0).placements != (Shard(0),):  # warm the comparison's plan outside the count
        raise AssertionError("a pointwise op changed the placement")
    calls, placements = _run(fn, x)
    assert_all_ranks(calls == [], f"collectives {calls}")
    assert_all_ranks(all(p == expected for p in placements), f"placements {placements}")


def test_no_communication_2d(mesh2d):
    x = distribute_tensor(global_tensor((5, 7, 3)), mesh2d, [Shard(0), Shard(2)])
    calls, placements = _run(lambda t: t.sum(0), x)
    assert_all_ranks(calls == [] and placements == [(Partial("sum"), Shard(1))], f"{calls} {placements}")
    calls, placements = _run(lambda t: t.amax((0, 2), keepdim=True), x)
    assert_all_ranks(calls == [] and placements == [(Partial("max"), Partial("max"))], f"{calls} {placements}")


def test_partial_sum_input_stays_partial(mesh1d):
    x = as_partial(distribute_tensor(global_tensor((5, 7)), mesh1d, [Replicate()]))
    for fn in (lambda t: t.sum(0), lambda t: t.mean(), lambda t: t.cumsum(1)):
        calls, placements = _run(fn, x)
        assert_all_ranks(calls == [] and placements == [(Partial("sum"),)], f"{calls} {placements}")


@pytest.mark.parametrize("fn, expected_calls, expected", [
    (lambda t: t.max(0), ["all_gather", "all_gather"], (Replicate(),)),
    (lambda t: t.argmax(), ["all_gather", "all_gather"], (Replicate(),)),
    (lambda t: t.var(0), ["all_reduce"], (Partial("sum"),)),
    (lambda t: t.std(0), ["all_reduce", "all_reduce"], (Replicate(),)),
    (lambda t: t.norm(dim=0), ["all_reduce"], (Replicate(),)),
    (lambda t: t.logsumexp(0), ["all_reduce", "all_reduce"], (Replicate(),)),
    (lambda t: t.cumsum(0), ["all_gather"], (Shard(0),)),
])
def test_collectives_inside(mesh1d, fn, expected_calls, expected):
    """On a long sharded dim the op combines the shards with collectives on output-sized
    statistics, never moving the input."""
    if mesh1d.size() == 1:
        pytest.skip("one rank: nothing to combine")
    x = distribute_tensor(global_tensor((37, 4)), mesh1d, [Shard(0)])
    calls, placements = _run(fn, x)
    assert_all_ranks(calls == expected_calls, f"collectives {calls}")
    assert_all_ranks(all(p == expected for p in placements), f"placements {placements}")


@pytest.mark.parametrize("fn, expected", [
    (lambda t: t.max(0), (Shard(0),)),
    (lambda t: t.var(0), (Shard(0),)),
    (lambda t: t.logsumexp(0), (Shard(0),)),
    (lambda t: t.cumsum(0), (Shard(1),)),
])
def test_short_dims_move_the_input(mesh1d, fn, expected):
    """On a short sharded dim one all-to-all onto a kept dim is cheaper; the op then runs locally."""
    if mesh1d.size() == 1:
        pytest.skip("one rank: nothing to combine")
    x = distribute_tensor(global_tensor((3, 40)), mesh1d, [Shard(0)])
    calls, placements = _run(fn, x)
    assert_all_ranks(calls == ["all_to_all"], f"collectives {calls}")
    assert_all_ranks(all(p == expected for p in placements), f"placements {placements}")


def test_partial_reduced_by_reduce_scatter(mesh1d):
    """A Partial the op cannot keep becomes a shard of a kept dim (reduce-scatter), not a replica."""
    if mesh1d.size() == 1:
        pytest.skip("one rank: no Partial to reduce")
    x = as_partial(distribute_tensor(global_tensor((5, 7)), mesh1d, [Replicate()]))
    calls, placements = _run(lambda t: t.amax(0), x)
    assert_all_ranks(calls == ["reduce_scatter"] and placements == [(Shard(0),)], f"{calls} {placements}")


@pytest.mark.parametrize("ord", [2.0, 1.0, 3.0, math.inf, -math.inf, 0.0])
def test_foreach_norm(mesh1d, ord):
    """``_foreach_norm`` (clip_grad_norm_(foreach=True)) on a list mixing S(0), S(1), R and
    Partial, with uneven and empty shards: each norm replicated and equal to torch's, and
    one all-reduce for all tensors sharded over the mesh (the Partial one is reduced first)."""
    from mpidtensor.debug import CommDebugMode

    shapes = [(7, 5), (3,), (2, 9), (1, 4), (6, 2)]
    places = [[Shard(0)], [Shard(0)], [Shard(1)], [Shard(0)], [Replicate()]]
    full = [global_tensor(s, seed=i) for i, s in enumerate(shapes)]
    full[1][1] = 0.0  # a zero for ord=0
    dts = [distribute_tensor(t, mesh1d, p) for t, p in zip(full, places)]
    dts.append(as_partial(distribute_tensor(global_tensor((4, 3), seed=9), mesh1d, [Replicate()])))
    full.append(global_tensor((4, 3), seed=9))
    with CommDebugMode() as comm:
        norms = torch._foreach_norm(dts, ord)
    want = torch._foreach_norm(full, ord)
    for n, w in zip(norms, want):
        assert_all_ranks(isinstance(n, DTensor) and n.placements == (Replicate(),), f"{n}")
        assert_close(n.to_local(), w, atol=1e-5, rtol=1e-5)
    counts = comm.get_comm_counts()
    expected = {"all_reduce": 2} if mesh1d.size() > 1 else {}  # the sharded group, the Partial
    assert_all_ranks(counts == expected, f"{counts}")


def test_foreach_norm_2d(mesh2d):
    """2x2 mesh: tensors sharded over both dims, one dim, or none, each group one all-reduce."""
    from mpidtensor.debug import CommDebugMode

    shapes = [(7, 5), (3, 6), (5,), (2, 3)]
    places = [[Shard(0), Shard(1)], [Replicate(), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Replicate()]]
    full = [global_tensor(s, seed=i) for i, s in enumerate(shapes)]
    dts = [distribute_tensor(t, mesh2d, p) for t, p in zip(full, places)]
    for ord in (2.0, math.inf):
        with CommDebugMode() as comm:
            norms = torch._foreach_norm(dts, ord)
        for n, w in zip(norms, torch._foreach_norm(full, ord)):
            assert_close(n.full_tensor(), w, atol=1e-5, rtol=1e-5)
        assert_all_ranks(comm.get_comm_counts() == {"all_reduce": 2}, f"{comm.get_comm_counts()}")
