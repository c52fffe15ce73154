"""Every transition between placements, against plain torch, forward and backward."""
import itertools

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor import clear_cache

WORLD = MPI.COMM_WORLD
ONE_D = [Shard(0), Shard(1), Shard(-1), Replicate()]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("shape", [(5, 7), (1, 3), (9, 2), (4, 4)])
@pytest.mark.parametrize("src,dst", list(itertools.product(ONE_D, ONE_D)))
def test_1d_transitions(mesh1d, shape, src, dst):
    full = global_tensor(shape)
    d = distribute_tensor(full, mesh1d, [src])
    out = d.redistribute(mesh1d, [dst])
    assert_all_ranks(out.placements == (Shard(dst.dim % 2) if isinstance(dst, Shard) else dst,))
    assert_close(out.to_local(), _local_block(full, out))
    assert_close(out.full_tensor(), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(mesh1d, dtype):
    full = global_tensor((7, 5), dtype)
    for src, dst in [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(1))]:
        out = distribute_tensor(full, mesh1d, [src]).redistribute(mesh1d, [dst])
        assert_all_ranks(out.dtype == dtype)
        assert_close(out.full_tensor(), full)


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product"])
@pytest.mark.parametrize("dst", [Replicate(), Shard(0), Shard(1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_partial(mesh1d, op, dst, dtype):
    parts = [global_tensor((5, 3), torch.float32, seed=10 + r) * 0.5 + 1.0 for r in range(WORLD.size)]
    parts = [p.to(dtype) for p in parts]
    stacked = torch.stack(parts)
    reduce = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0, dtype=torch.float32),
              "min": lambda t: t.amin(0), "max": lambda t: t.amax(0), "product": lambda t: t.prod(0)}
    expected = reduce[op](stacked.float()).to(dtype)
    d = DTensor.from_local(parts[WORLD.rank], mesh1d, [Partial(op)])
    out = d.redistribute(mesh1d, [dst])
    tol = dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else {}
    assert_close(out.full_tensor(), expected, **tol)


def test_partial_stays_and_into_partial_refused(mesh1d):
    d = DTensor.from_local(torch.ones(3), mesh1d, [Partial()])
    with CommDebugMode() as comm:
        same = d.redistribute(mesh1d, [Partial()])
    assert_all_ranks(comm.get_total_counts() == 0 and same.placements == (Partial(),))
    r = distribute_tensor(torch.ones(3), mesh1d, [Replicate()])
    with pytest.raises(RuntimeError, match="Can not redistribute from R to P"):  # torch's error
        r.redistribute(mesh1d, [Partial()])
    p = DTensor.from_local(torch.ones(3), mesh1d, [Partial("prod")])
    with pytest.raises(RuntimeError, match="redistributing to Partial is for internal use only"):
        p.redistribute(mesh1d, [Partial("sum")])  # another reduce op: refused as torch does
    with pytest.raises(RuntimeError, match="placements is needed for redistribute"):
        r.redistribute(mesh1d, None)


@pytest.mark.parametrize(
    "src,dst,kind",
    [
        (Shard(0), Replicate(), "all_gather"),
        (Shard(0), Shard(1), "all_to_all"),
        (Replicate(), Shard(0), None),
        (Partial(), Replicate(), "all_reduce"),
        (Partial(), Shard(0), "reduce_scatter"),
        (Shard(1), Shard(1), None),
    ],
)
def test_one_collective_per_transition(mesh1d, src, dst, kind):
    if isinstance(src, Partial):
        d = DTensor.from_local(torch.ones(7, 5), mesh1d, [src])
    else:
        d = distribute_tensor(global_tensor((7, 5)), mesh1d, [src])
    with CommDebugMode() as comm:
        d.redistribute(mesh1d, [dst])
    expected = {} if kind is None or mesh1d.size() == 1 else {kind: 1}  # one rank: nothing to move
    assert_all_ranks(dict(comm.get_comm_counts()) == expected, str(comm.get_comm_counts()))


TWO_D = [Shard(0), Shard(1), Replicate()]
TWO_D_LAYOUTS = [list(p) for p in itertools.product(TWO_D, TWO_D)]


@pytest.mark.parametrize("src", TWO_D_LAYOUTS)
@pytest.mark.parametrize("dst", TWO_D_LAYOUTS)
def test_2d_transitions(mesh2d, src, dst):
    full = global_tensor((5, 7))
    out = distribute_tensor(full, mesh2d, src).redistribute(mesh2d, dst)
    assert_close(out.to_local(), _local_block(full, out))
    assert_close(out.full_tensor(), full)


@pytest.mark.parametrize("src", [[Partial(), Shard(0)], [Shard(1), Partial()], [Partial(), Partial()]])
@pytest.mark.parametrize("dst", [[Replicate(), Replicate()], [Shard(0), Shard(0)], [Shard(1), Replicate()], [Shard(0), Shard(1)]])
def test_2d_partial(mesh2d, src, dst):
    full = global_tensor((5, 7))
    parts = 1
    for p in src:
        parts *= 2 if isinstance(p, Partial) else 1
    base = distribute_tensor(full, mesh2d, [Replicate() if isinstance(p, Partial) else p for p in src])
    local = base.to_local() / parts  # each partial holds an equal share
    d = DTensor.from_local(local, mesh2d, src, shape=full.shape, stride=full.stride())
    assert_close(d.redistribute(mesh2d, dst).full_tensor(), full)


def test_2d_nested_gather_is_one_collective(mesh2d):
    d = distribute_tensor(global_tensor((5, 3)), mesh2d, [Shard(0), Shard(0)])
    with CommDebugMode() as comm:
        out = d.redistribute(mesh2d, [Replicate(), Replicate()])
    assert_all_ranks(dict(comm.get_comm_counts()) == {"all_gather": 1}, str(comm.get_comm_counts()))
    assert_close(out.to_local(), global_tensor((5, 3)))
    p = DTensor.from_local(torch.ones(3), mesh2d, [Partial(), Partial()])
    with CommDebugMode() as comm:
        r = p.redistribute(mesh2d, [Replicate(), Replicate()])
    assert_all_ranks(dict(comm.get_comm_counts()) == {"all_reduce": 1}, str(comm.get_comm_counts()))
    assert_close(r.to_local(), torch.full((3,), 4.0))


@pytest.mark.parametrize("src,dst", [
    ([Shard(0)], [Replicate()]), ([Replicate()], [Shard(0)]), ([Shard(0)], [Shard(1)]), ([Shard(1)], [Shard(0)]),
])
def test_1d_backward(mesh1d, src, dst):
    full = global_tensor((5, 7))
    weight = global_tensor((5, 7), seed=3)
    x = full.clone().requires_grad_()
    d = distribute_tensor(x, mesh1d, src)
    out = d.redistribute(mesh1d, dst)
    (out.full_tensor() * weight).sum().backward()
    assert_all_ranks(d.grad is not None and d.grad.placements == d.placements, "grad placements")
    assert_close(d.grad.full_tensor(), weight)


def test_backward_of_shard_to_replicate_is_local(mesh1d):
    full = global_tensor((5, 7)).requires_grad_()
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    out = d.redistribute(mesh1d, [Replicate()])
    grad = DTensor.from_local(torch.ones(5, 7), mesh1d, [Replicate()])
    with CommDebugMode() as comm:
        out.backward(grad)
    assert_all_ranks(comm.get_total_counts() == 0, str(comm.get_comm_counts()))
    assert_close(d.grad.to_local(), torch.ones_like(d.to_local()))


def test_backward_of_partial_is_replicate(mesh1d):
    local = torch.ones(4, 3, requires_grad=True)
    d = DTensor.from_local(local, mesh1d, [Partial()])
    weight = global_tensor((4, 3))
    (d.full_tensor() * weight).sum().backward()
    assert_close(local.grad, weight)


@pytest.mark.parametrize("dst", [[Replicate(), Replicate()], [Shard(1), Shard(0)], [Replicate(), Shard(0)]])
def test_2d_backward(mesh2d, dst):
    full = global_tensor((5, 7)).requires_grad_()
    weight = global_tensor((5, 7), seed=3)
    d = distribute_tensor(full, mesh2d, [Shard(0), Shard(1)])
    (d.redistribute(mesh2d, dst).full_tensor() * weight).sum().backward()
    assert_close(d.grad.full_tensor(), weight)


def _local_block(full: torch.Tensor, d: DTensor) -> torch.Tensor:
    shape, offset = d._spec.local_shape_and_offset()
    block = full
    for dim, (o, s) in enumerate(zip(offset, shape)):
        block = block.narrow(dim, o, s)
    return block


@pytest.mark.parametrize("dst", [[Replicate()], [Shard(0)], [Shard(1)]])
def test_local_layout_follows_global_strides(mesh1d, dst):
    full = global_tensor((6, 5))
    x = distribute_tensor(full, mesh1d, [Shard(1)])
    t = x.t()  # a transposed DTensor: global strides (1, 6)
    out = t.redistribute(mesh1d, dst)
    local = out.to_local()
    ok = local.numel() <= 1 or local.t().is_contiguous() or min(local.shape) <= 1
    assert_all_ranks(ok, f"local strides {local.stride()} for global strides {out.stride()}")
    assert_close(out.full_tensor(), full.t())


def test_2d_all_reduce_of_a_gathered_buffer_is_in_place(mesh2d, monkeypatch):
    """[P, S(0)] -> [R, R] gathers, then all-reduces the gathered buffer with MPI_IN_PLACE;
    the input's local tensor is left as it was."""
    from mpidtensor.comm import reduce

    parts = [global_tensor((8, 6), seed=s) for s in (1, 2)]
    row, col = mesh2d.get_coordinate()
    local = parts[row].chunk(2, 0)[col].clone()
    kept = local.clone()
    d = DTensor.from_local(local, mesh2d, [Partial(), Shard(0)], shape=(8, 6), stride=(6, 1))
    calls = []
    real = reduce._all_reduce_runner  # makes the MPI call of all_reduce and of its prepared form

    def spy(comm, datatype, mpi_op, op, inplace, host=False):
        calls.append(inplace)
        return real(comm, datatype, mpi_op, op, inplace, host)

    monkeypatch.setattr(reduce, "_all_reduce_runner", spy)
    clear_cache()  # the step prepares its all-reduce in this test (an earlier one may have)
    out = d.redistribute(mesh2d, [Replicate(), Replicate()]).to_local()
    assert_close(out, parts[0] + parts[1])
    assert_all_ranks(torch.equal(local, kept) and calls == [True], f"input changed or calls {calls}")


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_empty_tensors_gather_along_a_later_dim(mesh1d, shape):
    """A regression: the interleaving copy of a gather along dim 1 met zero rows."""
    full = torch.zeros(shape)
    for placements in ([Shard(1)], [Shard(0)]):
        d = distribute_tensor(full, mesh1d, placements)
        out = d.full_tensor()
        assert_all_ranks(out.shape == full.shape, f"{placements}: {tuple(out.shape)}")


# --- _StridedShard in the sweep: every transition to and from it, checked against torch's own
# placement (its _split_tensor, a pure function of the global tensor), 1-D and 2x2 meshes

STRIDED_1D = [Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3),
              _StridedShard(-2, split_factor=3), _StridedShard(1, split_factor=2)]


def _torch_block(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's block as torch lays it out: each mesh dim's placement applied in turn."""
    import torch.distributed.tensor.placement_types as torch_placements

    block = full
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            block = torch_placements.Shard(p.dim % full.ndim)._split_tensor(
                block, mesh.shape[m], with_padding=False)[0][mesh.get_coordinate()[m]]
        elif isinstance(p, _StridedShard):
            block = torch_placements._StridedShard(p.dim % full.ndim, split_factor=p.split_factor)._split_tensor(
                block, mesh.shape[m], with_padding=False)[0][mesh.get_coordinate()[m]]
    return block


@pytest.mark.parametrize("shape", [(7, 5), (2, 9), (12, 6)])
@pytest.mark.parametrize("src,dst", list(itertools.product(STRIDED_1D, STRIDED_1D)))
def test_1d_strided_transitions(mesh1d, shape, src, dst):
    full = global_tensor(shape)
    d = distribute_tensor(full, mesh1d, [src])
    assert_close(d.to_local(), _torch_block(full, mesh1d, [src]))
    out = d.redistribute(mesh1d, [dst])
    assert_close(out.to_local(), _torch_block(full, mesh1d, [dst]))
    assert_close(out.full_tensor(), full)


@pytest.mark.parametrize("dst", STRIDED_1D[3:])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_partial_to_strided(mesh1d, dst, op):
    parts = [global_tensor((7, 5), seed=20 + r) for r in range(WORLD.size)]
    expected = torch.stack(parts).sum(0) if op == "sum" else torch.stack(parts).amax(0)
    out = DTensor.from_local(parts[WORLD.rank], mesh1d, [Partial(op)]).redistribute(mesh1d, [dst])
    assert_close(out.to_local(), _torch_block(expected, mesh1d, [dst]))


STRIDED_2D = [Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
STRIDED_2D_LAYOUTS = [list(p) for p in itertools.product(STRIDED_2D, STRIDED_2D)]


@pytest.mark.parametrize("src", STRIDED_2D_LAYOUTS)
@pytest.mark.parametrize("dst", STRIDED_2D_LAYOUTS)
def test_2d_strided_transitions(mesh2d, src, dst):
    if not any(isinstance(p, _StridedShard) for p in src + dst):
        pytest.skip("no _StridedShard: test_2d_transitions")
    full = global_tensor((7, 5))
    d = distribute_tensor(full, mesh2d, src)
    out = d.redistribute(mesh2d, dst)
    assert_close(out.to_local(), _torch_block(full, mesh2d, dst))
    assert_close(out.full_tensor(), full)


@pytest.mark.parametrize("src", [[_StridedShard(0, split_factor=2), Shard(0)], [Shard(0), _StridedShard(0, split_factor=2)]])
@pytest.mark.parametrize("dst", [[Replicate(), Replicate()], [Shard(0), Shard(0)], [Replicate(), Shard(0)],
                                 [Shard(1), Shard(0)]])
def test_2d_fsdp_tp_strided_backward(mesh2d, src, dst):
    """torch's layout of an FSDP x TP parameter, ``(_StridedShard(0, tp), Shard(0))``: gradients
    come back in the same layout, whatever the target."""
    full = global_tensor((9, 4)).requires_grad_()
    weight = global_tensor((9, 4), seed=3)
    d = distribute_tensor(full, mesh2d, src)
    (d.redistribute(mesh2d, dst).full_tensor() * weight).sum().backward()
    assert_all_ranks(d.grad.placements == d.placements, f"grad placements {d.grad.placements}")
    assert_close(d.grad.full_tensor(), weight)


def test_2d_strided_gather_is_one_collective(mesh2d):
    d = distribute_tensor(global_tensor((9, 3)), mesh2d, [_StridedShard(0, split_factor=2), Shard(0)])
    with CommDebugMode() as comm:
        out = d.redistribute(mesh2d, [Replicate(), Replicate()])
    assert_all_ranks(dict(comm.get_comm_counts()) == {"all_gather": 1}, str(comm.get_comm_counts()))
    assert_close(out.to_local(), global_tensor((9, 3)))
