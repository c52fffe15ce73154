"""Where torch's DTensor tests found mpidtensor running more collectives than torch, or
missing an internal frameworks call (issue 38): each case against one process (values,
gradients) and against the collective count torch's test asserts.

- ``Partial * Partial``: one operand reduced (one all-reduce), the product ``Partial``;
- ``maximum``/``minimum`` of ``Partial("max")``/``Partial("min")`` inputs: no collective;
- ``view`` keeping a shard of a size-1 dim: no collective (a shard of a size-1 dim is all
  on the first rank);
- a Partial-to-Partial redistribute's backward keeps the Partial gradient;
- torch's ``DTensorSpec.tensor_meta`` / ``dim_map``, ``_StridedShard._split_tensor``,
  ``Shard``/``_StridedShard._to_replicate_tensor``, and torch's ``_utils`` helpers
  ``compute_global_tensor_shape`` / ``_compute_local_shape_and_global_offset`` (the
  switch routes torch's names to these).
"""
import itertools

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor, init_device_mesh
from mpidtensor.compat.torch_utils import _compute_local_shape_and_global_offset, compute_global_tensor_shape
from mpidtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD


def _terms(full: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """This rank's term of a Partial(reduce_op) whose full value is ``full``."""
    if reduce_op == "sum":
        return full / WORLD.size
    if reduce_op == "max":  # every rank at most full, rank 0 exactly full
        return full if WORLD.rank == 0 else full - 1 - WORLD.rank
    return full if WORLD.rank == 0 else full + 1 + WORLD.rank


@pytest.mark.parametrize("form", ["mul", "rmul", "div"])
def test_partial_times_partial_one_collective(mesh1d, form):
    a, b = global_tensor((5, 3)), global_tensor((5, 3), seed=7).abs() + 1
    pa = DTensor.from_local(_terms(a, "sum"), mesh1d, [Partial()])
    pb = DTensor.from_local(_terms(b, "sum"), mesh1d, [Partial()])
    fn = {"mul": lambda x, y: x * y, "rmul": lambda x, y: y * x, "div": lambda x, y: x / y}[form]
    with CommDebugMode() as comm:
        out = fn(pa, pb)
    expected_count = 0 if WORLD.size == 1 else 1
    assert_all_ranks(out.placements == (Partial(),) and comm.get_total_counts() == expected_count,
                     f"{out.placements} {comm.get_comm_counts()}")
    assert_close(out.full_tensor(), fn(a, b))


def test_partial_times_partial_gradients(mesh1d):
    """Two Partial(sum) products (a contraction over a sharded dim each) multiplied: the
    gradients of all four factors equal one process's."""
    n = 2 * WORLD.size + 1  # the contracted dim is uneven over the mesh
    full = [global_tensor(s, seed=k) for k, s in enumerate([(4, n), (n, 3), (4, n), (n, 3)])]
    placements = [[Shard(1)], [Shard(0)], [Shard(1)], [Shard(0)]]
    leaves = [distribute_tensor(t, mesh1d, p).requires_grad_() for t, p in zip(full, placements)]
    w = global_tensor((4, 3), seed=9)
    left, right = leaves[0] @ leaves[1], leaves[2] @ leaves[3]
    assert_all_ranks(WORLD.size == 1 or left.placements == right.placements == (Partial(),), f"{left.placements}")
    (left * right * distribute_tensor(w, mesh1d, [Replicate()])).sum().backward()
    plain = [t.clone().requires_grad_() for t in full]
    ((plain[0] @ plain[1]) * (plain[2] @ plain[3]) * w).sum().backward()
    for leaf, ref in zip(leaves, plain):
        assert_close(leaf.grad.full_tensor(), ref.grad)


@pytest.mark.parametrize("op,reduce_op", [(torch.maximum, "max"), (torch.minimum, "min"), (torch.max, "max"),
                                          (torch.min, "min")])
@pytest.mark.parametrize("other", ["partial", "replicate"])
def test_extremum_keeps_partial(mesh1d, op, reduce_op, other):
    a, b = global_tensor((6, 4)), global_tensor((6, 4), seed=11)
    pa = DTensor.from_local(_terms(a, reduce_op), mesh1d, [Partial(reduce_op)])
    if other == "partial":
        pb = DTensor.from_local(_terms(b, reduce_op), mesh1d, [Partial(reduce_op)])
    else:
        pb = distribute_tensor(b, mesh1d, [Replicate()])
    with CommDebugMode() as comm:
        out = op(pa, pb)
    assert_all_ranks(out.placements == (Partial(reduce_op),) and comm.get_total_counts() == 0,
                     f"{out.placements} {comm.get_comm_counts()}")
    assert_close(out.full_tensor(), op(a, b))


@pytest.mark.parametrize("op,reduce_op", [(torch.maximum, "sum"), (torch.minimum, "max"), (torch.maximum, "min")])
def test_extremum_of_other_partial_is_reduced(mesh1d, op, reduce_op):
    """maximum of a Partial("sum") or "min", minimum of a "max": the terms are reduced first
    (value as one process)."""
    a, b = global_tensor((6, 4)), global_tensor((6, 4), seed=11)
    pa = DTensor.from_local(_terms(a, reduce_op), mesh1d, [Partial(reduce_op)])
    out = op(pa, distribute_tensor(b, mesh1d, [Replicate()]))
    assert_all_ranks(WORLD.size == 1 or not out.placements[0].is_partial(), f"{out.placements}")
    assert_close(out.full_tensor(), op(a, b))


@pytest.mark.parametrize("dim0", [1, "n+1"])
def test_view_keeps_uneven_shard(mesh1d, dim0):
    """torch's test_dtensor_view_op_uneven: the shard of dim 0 stays through views that keep
    dim 0, even when dim 0 is shorter than the mesh (no collective, the same storage)."""
    n = WORLD.size + 1 if dim0 == "n+1" else 1
    full = global_tensor((n, 2, 2, 2))
    dt = distribute_tensor(full, mesh1d, [Shard(0)])
    for shape in [(n, 2, 4), (n, 4, 2), (n, 8), (n, 1, 8)]:
        with CommDebugMode() as comm:
            view = dt.view(*shape)
        same = view.to_local().data_ptr() == dt.to_local().data_ptr() or dt.to_local().numel() == 0
        assert_all_ranks(comm.get_total_counts() == 0 and view.placements == (Shard(0),) and same,
                         f"{shape}: {view.placements} {comm.get_comm_counts()}")
        assert_close(view.full_tensor(), full.view(*shape))


def test_view_of_sharded_unit_dim_without_partner(mesh1d):
    """A size-1 sharded dim that the view drops (no size-1 output dim) is gathered first."""
    full = global_tensor((1, 4, 3))
    dt = distribute_tensor(full, mesh1d, [Shard(0)])
    assert_close(dt.view(12).full_tensor(), full.view(12))
    assert_close(dt.view(4, 3).full_tensor(), full.view(4, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_partial_to_partial_backward_keeps_partial(mesh1d, dtype):
    """A Partial-to-Partial redistribute's backward keeps its Partial gradient, no
    collective (torch's rule; ``from_local`` settles it where it leaves DTensor:
    tests/test_partial_gradients.py)."""
    local = torch.ones(12, 3, dtype=dtype, requires_grad=True)
    pt = distribute_tensor(local, mesh1d, [Partial()])
    with CommDebugMode() as comm:
        again = pt.redistribute(mesh1d, [Partial()])
        again.backward(DTensor.from_local(torch.ones(12, 3, dtype=dtype), mesh1d, [Partial()]))
    assert_all_ranks(pt.grad.placements == (Partial(),) and comm.get_total_counts() == 0,
                     f"{pt.grad.placements} {comm.get_comm_counts()}")
    assert_close(pt.grad.to_local(), torch.ones(12, 3, dtype=dtype))
    assert_close(pt.grad.full_tensor(), torch.full((12, 3), float(WORLD.size), dtype=dtype))


def test_partial_backward_into_other_placement_settles(mesh1d):
    """A Partial input whose gradient arrives sharded gets it replicated, as before."""
    full = global_tensor((8, 3))
    pt = distribute_tensor(full, mesh1d, [Partial()]).requires_grad_()
    out = pt.redistribute(mesh1d, [Shard(0)])
    out.backward(distribute_tensor(torch.ones(8, 3), mesh1d, [Shard(0)]))
    assert_all_ranks(pt.grad.placements == (Replicate(),), f"{pt.grad.placements}")
    assert_close(pt.grad.full_tensor(), torch.ones(8, 3))


def test_spec_tensor_meta_and_dim_map(mesh1d):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    dt = distribute_tensor(global_tensor((6, 4, 2)), mesh1d, [Shard(1)])
    meta = dt._spec.tensor_meta
    assert isinstance(meta, TensorMeta)
    assert (meta.shape, meta.stride, meta.dtype) == (torch.Size([6, 4, 2]), (8, 2, 1), torch.float32)
    assert dt._spec.dim_map == [-1, 0, -1]
    assert distribute_tensor(global_tensor((3,)), mesh1d, [Replicate()])._spec.dim_map == [-1]


def test_spec_dim_map_2d(mesh2d):
    dt = distribute_tensor(global_tensor((4, 4)), mesh2d, [Shard(1), Shard(0)])
    assert dt._spec.dim_map == [1, 0]
    twice = distribute_tensor(global_tensor((4, 4)), mesh2d, [Shard(0), Shard(0)])
    with pytest.raises(ValueError, match="already sharded"):
        twice._spec.dim_map


@pytest.mark.parametrize("length,split_factor,chunks", [(8, 2, 4), (9, 2, 4), (7, 3, 2), (4, 1, 3), (3, 2, 4)])
def test_strided_split_tensor_as_torch(length, split_factor, chunks):
    """``_StridedShard._split_tensor`` against torch's own (a local computation)."""
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided

    x = torch.arange(length * 2).view(length, 2)
    ours = _StridedShard(0, split_factor=split_factor)._split_tensor(x, chunks)
    theirs = TorchStrided(0, split_factor=split_factor)._split_tensor(x, chunks)
    assert ours[1] == theirs[1]
    assert len(ours[0]) == len(theirs[0])
    for o, t in zip(ours[0], theirs[0]):
        torch.testing.assert_close(o, t)
    o2, _ = _StridedShard(1, split_factor=1)._split_tensor(x, chunks, with_padding=False)
    t2, _ = TorchStrided(1, split_factor=1)._split_tensor(x, chunks, with_padding=False)
    assert [tuple(o.shape) for o in o2] == [tuple(t.shape) for t in t2]


@pytest.mark.parametrize("length", [8, 11])
@pytest.mark.parametrize("placement", [Shard(0), _StridedShard(0, split_factor=2)])
def test_to_replicate_tensor_1d(mesh1d, length, placement):
    full = global_tensor((length, 3))
    pieces, _ = (placement._split_tensor(full, WORLD.size, with_padding=False)
                 if isinstance(placement, _StridedShard) else Shard(0)._split_tensor(full, WORLD.size, with_padding=False))
    with CommDebugMode() as comm:
        whole = placement._to_replicate_tensor(pieces[WORLD.rank], mesh1d, 0, list(full.shape))
    assert_all_ranks(comm.get_total_counts() == (0 if WORLD.size == 1 else 1), f"{comm.get_comm_counts()}")
    assert_close(whole, full)


def test_to_replicate_tensor_2d_mesh(mesh2d):
    """Gathered over one mesh dim only (torch's test_2d_mesh_strided_sharding)."""
    full = global_tensor((8, 2))
    dp, tp = mesh2d.get_coordinate()
    first, _ = _StridedShard(0, split_factor=2)._split_tensor(full, 2)
    mine, _ = Shard(0)._split_tensor(first[dp], 2)
    back = Shard(0)._to_replicate_tensor(mine[tp], mesh2d, 1, list(first[dp].shape))
    assert_close(back, first[dp])
    whole = _StridedShard(0, split_factor=2)._to_replicate_tensor(first[dp], mesh2d, 0, list(full.shape))
    assert_close(whole, full)


def test_compute_global_tensor_shape(mesh1d):
    r = WORLD.rank
    assert compute_global_tensor_shape(torch.Size([5, r]), mesh1d, [Shard(1)]) == torch.Size(
        [5, sum(range(WORLD.size))])
    assert compute_global_tensor_shape(torch.Size([r + 1, 5]), mesh1d, [Shard(0)]) == torch.Size(
        [sum(range(1, WORLD.size + 1)), 5])
    assert compute_global_tensor_shape(torch.Size([5, 5]), mesh1d, [Replicate()]) == torch.Size([5, 5])
    if WORLD.size > 1:  # the unsharded dim differs on odd ranks: torch's error on every rank
        raises_everywhere(RuntimeError, lambda: compute_global_tensor_shape(
            torch.Size([5 + r % 2, r]), mesh1d, [Shard(1)]), "Non-sharded dimensions should have identical size")
    raises_everywhere(NotImplementedError, lambda: compute_global_tensor_shape(
        torch.Size([2, 2]), mesh1d, [Shard(0), Shard(1)]), "only supports 1 placement")


def test_private_local_shape_and_offset_as_torch():
    """torch's ``_compute_local_shape_and_global_offset`` (mesh shape and coordinate given)
    against torch's own with torch's placements (local computations)."""
    from torch.distributed.tensor import _utils
    from torch.distributed.tensor.placement_types import Shard as TS, _StridedShard as TSS

    cases = [((4096, 4096), (30, 8), [_StridedShard(0, split_factor=8), Shard(0)],
              [TSS(0, split_factor=8), TS(0)]),
             ((18, 2), (4, 2), [Shard(0), Shard(0)], [TS(0), TS(0)]),
             ((7, 5), (3, 2), [Shard(1), Shard(0)], [TS(1), TS(0)])]
    for shape, mesh_shape, ours, theirs in cases:
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            got = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), ours)
            want = _utils._compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), theirs)
            assert tuple(got[0]) == tuple(want[0]) and tuple(got[1]) == tuple(want[1]), (shape, coord, got, want)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]])
def test_private_shard_tensor(mesh1d, placements):
    """torch's ``_api._shard_tensor``: each rank keeps its shard of the same full tensor, no
    collective; the same local tensor as ``distribute_tensor``."""
    from mpidtensor.tensor.api import _shard_tensor

    full = global_tensor((WORLD.size + 2, 5))
    with CommDebugMode() as comm:
        dt = _shard_tensor(full, placements, mesh1d)
    want = distribute_tensor(full, mesh1d, placements)
    assert_all_ranks(comm.get_total_counts() == 0 and dt.placements == tuple(placements), f"{comm.get_comm_counts()}")
    assert_close(dt.to_local(), want.to_local())


@pytest.mark.parametrize("gather_dim,shard_dim", [(0, 1), (1, 0), (0, 0)])
def test_shard_dim_alltoall(mesh1d, gather_dim, shard_dim):
    from mpidtensor.compat.torch_utils import shard_dim_alltoall

    n = WORLD.size
    full = global_tensor((2 * n, 3 * n), dtype=torch.complex64)
    mine = full.chunk(n, gather_dim)[WORLD.rank]
    out = shard_dim_alltoall(mine, gather_dim, shard_dim, mesh1d, 0)
    meta = shard_dim_alltoall(torch.empty_like(mine, device="meta"), gather_dim, shard_dim, mesh1d, 0)
    assert_all_ranks(out.shape == meta.shape and out.stride() == meta.stride(), f"{out.shape} {meta.shape}")
    assert_close(out, full.chunk(n, shard_dim)[WORLD.rank])


def test_shard_dim_alltoall_2d(mesh2d):
    """Over mesh dim 1 of a 2x2 mesh (group rank != world rank), as torch's test."""
    from mpidtensor.compat.torch_utils import shard_dim_alltoall

    full = global_tensor((8, 6))
    tp = mesh2d.get_local_rank(1)
    out = shard_dim_alltoall(full.chunk(2, 0)[tp], 0, 1, mesh2d, 1)
    assert_close(out, full.chunk(2, 1)[tp])
