"""distribute_tensor, from_local, to_local, full_tensor, and bad input raised on every rank."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.debug import CommDebugMode, visualize_sharding

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]])
@pytest.mark.parametrize("src", [0, "last", None])
def test_distribute_tensor(mesh1d, placements, src):
    full = global_tensor((7, 5))
    src_rank = WORLD.size - 1 if src == "last" else src
    mine = full if src_rank in (None, WORLD.rank) else torch.zeros_like(full)  # only the source's data counts
    d = distribute_tensor(mine, mesh1d, placements, src_data_rank=src_rank)
    assert_all_ranks(d.shape == full.shape and d.dtype == full.dtype and d.placements == tuple(placements))
    assert_close(d.full_tensor(), full)


def test_distribute_tensor_none_moves_nothing(mesh1d):
    full = global_tensor((7, 5))
    with CommDebugMode() as comm:
        d = distribute_tensor(full, mesh1d, [Shard(1)], src_data_rank=None)
    assert_all_ranks(comm.get_total_counts() == 0, str(comm.get_comm_counts()))
    assert_all_ranks(d.to_local().data_ptr() != full.data_ptr())  # a copy, not an alias


def test_distribute_tensor_2d(mesh2d):
    full = global_tensor((9, 5))
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        for src in (0, 1, None):  # a group rank on each mesh dim: the source is mesh[src, src]
            mine = full if src is None or int(mesh2d.mesh[src, src]) == WORLD.rank else torch.full_like(full, -1.0)
            d = distribute_tensor(mine, mesh2d, placements, src_data_rank=src)
            assert_close(d.full_tensor(), full)


def test_uneven_local_shapes_follow_torch_chunk(mesh1d):
    full = global_tensor((5, 3))
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    pieces = list(full.chunk(WORLD.size))
    pieces += [full[:0]] * (WORLD.size - len(pieces))
    assert_close(d.to_local(), pieces[WORLD.rank])


def test_from_local_infers_uneven_shape(mesh1d):
    full = global_tensor((5, 3))
    local = distribute_tensor(full, mesh1d, [Shard(0)]).to_local()
    d = DTensor.from_local(local, mesh1d, [Shard(0)])
    assert_all_ranks(d.shape == full.shape)
    explicit = DTensor.from_local(local, mesh1d, [Shard(0)], shape=full.shape, stride=full.stride())
    assert_close(explicit.full_tensor(), full)
    checked = DTensor.from_local(local, mesh1d, [Shard(0)], run_check=True)
    assert_close(checked.full_tensor(), full)


def test_from_local_backward(mesh1d):
    local = torch.randn(3, 4, generator=torch.Generator().manual_seed(WORLD.rank)).requires_grad_()
    d = DTensor.from_local(local, mesh1d, [Shard(0)])
    weight = global_tensor((3 * WORLD.size, 4))
    (d.full_tensor() * weight).sum().backward()
    assert_close(local.grad, weight.chunk(WORLD.size)[WORLD.rank])


def test_from_local_without_shape_cached_only_when_nothing_is_sharded(mesh1d):
    """``from_local`` without ``shape`` keeps the spec of placements that shard nothing (the
    global shape is the local one) and checks the local shape and strides on every hit; a
    sharded one is gathered each time. Every result equals the one made with no cache."""
    from mpidtensor.runtime import caches
    from mpidtensor.tensor.dtensor import _FROM_LOCAL

    calls = [lambda: DTensor.from_local(torch.ones(3, 5), mesh1d, [Replicate()]),
             lambda: DTensor.from_local(torch.ones(3, 5), mesh1d, [Replicate()]),  # a hit
             lambda: DTensor.from_local(torch.ones(5, 3).t(), mesh1d, [Replicate()]),  # other strides
             lambda: DTensor.from_local(torch.ones(4, 5), mesh1d, [Replicate()]),  # another shape
             lambda: DTensor.from_local(torch.ones(4, 5, dtype=torch.float64), mesh1d, [Replicate()]),
             lambda: DTensor.from_local(torch.ones(2), mesh1d, [Partial()]),
             lambda: DTensor.from_local(shard(7), mesh1d, [Shard(1)]),
             lambda: DTensor.from_local(shard(9), mesh1d, [Shard(1)])]  # gathered again: another global shape

    def shard(length):
        return distribute_tensor(torch.ones(2, length), mesh1d, [Shard(1)]).to_local()

    def facts(d):
        return d.shape, d.stride(), d.placements, d.dtype, d.to_local().shape, d.to_local().stride()
    caches.clear_all()
    cached = [facts(call()) for call in calls]
    sharded_kept = any(k[2] is None and any(isinstance(p, Shard) for p in k[1]) for k in _FROM_LOCAL)
    fresh = []
    for call in calls:
        caches.clear_all()
        fresh.append(facts(call()))
    assert_all_ranks(not sharded_kept and cached == fresh, f"{cached} != {fresh}")
    assert_all_ranks(cached[2][:2] == ((3, 5), (1, 3)) and cached[6][0] == (2, 7) and cached[7][0] == (2, 9))


def test_to_local_grad_placements(mesh1d):
    x = distribute_tensor(global_tensor((4, 3)).requires_grad_(), mesh1d, [Replicate()])
    local = x.to_local(grad_placements=[Partial()])
    # each rank's local gradient is a partial sum: the total gradient is their sum
    local.sum().backward()
    assert_all_ranks(x.grad.placements == (Partial(),))
    assert_close(x.grad.full_tensor(), torch.full((4, 3), float(WORLD.size)))


def test_repr_and_visualize(mesh1d):
    d = distribute_tensor(global_tensor((5, 2)), mesh1d, [Shard(0)])
    assert_all_ranks("S(0)" in repr(d))
    text = visualize_sharding(d)
    owned = [line for line in text.splitlines() if "-> ranks" in line]
    assert_all_ranks(len(owned) == WORLD.size, text)
    assert_all_ranks(f"-> ranks [{WORLD.size - 1}]" in text, text)


# --- bad input: a clear error on every rank, and the job goes on --------------------------------


def _still_working(mesh):
    d = distribute_tensor(global_tensor((5, 3)), mesh, [Shard(0)])
    assert_close(d.full_tensor(), global_tensor((5, 3)))


def test_shard_dim_out_of_range(mesh1d):
    with pytest.raises(ValueError, match="out of range"):
        distribute_tensor(torch.ones(3, 4), mesh1d, [Shard(2)])
    with pytest.raises(ValueError, match="out of range"):
        distribute_tensor(torch.ones(3, 4), mesh1d, [Shard(1)]).redistribute(mesh1d, [Shard(5)])
    _still_working(mesh1d)


def test_wrong_number_of_placements(mesh1d):
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        distribute_tensor(torch.ones(3, 4), mesh1d, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        DTensor.from_local(torch.ones(3, 4), mesh1d, [])
    _still_working(mesh1d)


def test_distribute_different_shapes_or_dtypes(mesh1d):
    if WORLD.size == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        distribute_tensor(torch.ones(3 + (WORLD.rank == 1), 4), mesh1d, [Shard(0)])
    dtype = torch.float64 if WORLD.rank == 1 else torch.float32
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        distribute_tensor(torch.ones(3, 4, dtype=dtype), mesh1d, [Replicate()], src_data_rank=None)
    _still_working(mesh1d)


def test_from_local_run_check_disagreement(mesh1d):
    if WORLD.size == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(ValueError, match="hold different values"):
        DTensor.from_local(torch.full((2, 2), float(WORLD.rank)), mesh1d, [Replicate()], run_check=True)
    with pytest.raises(ValueError, match="unsharded dim 1"):
        DTensor.from_local(torch.ones(2, 2 + WORLD.rank), mesh1d, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match="dtypes"):
        dtype = torch.float64 if WORLD.rank == 0 else torch.float32
        DTensor.from_local(torch.ones(2, 2, dtype=dtype), mesh1d, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match="torch.chunk layout"):
        # rank 0 holding fewer rows than a later rank is not a torch.chunk layout
        DTensor.from_local(torch.ones(1 if WORLD.rank == 0 else 2, 2), mesh1d, [Shard(0)])
    _still_working(mesh1d)


def test_mixing_meshes_refused(mesh1d):
    other = init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("other",))
    a = distribute_tensor(torch.ones(4), mesh1d, [Replicate()])
    b = distribute_tensor(torch.ones(4), other, [Replicate()])
    with pytest.raises(ValueError, match="different meshes") as refused:
        a + b
    # the error alone, not raised while handling the plan cache's KeyError (its key, every argument's spec)
    assert_all_ranks(refused.value.__context__ is None, f"raised while handling {refused.value.__context__!r}")
    with pytest.raises(ValueError, match="another mesh"):
        a.redistribute(other, [Replicate()])
    _still_working(mesh1d)
    other.free()


def test_distribute_a_dtensor_as_torch(mesh1d):
    """torch's answer (tests/test_distribute_tensor_errors.py has the rest): itself when laid out alike."""
    d = distribute_tensor(torch.ones(4), mesh1d, [Replicate()])
    assert_all_ranks(distribute_tensor(d, mesh1d, [Replicate()]) is d)


def test_from_local_shape_and_stride_together(mesh1d):
    """As torch: ``shape=`` without ``stride=`` (or the reverse) is a RuntimeError on every rank."""
    local = torch.ones(2, 3)
    shape, stride = (2 * mesh1d.size(), 3), (3, 1)
    raises_everywhere(RuntimeError, lambda: DTensor.from_local(local, mesh1d, [Shard(0)], shape=shape),
                      "Please pass both shape and stride at the same time.")
    raises_everywhere(RuntimeError, lambda: DTensor.from_local(local, mesh1d, [Shard(0)], stride=stride),
                      "Please pass both shape and stride at the same time.")
    d = DTensor.from_local(local, mesh1d, [Shard(0)], shape=shape, stride=stride)
    assert_all_ranks(d.shape == shape and d.stride() == stride, f"{tuple(d.shape)} {d.stride()}")


@pytest.mark.parametrize("out_placement", [Replicate(), Shard(1)])
def test_out_keeps_its_placements(mesh1d, out_placement):
    """As torch: ``torch.add(x, 3, out=out)`` returns ``out`` itself, in its own placements."""
    full = global_tensor((4 * mesh1d.size(), 6))
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    out = distribute_tensor(torch.zeros_like(full), mesh1d, [out_placement])
    res = torch.add(x, 3, out=out)
    assert_all_ranks(res is out and out.placements == (out_placement,), f"{out.placements}")
    assert_close(out.full_tensor(), full + 3)


def test_empty_like_keeps_partial(mesh1d):
    """As torch: ``empty_like`` keeps Partial (its values are unset), so a module's Partial
    buffer built on meta stays Partial through ``to_empty``; ``zeros_like`` replicates."""
    with torch.device("meta"):
        module = torch.nn.Module()
        module.register_buffer("total", DTensor.from_local(torch.tensor(0.0), mesh1d, [Partial()]))
    module.to_empty(device="cpu")
    x = DTensor.from_local(torch.ones(3), mesh1d, [Partial()])
    placements = (module.total.placements, torch.empty_like(x).placements, torch.zeros_like(x).placements)
    assert_all_ranks(placements == ((Partial(),), (Partial(),), (Replicate(),)) and not module.total.is_meta,
                     f"{placements}")
