"""Indexing ops on DTensors against plain torch: index_select, gather, scatter*,
index_add, advanced indexing, sort/topk/kthvalue, masked_fill/where, new_*."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from helpers import CollectiveLog as _Count
from op_check import check_op
from mpidtensor import Partial, Replicate, Shard, distribute_tensor
from mpidtensor.runtime.settings import settings

S0, S1, R, P = [Shard(0)], [Shard(1)], [Replicate()], [Partial()]


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _rows_perm(rows: int, cols: int, k: int, seed: int = 5) -> torch.Tensor:
    """``k`` distinct column indices per row (scatter is only deterministic without repeats)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(cols, generator=gen)[:k] for _ in range(rows)])


X = global_tensor((7, 9))
IDX = _ints([6, 0, 3, 3, 1])  # repeats, and rows that 2, 3 and 4 ranks hold unevenly


# --- index_select -------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("px", [S0, S1, R, P])
@pytest.mark.parametrize("pi", [None, S0])
def test_index_select(mesh1d, dim, px, pi):
    check_op(lambda x, i: x.index_select(dim, i), [X, IDX], [px, pi], mesh1d)


def test_index_select_scalar_index(mesh1d):
    check_op(lambda x, i: x.index_select(0, i), [X, _ints(4)], [S0, None], mesh1d)


def test_index_select_keeps_other_shard_without_communication(mesh1d):
    x = distribute_tensor(X, mesh1d, S0)
    with _Count() as count:
        y = x.index_select(1, IDX)
    assert_all_ranks(count.calls == [] and y.placements == (Shard(0),), f"{count.calls} {y.placements}")


def test_index_select_sharded_dim_gives_partial(mesh1d):
    """Few rows of a row-sharded table: each rank reads its own rows, no data moves."""
    table = global_tensor((40, 3))
    x = distribute_tensor(table, mesh1d, S0)
    with _Count() as count:
        y = x.index_select(0, IDX)
    assert_all_ranks(count.calls == [] and y.placements == (Partial(),), f"{count.calls} {y.placements}")
    assert_close(y.full_tensor(), table.index_select(0, IDX))


# --- gather / scatter ---------------------------------------------------------------------------


@pytest.mark.parametrize("px", [S0, S1, R])
@pytest.mark.parametrize("pi", [None, S0, S1])
def test_gather(mesh1d, px, pi):
    check_op(lambda x, i: torch.gather(x, 1, i), [X, _rows_perm(7, 9, 4)], [px, pi], mesh1d)
    check_op(lambda x, i: torch.gather(x, 0, i), [X, _rows_perm(5, 7, 9).T.contiguous()], [px, pi], mesh1d)


def test_gather_partial(mesh1d):
    check_op(lambda x, i: torch.gather(x, 1, i), [X, _rows_perm(7, 9, 4)], [P, None], mesh1d)


SCATTERS = {
    "scatter": lambda x, i, s: x.scatter(1, i, s),
    "scatter_value": lambda x, i, s: x.scatter(1, i, 2.5),
    "scatter_add": lambda x, i, s: x.scatter_add(1, i, s),
    "reduce_sum": lambda x, i, s: x.scatter_reduce(1, i, s, "sum"),
    "reduce_amax": lambda x, i, s: x.scatter_reduce(1, i, s, "amax"),
    "reduce_mean": lambda x, i, s: x.scatter_reduce(1, i, s, "mean", include_self=False),
}


@pytest.mark.parametrize("name", SCATTERS)
@pytest.mark.parametrize("px,pi,ps", [(S0, S0, S0), (S1, None, R), (R, S0, S1), (S1, S1, S1), (R, None, R)])
def test_scatter(mesh1d, name, px, pi, ps):
    src = global_tensor((7, 4), seed=3)
    check_op(SCATTERS[name], [X, _rows_perm(7, 9, 4), src], [px, pi, ps], mesh1d)


def test_scatter_add_partial(mesh1d):
    src = global_tensor((7, 4), seed=3)
    out = check_op(lambda x, i, s: x.scatter_add(1, i, s), [X, _rows_perm(7, 9, 4), src], [P, None, P], mesh1d)
    assert_all_ranks(out[0].placements == (Partial(),), f"{out[0].placements}")


def test_scatter_inplace(mesh1d):
    src = global_tensor((7, 4), seed=3)
    index = _rows_perm(7, 9, 4)
    for px in (S0, S1):
        x = distribute_tensor(X.clone(), mesh1d, px)
        x.scatter_add_(1, index, distribute_tensor(src, mesh1d, R))
        assert_all_ranks(x.placements == tuple(px), f"{x.placements}")
        assert_close(x.full_tensor(), X.scatter_add(1, index, src))


@pytest.mark.parametrize("px,pi,ps", [(S0, None, R), (S1, None, S1), (R, S0, S0), (S0, S0, S0)])
def test_index_add(mesh1d, px, pi, ps):
    source = global_tensor((5, 9), seed=4)
    check_op(lambda x, i, s: x.index_add(0, i, s, alpha=0.5), [X, IDX, source], [px, pi, ps], mesh1d)


# --- advanced indexing --------------------------------------------------------------------------

X3 = global_tensor((5, 6, 7))
INDEXINGS = {
    "rows": (lambda x, i: x[i], X, _ints([4, -1, 0, 2]), None),
    "rows_2d": (lambda x, i: x[i], X, _ints([[4, 0, 6], [1, 1, -7]]), None),
    "cols": (lambda x, i: x[:, i], X, _ints([8, 0, -2, 3]), None),
    "points": (lambda x, i, j: x[i, j], X, _ints([6, 0, 3]), _ints([[1], [8]])),
    "split_3d": (lambda x, i, j: x[i, :, j], X3, _ints([4, 0, 2]), _ints([6, -7, 3])),
    "inner_3d": (lambda x, i, j: x[:, i, j], X3, _ints([5, 0]), _ints([6, 1])),
}


@pytest.mark.parametrize("name", INDEXINGS)
@pytest.mark.parametrize("px", [S0, S1, R])
def test_index(mesh1d, name, px):
    fn, x, i, j = INDEXINGS[name]
    inputs, placements = [x, i], [px, None]
    if j is not None:
        inputs, placements = [x, i, j], [px, None, None]
    check_op(fn, inputs, placements, mesh1d)


@pytest.mark.parametrize("px", [S0, S1, R, P])
def test_index_sharded_indices(mesh1d, px):
    ids = _ints([[4, 0, 6, 2, 2], [1, 1, 5, 3, 0], [6, 6, 0, 1, 2]])
    check_op(lambda x, i: x[i], [X, ids], [px, S0], mesh1d)
    check_op(lambda x, i: x[i], [X, ids], [px, S1], mesh1d)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("px,pv", [(S0, R), (S1, S1), (R, R), (S0, S0), (P, P)])
def test_index_put(mesh1d, accumulate, px, pv):
    idx = _ints([6, 0, 3, -2]) if not accumulate else IDX
    values = global_tensor((len(idx), 9), seed=6)

    def put(x, v, i):
        return x.index_put((i,), v, accumulate=accumulate)

    check_op(put, [X, values, idx], [px, pv, None], mesh1d)


def test_index_put_inplace_broadcast_value(mesh1d):
    idx = _ints([0, 5, 2])
    for px in (S0, S1):
        x = distribute_tensor(X.clone(), mesh1d, px)
        x[:, idx] = torch.tensor(3.0)
        expected = X.clone()
        expected[:, idx] = 3.0
        assert_close(x.full_tensor(), expected)


@pytest.mark.parametrize("px,pm", [(S0, S0), (S1, S1), (S1, R), (S0, None), (R, S1)])
def test_index_put_boolean_mask(mesh1d, monkeypatch, px, pm):
    mask = global_tensor((7, 9), torch.bool, seed=8)
    x3 = global_tensor((5, 6, 7), seed=2)
    mask3 = global_tensor((5, 6), torch.bool, seed=4)

    def put(x, value, mask, dims):
        out = x.clone()
        out[mask if dims == 2 else (slice(None), mask)] = value
        return out

    check_op(lambda x, m: put(x, -1.0, m, 2), [X, mask], [px, pm], mesh1d)
    check_op(lambda x, m: put(x, torch.tensor(3.0), m, 1), [X, mask[0]], [px, None], mesh1d)
    check_op(lambda x, m: put(x, -1.0, m, 2), [x3, mask3], [px, pm], mesh1d)
    values = global_tensor((int(mask.sum()),), seed=1)
    monkeypatch.setattr(settings, "strict", False)  # the values' gradient, grad[mask], has a data-dependent shape
    check_op(lambda x, m, v: put(x, v, m, 2), [X, mask, values], [px, pm, S0], mesh1d)


def test_index_embedding_style_backward_is_sharded(mesh1d):
    """Rows of a row-sharded table read by index: forward and backward stay exact."""
    table = global_tensor((11, 4))
    ids = _ints([[10, 0, 3], [3, 7, 9]])
    check_op(lambda t, i: t[i] * 2, [table, ids], [S0, None], mesh1d)
    check_op(lambda t, i: t[i] * 2, [table, ids], [S0, S0], mesh1d)


# --- sort, topk, kthvalue -----------------------------------------------------------------------

ALONG = {
    "topk_last": lambda x: x.topk(3, dim=-1),
    "topk_0_smallest": lambda x: x.topk(4, dim=0, largest=False),
    "sort_1": lambda x: x.sort(dim=1, descending=True),
    "sort_0_stable": lambda x: torch.sort(x, dim=0, stable=True),
    "kthvalue": lambda x: x.kthvalue(2, dim=1),
    "kthvalue_keepdim": lambda x: x.kthvalue(3, dim=0, keepdim=True),
}


@pytest.mark.parametrize("name", ALONG)
@pytest.mark.parametrize("px", [S0, S1, R, P])
def test_along_dim(mesh1d, name, px):
    check_op(ALONG[name], [X], [px], mesh1d)


def test_topk_rows_no_communication(mesh1d):
    x = distribute_tensor(X, mesh1d, S0)
    with _Count() as count:
        values, indices = x.topk(3)
    assert_all_ranks(count.calls == [] and indices.placements == (Shard(0),), f"{count.calls}")


def test_sort_along_sharded_dim_moves_to_other_dim(mesh1d):
    x = distribute_tensor(X, mesh1d, S1)
    with _Count() as count:
        values, indices = x.sort(dim=1)
    ok = mesh1d.size() == 1 or (count.calls == ["all_to_all"] and values.placements == (Shard(0),))
    assert_all_ranks(ok, f"{count.calls} {values.placements}")
    assert_close(indices.full_tensor(), X.sort(dim=1).indices)


def test_sort_1d(mesh1d):
    check_op(lambda x: x.sort(), [global_tensor((11,))], [S0], mesh1d)


# --- masked_fill / where ------------------------------------------------------------------------


@pytest.mark.parametrize("px,pm", [(S0, S1), (S1, R), (S0, None), (R, S0)])
def test_masked_fill_and_where(mesh1d, px, pm):
    mask = global_tensor((7, 9), torch.bool, seed=8)
    y = global_tensor((7, 9), seed=9)
    check_op(lambda x, m: x.masked_fill(m, -1.5), [X, mask], [px, pm], mesh1d)
    check_op(lambda x, m: x.masked_fill(m, torch.tensor(2.0)), [X, mask], [px, pm], mesh1d)
    check_op(lambda x, m, o: torch.where(m, x, o), [X, mask, y], [px, pm, S1], mesh1d)
    check_op(lambda x, m: x.masked_fill(m[0], 0.0), [X, mask], [px, pm], mesh1d)  # broadcast row mask


# --- new_* --------------------------------------------------------------------------------------


def test_new_factories(mesh1d):
    x = distribute_tensor(X, mesh1d, S0)
    same = x.new_zeros((7, 9))
    other = x.new_full((7, 4), 2.0)
    resized = x.new_ones((3, 9))
    strided = x.new_empty_strided((7, 9), (9, 1))
    assert_all_ranks(same.placements == (Shard(0),), f"{same.placements}")
    assert_all_ranks(other.placements == (Shard(0),), f"{other.placements}")
    assert_all_ranks(resized.placements == (Replicate(),), f"{resized.placements}")
    assert_all_ranks(strided.placements == (Shard(0),) and strided.to_local().shape == x.to_local().shape, "strided")
    assert_close(same.full_tensor(), torch.zeros(7, 9))
    assert_close(other.full_tensor(), torch.full((7, 4), 2.0))
    assert_close(resized.full_tensor(), torch.ones(3, 9))
    partial = distribute_tensor(X, mesh1d, P).new_zeros((7, 9), dtype=torch.float64)
    assert_all_ranks(partial.placements == (Replicate(),) and partial.dtype == torch.float64, "partial")
    assert_close(partial.full_tensor(), torch.zeros(7, 9, dtype=torch.float64))


# --- 2-D mesh -----------------------------------------------------------------------------------

MESH2 = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Partial()]]


@pytest.mark.parametrize("px", MESH2)
def test_2d_mesh(mesh2d, px):
    src = global_tensor((7, 4), seed=3)
    cols = _rows_perm(7, 9, 4)
    check_op(lambda x, i: x.index_select(0, i), [X, IDX], [px, None], mesh2d)
    check_op(lambda x, i: x.index_select(1, i), [X, IDX], [px, [Shard(0), Replicate()]], mesh2d)
    check_op(lambda x, i: torch.gather(x, 1, i), [X, cols], [px, None], mesh2d)
    check_op(lambda x, i, s: x.scatter_add(1, i, s), [X, cols, src], [px, None, [Shard(0), Replicate()]], mesh2d)
    check_op(lambda x, i: x[i], [X, IDX], [px, [Replicate(), Shard(0)]], mesh2d)
    check_op(lambda x, i: x.index_put((i,), x[i] * 2, accumulate=True), [X, IDX], [px, None], mesh2d)
    check_op(lambda x: x.topk(2, dim=1), [X], [px], mesh2d)
    check_op(lambda x: x.sort(dim=0), [X], [px], mesh2d)
