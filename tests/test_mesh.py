import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor import DeviceMesh, init_device_mesh

WORLD = MPI.COMM_WORLD


def test_1d_mesh(mesh1d):
    assert mesh1d.ndim == 1 and mesh1d.shape == (WORLD.size,) and mesh1d.size() == WORLD.size
    assert mesh1d.get_rank() == WORLD.rank
    assert mesh1d.get_coordinate() == [WORLD.rank]
    assert mesh1d.get_local_rank() == WORLD.rank
    assert mesh1d.mesh.tolist() == list(range(WORLD.size))
    assert mesh1d.get_group().size == WORLD.size


def test_group_answers_mpi4py_and_torch(mesh1d):
    """``get_group()`` is the mesh's communicator for mpi4py code and a ProcessGroup for torch
    code: ``size`` / ``rank`` read as attributes and called (torchao's NF4 FSDP hook calls
    ``mesh.get_group().size()``), and every MPI call works on it."""
    group = mesh1d.get_group()
    assert isinstance(group, MPI.Cartcomm) and group is mesh1d.get_group()
    assert group.size == group.size() == WORLD.size and group.rank == group.rank() == WORLD.rank
    assert isinstance(group.size(), int) and type(group.size()) is int
    assert group.allreduce(1) == WORLD.size
    assert mesh1d.get_all_groups() == [group]


def test_2d_mesh_coordinates_and_slices(mesh2d):
    rank = WORLD.rank
    row, col = divmod(rank, 2)
    assert mesh2d.shape == (2, 2) and mesh2d.mesh_dim_names == ("dp", "tp")
    assert mesh2d.get_coordinate() == [row, col]
    assert mesh2d.get_local_rank("dp") == row and mesh2d.get_local_rank(1) == col
    assert mesh2d.size("tp") == 2 and mesh2d.size() == 4
    tp, dp = mesh2d["tp"], mesh2d["dp"]
    assert tp.mesh.tolist() == [2 * row, 2 * row + 1] and tp.mesh_dim_names == ("tp",)
    assert dp.mesh.tolist() == [col, col + 2]
    assert tp.get_local_rank() == col and dp.get_local_rank() == row
    # the sub-communicator's ranks are the mesh coordinate along that dim
    assert tp.get_group().rank == col and mesh2d.get_group("dp").rank == row
    assert mesh2d["tp"] is tp  # cached
    assert mesh2d["dp", "tp"] is mesh2d
    flat = mesh2d._flatten()
    assert flat.ndim == 1 and flat.get_group().size == 4 and flat.get_local_rank() == rank
    peers = tp.get_group().allgather(rank)
    assert peers == tp.mesh.tolist()


def test_slices_borrow_the_parents_communicators():
    """A slice runs no collective: its communicators are its parent's over the same dims
    (made with the parent), so slicing one more time, freeing a slice, or slicing again
    leaves the parent's communicators working."""
    if WORLD.size != 4:
        pytest.skip("a 3-D mesh of 4 ranks")
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    tp, dp_tp = mesh["tp"], mesh["dp", "tp"]
    assert_all_ranks(tp.comm is mesh.comm_for((2,)) and tp.get_group() is not None
                     and tp.comm_for((0,)) is mesh.comm_for((2,)), "a 1-D slice is the parent's dim communicator")
    assert_all_ranks(dp_tp.comm is mesh.comm_for((1, 2)) and dp_tp.comm_for((1,)) is mesh.comm_for((2,))
                     and dp_tp["tp"].comm is mesh.comm_for((2,)), "a 2-D slice lends its parent's communicators")
    tp.free()  # frees nothing the parent owns
    again = mesh["tp"]
    assert_all_ranks(again is not tp and again.get_group().allgather(WORLD.rank) == again.mesh.tolist()
                     and mesh.get_group("tp").allreduce(1) == 2, "the parent's communicator outlives its slice")


def test_slicing_from_threads():
    """transformers slices its mesh from several weight-loading threads at once: slices made
    concurrently, in another order on every rank, are the same meshes on every rank and their
    communicators match (a slice that ran a collective would mismatch and abort the job)."""
    from concurrent.futures import ThreadPoolExecutor

    if WORLD.size != 4:
        pytest.skip("a 2x2 mesh")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    names = ["dp", "tp"] * 8
    order = names[WORLD.rank % 2:] + names[:WORLD.rank % 2]
    with ThreadPoolExecutor(max_workers=4) as pool:
        slices = list(pool.map(lambda n: (n, mesh[n].get_local_rank(), mesh[n].size()), order))
    row, col = divmod(WORLD.rank, 2)
    want = {"dp": (row, 2), "tp": (col, 2)}
    ok = all((rank, size) == want[n] for n, rank, size in slices) and mesh["tp"] is mesh["tp"]
    ok = ok and mesh["tp"].get_group().allgather(WORLD.rank) == mesh["tp"].mesh.tolist()
    assert_all_ranks(ok and mesh["dp"].get_group().allgather(WORLD.rank) == mesh["dp"].mesh.tolist(), str(slices))


def test_pipeline_stage_slices_alone():
    """A stage of a pipeline slices its 2-D sub-mesh and runs a collective on it while the
    next stage waits for its message: slicing runs no collective over the whole mesh (it
    did, for a multi-dim slice: both stages then waited for each other), as torch's does not."""
    if WORLD.size % 2 or WORLD.size < 2:
        pytest.skip("two pipeline stages")
    import mpidtensor as md

    mesh = init_device_mesh("cpu", (2, WORLD.size // 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage, half = mesh.get_local_rank("pp"), WORLD.size // 2
    if stage == 1:
        WORLD.recv(source=WORLD.rank - half, tag=11)
    dp_tp = mesh["dp", "tp"]
    x = md.distribute_tensor(torch.arange(4.0 * half).reshape(2 * half, 2), dp_tp, [md.Shard(0), md.Replicate()])
    total = x.full_tensor().sum().item()
    if stage == 0:
        WORLD.send(total, dest=WORLD.rank + half, tag=11)
    assert_all_ranks(total == sum(range(4 * half)) and dp_tp.mesh.tolist() == mesh.mesh[stage].tolist(), f"{total}")


def test_slices_in_another_order_on_each_rank():
    """Ranks slice two groups of dims in orders that form a cycle (ranks 0 and 3 slice
    ``("dp", "tp")`` first, ranks 1 and 2 ``("pp", "tp")``), as loading threads or pipeline
    stages may: slicing runs no collective (it made each slice's communicator over its own
    ranks, and every rank waited for the next), so each slice's communicator is made when
    first used, in the program's order."""
    if WORLD.size != 4:
        pytest.skip("a 2x2x1 mesh")
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    order = [("dp", "tp"), ("pp", "tp")]
    if WORLD.rank in (1, 2):
        order.reverse()
    slices = {names: mesh[names] for names in order}
    pp, dp = divmod(WORLD.rank, 2)
    want = {("dp", "tp"): [[2 * pp], [2 * pp + 1]], ("pp", "tp"): [[dp], [dp + 2]]}
    ok = all(slices[names].mesh.tolist() == want[names] for names in want)
    ok = ok and all(slices[names].comm.allgather(WORLD.rank) == sum(want[names], []) for names in sorted(want))
    assert_all_ranks(ok and slices[("dp", "tp")].get_coordinate() == [dp, 0], f"{order}")


@pytest.mark.parametrize("shape, names", [((1, 2, 2), ("dp", "cp", "tp")), ((2, 2, 1), ("dp", "cp", "tp")),
                                          ((2, 1, 2), ("dp", "tp", "cp"))])
def test_joint_mesh_of_a_flattened_slice_and_the_rest(shape, names):
    """FSDP over ``mesh["dp", "cp"]._flatten("dp_cp")`` beside TP over ``mesh["tp"]`` (torch's
    recipe for context parallelism): the joint mesh has the merged dim, whose groups are
    the flattened mesh's, and the tp dim, whose groups are the slice's."""
    from mpidtensor.mesh.relations import joint_mesh

    if WORLD.size != 4:
        pytest.skip("a 3-D mesh of 4 ranks")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    joint, dp_dims, tp_dims = joint_mesh(flat, mesh["tp"])
    rank = WORLD.rank
    assert_all_ranks(joint.mesh_dim_names == ("dp_cp", "tp") and dp_dims == (0,) and tp_dims == (1,), repr(joint))
    assert_all_ranks(joint["dp_cp"] == flat and joint["tp"] == mesh["tp"], repr(joint))
    assert_all_ranks(joint.get_group("dp_cp").allgather(rank) == flat.get_group().allgather(rank)
                     and joint.get_group("tp").allgather(rank) == mesh["tp"].get_group().allgather(rank), repr(joint))
    assert_all_ranks(joint_mesh(flat, mesh["tp"])[0] is joint, "the joint mesh is cached")
    # two slices that leave a dim out compose over the ranks they span, as torch's do
    part, dp_dims, tp_dims = joint_mesh(mesh["dp"], mesh["tp"])
    assert_all_ranks(part.shape == (mesh.size("dp"), mesh.size("tp")) and part["tp"] == mesh["tp"]
                     and part["dp"] == mesh["dp"] and (dp_dims, tp_dims) == ((0,), (1,)), repr(part))
    with_cp = [mesh[[n for n in names if n != drop]] for drop in ("tp", "dp")]
    assert_all_ranks((joint_mesh(*with_cp) is None) == (mesh.size("cp") > 1), "dp x cp and cp x tp overlap on cp")


def test_arbitrary_layout():
    n = WORLD.size
    layout = list(reversed(range(n)))
    mesh = DeviceMesh("cpu", layout)
    assert mesh.get_coordinate() == [layout.index(WORLD.rank)]
    assert mesh.get_group().rank == layout.index(WORLD.rank)
    # collectives on the mesh communicator follow the layout's order
    assert mesh.get_group().allgather(WORLD.rank) == layout
    mesh.free()


def test_mesh_leaving_ranks_out():
    if WORLD.size < 2:
        pytest.skip("needs 2 ranks")
    mesh = DeviceMesh("cpu", [0, 1])
    if WORLD.rank < 2:
        assert mesh.get_coordinate() == [WORLD.rank]
    else:
        assert mesh.get_coordinate() is None
        with pytest.raises(ValueError, match="not part of this mesh"):
            mesh.get_local_rank()
    mesh.free()


def test_bad_meshes():
    n = WORLD.size
    with pytest.raises(ValueError, match="holds"):
        init_device_mesh("cpu", (n + 1,))
    with pytest.raises(ValueError, match="distinct"):
        init_device_mesh("cpu", (n, 1), mesh_dim_names=("a", "a"))
    with pytest.raises(ValueError, match="each of the"):
        init_device_mesh("cpu", (n,), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match="device_type"):
        init_device_mesh("tpu", (n,))
    with pytest.raises(ValueError, match="distinct ranks"):
        DeviceMesh("cpu", [0] * (n + 1))
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("x",))
    with pytest.raises(ValueError, match="no dimension named"):
        mesh["y"]
    # the job goes on working after the errors
    assert_all_ranks(mesh.get_group().allreduce(1) == n)
    mesh.free()


def test_cuda_mesh_binds_local_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    mesh = init_device_mesh("cuda", (WORLD.size,))
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    assert torch.cuda.current_device() == node.rank % torch.cuda.device_count()
    node.Free()
    mesh.free()
