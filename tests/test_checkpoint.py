"""checkpoint.save / load: round trips over layouts and dtypes, resharded loads across
world sizes, chunked and short transfers, replicas spread over the writers, the box
arithmetic, the one-process reader and conversion, reading format version 1, errors."""
import json
import os

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, DeviceMesh, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.checkpoint import io as ckpt_io
from mpidtensor.checkpoint import shards
from mpidtensor.checkpoint.formats import native

WORLD = MPI.COMM_WORLD
R = Replicate()
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8,
          torch.bool, torch.complex64]


def zeros_like_layout(t: torch.Tensor, mesh, placements):
    z = torch.zeros(t.shape, dtype=t.dtype)
    return z if mesh is None else distribute_tensor(z, mesh, placements)


def check_equal(actual, expected, what=""):
    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    assert_all_ranks(full.dtype == expected.dtype and torch.equal(full, expected), f"{what}: {full} != {expected}")


LAYOUTS_1D = [[Shard(0)], [Shard(1)], [R], None]  # None: a plain tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dtypes(mesh1d, ckpt_dir, dtype):
    shapes = [(7, 5), (3, 10), (2, 3)]
    tensors = [global_tensor(s, dtype, seed=i) for i, s in enumerate(shapes)]
    state = {f"t{i}": t if p is None else distribute_tensor(t, mesh1d, p)
             for i, (t, p) in enumerate(zip(tensors, LAYOUTS_1D))}
    dcp.save(state, ckpt_dir)
    for i, target_layout in enumerate(LAYOUTS_1D):
        target = {f"t{j}": zeros_like_layout(t, mesh1d, LAYOUTS_1D[(j + i + 1) % 4]) for j, t in enumerate(tensors)}
        dcp.load(target, ckpt_dir)
        for j, t in enumerate(tensors):
            check_equal(target[f"t{j}"], t, f"t{j} layout {i}")


@pytest.mark.parametrize("src", [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [R, Shard(0)], [Shard(0), R], [R, R]])
@pytest.mark.parametrize("dst", [[Shard(1), Shard(0)], [Shard(0), Shard(0)], [R, R], [Shard(1), R]])
def test_round_trip_2d_mesh(mesh2d, ckpt_dir, src, dst):
    t = global_tensor((5, 7), seed=3)
    dcp.save({"w": distribute_tensor(t, mesh2d, src)}, ckpt_dir)
    target = {"w": zeros_like_layout(t, mesh2d, dst)}
    dcp.load(target, ckpt_dir)
    check_equal(target["w"], t)


def test_uneven_and_empty_shards(mesh1d, ckpt_dir):
    """More ranks than rows: trailing ranks hold empty shards and must still take part."""
    tensors = {"a": global_tensor((2, 3), seed=1), "b": global_tensor((1,), seed=2),
               "c": global_tensor((0, 4), seed=3), "s": torch.tensor(2.5)}
    dcp.save({k: distribute_tensor(v, mesh1d, [Shard(0)]) if v.ndim else v for k, v in tensors.items()}, ckpt_dir)
    target = {k: zeros_like_layout(v, mesh1d if v.ndim else None, [Shard(v.ndim - 1)]) for k, v in tensors.items()}
    dcp.load(target, ckpt_dir)
    for k, v in tensors.items():
        check_equal(target[k], v, k)


def test_partial_is_reduced(mesh1d, ckpt_dir):
    local = global_tensor((4, 3), seed=WORLD.rank)
    dt = DTensor.from_local(local, mesh1d, [Partial()])
    expected = sum(global_tensor((4, 3), seed=r) for r in range(WORLD.size))
    dcp.save({"p": dt}, ckpt_dir)
    target = {"p": torch.zeros(4, 3)}
    dcp.load(target, ckpt_dir)
    assert_close(target["p"], expected)
    with pytest.raises(dcp.CheckpointError, match="Partial"):
        dcp.load({"p": DTensor.from_local(torch.zeros(4, 3), mesh1d, [Partial()])}, ckpt_dir)


def test_nested_values_round_trip(mesh1d, ckpt_dir):
    state = {"model": {"w": distribute_tensor(global_tensor((6, 2)), mesh1d, [Shard(0)])},
             "meta": {"epoch": 3, "lr": 0.5, "name": "run", "none": None, "flag": True,
                      "betas": (0.9, 0.99), "groups": [{"params": ["w"], "wd": 0.1}], "empty": {},
                      "dtype": torch.float16, 7: "int key"}}
    dcp.save(state, ckpt_dir)
    target = {"model": {"w": zeros_like_layout(global_tensor((6, 2)), mesh1d, [R])},
              "meta": {"epoch": 0, "lr": 0.0, "name": "", "none": 1, "flag": False, "betas": (0, 0),
                       "groups": [{"params": [""], "wd": 0}], "empty": {}, "dtype": None, 7: ""}}
    dcp.load(target, ckpt_dir)
    check_equal(target["model"]["w"], global_tensor((6, 2)))
    assert_all_ranks(target["meta"] == state["meta"], f"{target['meta']}")
    plain = dcp.load_plain(ckpt_dir)
    assert_all_ranks(plain["meta"] == state["meta"] and torch.equal(plain["model"]["w"], global_tensor((6, 2))))


def _submesh_comm(size: int):
    """A mesh over ranks 0..size-1 as a 1-D mesh and the communicator of its members."""
    mesh = DeviceMesh("cpu", list(range(size)))
    comm = WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
    return mesh, comm


def test_reshard_across_world_sizes(ckpt_dir):
    """Saved on all ranks as a 2-D layout (2x2 at 4 ranks), loaded on fewer ranks as
    ``[Shard(1)]`` and on one rank as a plain tensor and as a 1-rank DTensor."""
    t = global_tensor((9, 6), torch.bfloat16, seed=11)
    if WORLD.size == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [Shard(0), Shard(1)]
    else:
        mesh = init_device_mesh("cpu", (WORLD.size,))
        placements = [Shard(0)]
    dcp.save({"w": distribute_tensor(t, mesh, placements), "step": 5}, ckpt_dir)
    for size in range(1, WORLD.size):
        sub, comm = _submesh_comm(size)
        if comm != MPI.COMM_NULL:
            target = {"w": distribute_tensor(torch.zeros(9, 6, dtype=torch.bfloat16), sub, [Shard(1)]), "step": 0}
            dcp.load(target, ckpt_dir, comm=comm)
            ok = torch.equal(target["w"].full_tensor(), t) and target["step"] == 5
            comm.Free()
        else:
            ok = True
        assert_all_ranks(ok, f"load on {size} ranks")
    ok = True
    if WORLD.rank == 0:
        plain = {"w": torch.zeros(9, 6, dtype=torch.bfloat16), "step": 0}
        dcp.load(plain, ckpt_dir, comm=MPI.COMM_SELF)
        single = init_device_mesh("cpu", (1,), comm=MPI.COMM_SELF)
        one = {"w": distribute_tensor(torch.zeros(9, 6, dtype=torch.bfloat16), single, [Shard(0)]), "step": 0}
        dcp.load(one, ckpt_dir, comm=MPI.COMM_SELF)
        ok = torch.equal(plain["w"], t) and torch.equal(one["w"].to_local(), t)
    assert_all_ranks(ok, "load on one rank")


@pytest.mark.parametrize("limit", [1, 7, 100])
def test_chunked_and_short_transfers(mesh1d, ckpt_dir, monkeypatch, limit):
    """A small MAX_CHUNK_BYTES cuts every write and read into many calls; every write
    call writes only half of its first buffer, and the writer resumes."""
    monkeypatch.setattr(ckpt_io, "MAX_CHUNK_BYTES", limit)
    calls = []

    def short_write(fd, buffers, offset):
        calls.append(sum(len(b) for b in buffers))
        return os.pwrite(fd, buffers[0][:max(1, len(buffers[0]) // 2)], offset)

    monkeypatch.setattr(ckpt_io, "write_call", short_write)
    tensors = {"a": global_tensor((5, 4, 3), seed=1), "b": global_tensor((3, 17), torch.complex64, seed=2),
               "c": global_tensor((37,), torch.int16, seed=3)}
    dcp.save({"a": distribute_tensor(tensors["a"], mesh1d, [Shard(1)]),
              "b": distribute_tensor(tensors["b"], mesh1d, [Shard(1)]), "c": tensors["c"]}, ckpt_dir)
    assert_all_ranks(all(n <= limit for n in calls), f"a write call over the limit: {calls}")
    total = WORLD.allreduce(len(calls))
    assert_all_ranks(total >= (240 + 408 + 74) // limit, f"{total} write calls")
    target = {"a": zeros_like_layout(tensors["a"], mesh1d, [Shard(2)]),
              "b": zeros_like_layout(tensors["b"], mesh1d, [Shard(0)]),
              "c": zeros_like_layout(tensors["c"], mesh1d, [Shard(0)])}
    dcp.load(target, ckpt_dir)
    for k, v in tensors.items():
        check_equal(target[k], v, k)


def test_box_arithmetic():
    """Intersections, and the boxes that are one contiguous run of a stored block."""
    outer = ((2, 0, 0), (3, 4, 5))
    results = [
        ckpt_io.intersect(((0, 0), (4, 6)), ((2, 3), (4, 4))) == ((2, 3), (2, 3)),
        ckpt_io.intersect(((0,), (2,)), ((2,), (3,))) is None,
        ckpt_io.intersect(((), ()), ((), ())) == ((), ()),
        ckpt_io.run_offset(((3, 0, 0), (2, 4, 5)), outer) == 20,  # whole rows
        ckpt_io.run_offset(((3, 1, 0), (1, 2, 5)), outer) == 25,  # part of one row, whole inner rows
        ckpt_io.run_offset(((3, 1, 2), (1, 1, 3)), outer) == 27,  # inside one innermost row
        ckpt_io.run_offset(((3, 1, 0), (2, 2, 5)), outer) is None,
        ckpt_io.run_offset(((2, 0, 1), (1, 4, 4)), outer) is None,
        ckpt_io.run_offset(((), ()), ((), ())) == 0,
        ckpt_io.relative(((3, 1, 2), (1, 1, 3)), outer) == (slice(1, 2), slice(1, 2), slice(2, 5)),
    ]
    assert_all_ranks(all(results), f"{results}")


def test_replicas_spread_over_writers(mesh1d, ckpt_dir):
    """Replicated tensors and plain tensors are written once each, by different ranks."""
    tensors = {f"r{i}": global_tensor((6, 5), seed=i) for i in range(4)}
    state = {k: distribute_tensor(v, mesh1d, [R]) if i % 2 else v for i, (k, v) in enumerate(tensors.items())}
    dcp.save(state, ckpt_dir)
    index = native.read_index(ckpt_dir)
    files = [b["file"] for e in index["entries"] for b in e["tensor"]["blocks"]]
    assert_all_ranks(len(files) == 4 and len(set(files)) == min(4, WORLD.size) == len(index["data_files"]),
                     f"{files} {index['data_files']}")
    target = {k: zeros_like_layout(v, mesh1d, [Shard(1)]) for k, v in tensors.items()}
    dcp.load(target, ckpt_dir)
    for k, v in tensors.items():
        check_equal(target[k], v, k)


def write_version1(directory: str, tensors: dict, boxes: dict, values: dict) -> None:
    """A format-version-1 checkpoint (one data file, each tensor whole and row-major),
    written by hand as the previous ``save`` did, with the CRC-32 of each box in ``boxes``."""
    os.makedirs(directory)
    name, entries, end = "data-00000000000000v1.bin", [], 0
    with open(os.path.join(directory, name), "wb") as f:
        for key, t in tensors.items():
            end = -(-end // 64) * 64
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.seek(end)
            f.write(raw.tobytes())
            blocks = [{"start": list(start), "shape": list(shape),
                       "crc32": native.crc32(t[ckpt_io.relative((start, shape), ((0,) * t.ndim, t.shape))]
                                          .contiguous().reshape(-1).view(torch.uint8).numpy())}
                      for start, shape in boxes[key]]
            meta = {"dtype": shards.dtype_name(t.dtype), "shape": list(t.shape), "offset": end,
                    "nbytes": raw.nbytes, "blocks": blocks}
            entries.append({"key": key, "path": [["d", key]], "tensor": meta})
            end += raw.nbytes
        f.truncate(end)
    entries += [{"key": k, "path": [["d", k]], "value": v} for k, v in values.items()]
    index = {"format": native.FORMAT, "version": 1, "data_file": name, "data_bytes": end, "entries": entries}
    with open(os.path.join(directory, native.INDEX), "w") as f:
        json.dump(index, f)


def test_reads_format_version_1(mesh1d, ckpt_dir):
    """A version-1 checkpoint loads into any layout and one process; its block checksums
    are checked (a flipped byte is found); a save over it replaces its data file."""
    tensors = {"w": global_tensor((7, 6), torch.bfloat16, seed=1), "v": global_tensor((5,), torch.int32, seed=2)}
    boxes = {"w": [((0, 0), (4, 6)), ((4, 0), (3, 6))], "v": [((0,), (5,))]}
    if WORLD.rank == 0:
        write_version1(ckpt_dir, tensors, boxes, {"step": 9})
    WORLD.Barrier()
    for layout in ([Shard(0)], [Shard(1)], [R], None):
        mesh = None if layout is None else mesh1d
        target = {"w": zeros_like_layout(tensors["w"], mesh, layout), "step": 0,
                  "v": zeros_like_layout(tensors["v"], mesh, [Shard(0)])}
        dcp.load(target, ckpt_dir)
        for k, v in tensors.items():
            check_equal(target[k], v, f"{k} into {layout}")
        assert_all_ranks(target["step"] == 9)
    plain = dcp.load_plain(ckpt_dir) if WORLD.rank == 0 else tensors
    assert_all_ranks(all(torch.equal(plain[k], v) for k, v in tensors.items()), "load_plain")
    if WORLD.rank == 0:
        index = native.read_index(ckpt_dir)
        flip_byte(os.path.join(ckpt_dir, index["data_file"]), index["entries"][0]["tensor"]["offset"] + 60)
    WORLD.Barrier()
    target = {"w": zeros_like_layout(tensors["w"], mesh1d, [Shard(1)]), "v": torch.zeros(5, dtype=torch.int32)}
    with pytest.raises(dcp.CheckpointError, match=r"checksum mismatch in tensor 'w' \(block at \[4, 0\]\)"):
        dcp.load(target, ckpt_dir)
    dcp.save({k: distribute_tensor(v, mesh1d, [Shard(0)]) for k, v in tensors.items()}, ckpt_dir)
    files = sorted(os.listdir(ckpt_dir))
    index = native.read_index(ckpt_dir)
    assert_all_ranks(index["version"] == 2 and files == sorted([native.INDEX, *index["data_files"]]), f"{files}")


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_truncated_data_file_fails_everywhere(mesh1d, ckpt_dir):
    """The last rank's data file lost its end: only that rank's box reads it, and every
    rank raises."""
    t = global_tensor((8, 32), seed=4)
    dcp.save({"a": distribute_tensor(t, mesh1d, [Shard(0)])}, ckpt_dir)
    if WORLD.rank == 0:
        index = native.read_index(ckpt_dir)
        path = os.path.join(ckpt_dir, index["data_files"][-1])
        os.truncate(path, os.path.getsize(path) // 2)
    WORLD.Barrier()
    with pytest.raises(dcp.CheckpointError, match="ends before byte"):
        dcp.load({"a": zeros_like_layout(t, mesh1d, [Shard(0)])}, ckpt_dir)


def test_plain_reader_and_torch_save(mesh1d, ckpt_dir):
    state = {"w": distribute_tensor(global_tensor((6, 4), torch.bfloat16), mesh1d, [Shard(1)]),
             "b": global_tensor((3,), torch.complex64), "step": 2}
    dcp.save(state, ckpt_dir)
    ok = True
    if WORLD.rank == 0:
        base = os.path.dirname(ckpt_dir)
        dcp.to_torch_save(ckpt_dir, os.path.join(base, "full.pt"))
        full = torch.load(os.path.join(base, "full.pt"))
        ok = torch.equal(full["w"], global_tensor((6, 4), torch.bfloat16)) and full["step"] == 2
        dcp.from_torch_save(os.path.join(base, "full.pt"), os.path.join(base, "back"))
        again = dcp.load_plain(os.path.join(base, "back"))
        ok = ok and torch.equal(again["w"], full["w"]) and torch.equal(again["b"], full["b"])
    assert_all_ranks(ok)
    base = WORLD.bcast(os.path.dirname(ckpt_dir))
    target = {"w": zeros_like_layout(global_tensor((6, 4), torch.bfloat16), mesh1d, [Shard(0)]),
              "b": torch.zeros(3, dtype=torch.complex64), "step": 0}
    dcp.load(target, os.path.join(base, "back"))  # written by one process, loaded sharded
    check_equal(target["w"], global_tensor((6, 4), torch.bfloat16))
    check_equal(target["b"], global_tensor((3,), torch.complex64))


def test_load_errors_name_the_key(mesh1d, ckpt_dir):
    dcp.save({"w": distribute_tensor(global_tensor((4, 4)), mesh1d, [Shard(0)]), "n": 1}, ckpt_dir)
    cases = [({"missing": torch.zeros(2)}, "missing key 'missing'"),
             ({"w": torch.zeros(4, 5)}, r"shape mismatch for 'w'.*\(4, 4\)"),
             ({"w": torch.zeros(4, 4, dtype=torch.float64)}, "dtype mismatch for 'w'.*float32"),
             ({"n": torch.zeros(1)}, "'n' is a tensor in the state dict but a value")]
    for target, message in cases:
        with pytest.raises(dcp.CheckpointError, match=message):
            dcp.load(target, ckpt_dir)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        dcp.load({"w": torch.zeros(4, 4)}, ckpt_dir + "-absent")


def test_save_refuses_differing_state_dicts(mesh1d, ckpt_dir):
    if WORLD.size == 1:
        pytest.skip("needs two ranks")
    state = {"w": torch.zeros(3)} if WORLD.rank == 0 else {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="differs from rank 0"):
        dcp.save(state, ckpt_dir)


@pytest.mark.parametrize("torch_format", [False, True], ids=["native", "torch_dcp"])
def test_ranks_with_different_keys_save_the_union(mesh1d, ckpt_dir, torch_format):
    """As pipeline stages do: each rank its own keys (and some shared); one checkpoint,
    in the native format and in torch DCP's."""
    if WORLD.size == 1:
        pytest.skip("needs two ranks")
    own = {f"r{WORLD.rank}": torch.full((WORLD.rank + 2,), float(WORLD.rank)), "step": torch.tensor(7.0),
           f"n{WORLD.rank}": WORLD.rank}
    dcp.save(own, storage_writer=dcp.FileSystemWriter(ckpt_dir) if torch_format else dcp.NativeWriter(ckpt_dir))
    everything = {k: v for r in range(WORLD.size)
                  for k, v in {f"r{r}": torch.full((r + 2,), float(r)), f"n{r}": r}.items()}
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in everything.items()}
    dcp.load(target, ckpt_dir)
    bad = [k for k, v in everything.items()
           if not (torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v)]
    assert_all_ranks(not bad, f"loaded wrong values for {bad}")


def test_flipped_byte_is_detected(mesh1d, ckpt_dir):
    tensors = {"a": global_tensor((8, 3), seed=1), "b": global_tensor((5,), seed=2)}
    dcp.save({"a": distribute_tensor(tensors["a"], mesh1d, [Shard(0)]), "b": tensors["b"]}, ckpt_dir)
    if WORLD.rank == 0:
        index = native.read_index(ckpt_dir)
        block = index["entries"][1]["tensor"]["blocks"][0]  # "b"
        flip_byte(os.path.join(ckpt_dir, index["data_files"][block["file"]]), block["offset"] + 6)
    WORLD.Barrier()
    for layout in ([Shard(0)], [R]):
        target = {"a": zeros_like_layout(tensors["a"], mesh1d, layout), "b": torch.zeros(5)}
        with pytest.raises(dcp.CheckpointError, match="checksum mismatch in tensor 'b'"):
            dcp.load(target, ckpt_dir)
    target = {"a": zeros_like_layout(tensors["a"], mesh1d, [Shard(1)])}
    dcp.load(target, ckpt_dir)  # the intact tensor still loads
    check_equal(target["a"], tensors["a"])
    message = ""
    if WORLD.rank == 0:
        try:
            dcp.load_plain(ckpt_dir)
        except dcp.CheckpointError as err:
            message = str(err)
    assert_all_ranks(WORLD.rank != 0 or "checksum mismatch in tensor 'b'" in message, message)


def test_unsupported_dtype_is_refused(ckpt_dir):
    with pytest.raises(TypeError, match="'q' has dtype torch.float8_e4m3fnuz"):
        dcp.save({"q": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, ckpt_dir)
