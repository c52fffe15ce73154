"""View and shape ops on DTensors against plain torch: forward and gradients, every
input placement, odd sizes (uneven and empty shards at 2-4 ranks), 1-D and 2-D meshes.

Related ops share one ``check_op`` call (a function returning a tuple of outputs)
to keep the file quick under ``mpiexec``."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from helpers import CollectiveLog as Collectives
from op_check import check_op
from mpidtensor import Partial, Replicate, Shard, distribute_tensor

WORLD = MPI.COMM_WORLD.size
P1 = [[Shard(0)], [Shard(1)], [Shard(2)], [Replicate()], [Partial()]]
P2 = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(2), Shard(0)], [Partial(), Shard(1)]]
MESHES = ["mesh1d", "mesh2d"]


def _check_all(request, mesh_name: str, x: torch.Tensor, fn, **kw) -> None:
    """``check_op(fn, [x])`` for every placement set of the mesh that fits ``x``."""
    mesh = request.getfixturevalue(mesh_name)
    for placements in P1 if mesh_name == "mesh1d" else P2:
        if all(not isinstance(p, Shard) or p.dim < x.ndim for p in placements):
            check_op(fn, [x], [placements], mesh, **kw)


# --- renumbering views -----------------------------------------------------------------------------


def _permutes(x):
    return x.transpose(-2, -1), x.movedim(-1, 0), x[0].t(), x.unsqueeze(-1), x[None, :, None]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_transpose_permute_unsqueeze(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((5, 7, 3)), _permutes)


def test_renumbering_moves_nothing(mesh1d):
    x = distribute_tensor(global_tensor((5, 7, 3)), mesh1d, [Shard(0)])
    with Collectives() as seen:
        y = x.transpose(0, 2).unsqueeze(0).permute(0, 2, 1, 3)
    assert_all_ranks(not seen.calls, f"collectives {seen.calls}")
    assert_all_ranks(y.placements == (Shard(3),), f"placements {y.placements}")


def _squeezes(x):
    return x.squeeze(), x.squeeze(-1), x.squeeze((1, -1, 0))


@pytest.mark.parametrize("mesh_name", MESHES)
def test_squeeze(request, mesh_name):
    """Dims 1 and 3 have size 1: sharding them leaves all data on the first rank."""
    _check_all(request, mesh_name, global_tensor((5, 1, 7, 1)), _squeezes)


@pytest.mark.parametrize("shape", [(7, 1), (1, 7)])
def test_squeeze_keeps_global_size_one_dims_only(request, shape):
    """7 rows over 4 ranks leave a local block of 1 row, which must not be squeezed."""
    _check_all(request, "mesh1d", global_tensor(shape), lambda x: x.squeeze())


# --- expand and repeat -----------------------------------------------------------------------------


def _expands(x):
    return x.expand(3, 5, 4, 7), x[:, :, :1].expand(-1, -1, 3), x.repeat(1, 3, 1, 2)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_expand_repeat(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((5, 1, 7)), _expands)


# --- view / reshape --------------------------------------------------------------------------------


def _views_675(x):
    return (
        x.view(-1), x.view(42, 5), x.view(2, 3, 35), x.flatten(1), x.reshape(-1, 10, 3), x.unflatten(0, (2, 1, 3)),
    )


def _views_12_5(x):
    return x.view(60), x.reshape(2, 2, 3, 5).view_as(torch.empty(4, 15))


@pytest.mark.parametrize("mesh_name", MESHES)
def test_view_reshape(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((6, 7, 5)), _views_675)
    _check_all(request, mesh_name, global_tensor((12, 5)), _views_12_5)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_reshape_of_non_contiguous(request, mesh_name):
    """``reshape`` of a transposed tensor copies (``clone`` + ``_unsafe_view``)."""
    _check_all(
        request, mesh_name, global_tensor((5, 7, 3)),
        lambda x: (x.transpose(0, 1).reshape(-1), x.permute(2, 1, 0).reshape(21, 5), x.mT.flatten(0, 1)),
    )


def test_aligned_view_moves_nothing(mesh1d):
    """Two rows per rank merge into the chunks of the flat dim, and split back."""
    x = distribute_tensor(global_tensor((2 * WORLD, 7)), mesh1d, [Shard(0)])
    with Collectives() as seen:
        flat = x.view(-1)
        back = flat.view(2 * WORLD, 7)
    assert_all_ranks(not seen.calls, f"collectives {seen.calls}")
    assert_all_ranks(flat.placements == back.placements == (Shard(0),), f"{flat.placements} {back.placements}")


@pytest.mark.skipif(WORLD == 1, reason="needs several ranks")
def test_misaligned_view_moves_shard_to_another_dim(mesh1d):
    """Merging the sharded dim would leave uneven runs: the shard moves to the untouched
    last dim by one all-to-all, instead of gathering the tensor."""
    x = global_tensor((WORLD + 1, 3, 4 * WORLD))
    y = check_op(lambda t: t.view(-1, 4 * WORLD), [x], [[Shard(0)]], mesh1d)[0]
    assert_all_ranks(y.placements == (Shard(1),), f"placements {y.placements}")
    d = distribute_tensor(x, mesh1d, [Shard(0)])
    with Collectives() as seen:
        d.view(-1, 4 * WORLD)
    assert_all_ranks(seen.calls == ["all_to_all"], f"collectives {seen.calls}")


def test_view_as_dtype(mesh1d):
    x = global_tensor((5, 6))
    for placements in P1[:2] + P1[3:]:
        check_op(lambda t: (t.view(torch.int32), t.view(torch.int16)), [x], [placements], mesh1d, grad=False)


def test_view_of_empty(mesh1d):
    for placements in P1[:2] + P1[3:]:
        check_op(lambda t: t.view(0, 5, 7), [global_tensor((5, 0, 7))], [placements], mesh1d)


# --- slices ----------------------------------------------------------------------------------------


def _slices(x):
    return x[1:6], x[::2], x[1::3, :, 1:], x[:, -4:-1], x.narrow(2, 1, 3), x[2:2]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_slice(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((7, 9, 5)), _slices)


def _selects(x):
    return x[2], x[:, -1], x[-1, 3]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_select(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((7, 9, 5)), _selects)


def test_select_on_sharded_dim_is_partial_without_communication(mesh1d):
    x = distribute_tensor(global_tensor((7, 5)), mesh1d, [Shard(0)])
    with Collectives() as seen:
        row = x[5]
    assert_all_ranks(not seen.calls, f"collectives {seen.calls}")
    assert_all_ranks(row.placements == (Partial(),), f"placements {row.placements}")
    ok = torch.equal(row.full_tensor(), global_tensor((7, 5))[5])
    assert_all_ranks(ok, "wrong row")


def test_select_of_integers(mesh1d):
    """No Partial for integer data: the shard moves to another dim first."""
    x = global_tensor((8, 9), dtype=torch.int64)
    for placements in P1[:2] + P1[3:4]:
        check_op(lambda t: (t[3], t[:, -2], t[1:5:2]), [x], [placements], mesh1d)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_slice_and_select_backward_ops(request, mesh_name):
    """The backward ops called directly, so their gradient input takes every placement."""
    aten = torch.ops.aten
    _check_all(request, mesh_name, global_tensor((4, 9, 3)), lambda g: aten.slice_backward(g, [9, 9, 3], 0, 2, 9, 2))
    _check_all(request, mesh_name, global_tensor((9, 3)), lambda g: aten.select_backward(g, [9, 7, 3], 1, -2))


# --- split, chunk, unbind --------------------------------------------------------------------------


def _splits(x):
    return *x.split(4), *x.split([4, 0, 5], dim=1), *x.chunk(2, dim=-1)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_split_chunk_unbind(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((7, 9, 2)), _splits)
    _check_all(request, mesh_name, global_tensor((7, 9, 2)), lambda x: x.unbind(-1))


def test_split_along_unsharded_dim_moves_nothing(mesh1d):
    x = distribute_tensor(global_tensor((7, 9)), mesh1d, [Shard(0)])
    with Collectives() as seen:
        pieces = x.split(4, dim=1)
    assert_all_ranks(not seen.calls, f"collectives {seen.calls}")
    assert_all_ranks(all(p.placements == (Shard(0),) for p in pieces), "pieces lost their shard")


@pytest.mark.skipif(WORLD == 1, reason="needs several ranks")
def test_split_of_sharded_dim_moves_shard_to_another_dim(mesh1d):
    """The pieces cannot all keep chunk layouts: one all-to-all shards dim 1 instead."""
    x = distribute_tensor(global_tensor((7, 9)), mesh1d, [Shard(0)])
    with Collectives() as seen:
        pieces = x.split(3)
    assert_all_ranks(seen.calls == ["all_to_all"], f"collectives {seen.calls}")
    assert_all_ranks(all(p.placements == (Shard(1),) for p in pieces), "pieces are not sharded on dim 1")


# --- diagonal and unfold --------------------------------------------------------------------------


def _diagonals_windows(x):
    return x.diagonal(), x.diagonal(1, -1, 0), x.unfold(1, 3, 2), x.narrow_copy(0, 1, 3)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_diagonal_unfold(request, mesh_name):
    _check_all(request, mesh_name, global_tensor((5, 7, 3)), _diagonals_windows)


# --- cat and stack ---------------------------------------------------------------------------------


def _joins(a, b):
    return torch.cat([a, b]), torch.cat([b, a], dim=-1), torch.stack([a, b], dim=-1)


PAIRS_1D = [
    ([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)]), ([Shard(0)], [Shard(1)]), ([Replicate()], [Shard(1)]),
    ([Partial()], [Partial()]), ([Partial()], None),
]
PAIRS_2D = [
    ([Shard(0), Shard(1)], [Shard(0), Shard(1)]), ([Shard(1), Shard(1)], [Replicate(), Shard(0)]),
    ([Partial(), Shard(0)], [Partial(), Replicate()]),
]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_cat_stack(request, mesh_name):
    mesh = request.getfixturevalue(mesh_name)
    a, b = global_tensor((5, 7)), global_tensor((5, 7), seed=5)
    for pa, pb in PAIRS_1D if mesh_name == "mesh1d" else PAIRS_2D:
        check_op(_joins, [a, b], [pa, pb], mesh)


def test_cat_along_unsharded_dim_moves_nothing(mesh1d):
    a = distribute_tensor(global_tensor((5, 7)), mesh1d, [Shard(1)])
    b = distribute_tensor(global_tensor((3, 7)), mesh1d, [Shard(1)])
    with Collectives() as seen:
        c = torch.cat([a, b])
    assert_all_ranks(not seen.calls, f"collectives {seen.calls}")
    assert_all_ranks(c.placements == (Shard(1),), f"placements {c.placements}")


# --- chains ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", MESHES)
def test_chain_like_attention_heads(request, mesh_name):
    """Split heads, move them forward, merge back: the pattern of multi-head attention."""
    _check_all(
        request, mesh_name, global_tensor((3, 5, 12)),
        lambda x: x.view(3, 5, 4, 3).transpose(1, 2).reshape(3, 4, 15).unsqueeze(0)[0, :, 1:].flatten(1),
    )


@pytest.mark.parametrize("as_dtensor", [True, False], ids=["dtensor indices", "plain indices"])
def test_tensor_split_by_a_tensor_of_indices(mesh1d, as_dtensor):
    """torch's kernel reads the indices through a data pointer a DTensor lacks: mpidtensor's
    reads their values (1-D: split points, 0-d: a section count), forward and gradients."""
    def wrap(t):
        return distribute_tensor(t, mesh1d, [Shard(0)] if t.ndim else [Replicate()]) if as_dtensor else t

    for indices, dim in ((torch.tensor([1, 4, 4]), 1), (torch.tensor(3), 0), (torch.tensor([2, 6]), 0)):
        check_op(lambda x: torch.tensor_split(x, wrap(indices), dim), [global_tensor((7, 6))], [[Shard(0)]], mesh1d)
    x = distribute_tensor(global_tensor((7, 6)), mesh1d, [Shard(0)])
    raises_everywhere(RuntimeError, lambda: torch.tensor_split(x, wrap(torch.tensor([1.0, 2.0]))), "dtype of long")
    raises_everywhere(RuntimeError, lambda: torch.tensor_split(x, wrap(torch.tensor([[1, 2]]))), "one-dimensional")


def test_unbind_keeps_other_shards_and_moves_the_sharded_dim(mesh1d):
    """Unbinding an unsharded dim keeps the shards (no collective, as torch); unbinding the
    sharded dim moves its shards first and equals one process (torch raises)."""
    full = global_tensor((WORLD, 3))
    x = distribute_tensor(full, mesh1d, [Shard(1)])
    with Collectives() as seen:
        rows = x.unbind(0)
    assert_all_ranks(not seen.calls and all(r.placements == (Shard(0),) for r in rows), f"{seen.calls}")
    for got, want in zip(rows, full.unbind(0)):
        assert_close(got.full_tensor(), want)
    for got, want in zip(x.unbind(1), full.unbind(1)):
        assert_close(got.full_tensor(), want)
