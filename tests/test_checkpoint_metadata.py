"""``save`` returns torch's ``Metadata`` and ``async_save``'s future resolves to it (an
``AsyncSaveResponse`` for a stager that stages through a future): equal, field by field,
to what torch.distributed.checkpoint itself returns for the same state dict (its
DTensors on gloo over the same ranks, 1-D and 2x2, uneven shards at 3 ranks, a
parameter that requires grad), equal to the ``.metadata`` file the torch-format writer
commits, the same on every rank, for every writer (native, torch DCP, Hugging Face
consolidated and sharded): chunks cover each tensor exactly once, values are
``BytesStorageMetadata``, and ``storage_data`` points at the bytes of each chunk."""
import io
import json
import os
import pickle
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp
import torch.distributed.tensor as tdt
from mpi4py import MPI
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh as torch_mesh

from helpers import assert_all_ranks, global_tensor, raises_everywhere
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.testing.gloo import init_gloo_process_group

WORLD = MPI.COMM_WORLD
R = Replicate()
# No shard is empty at 1-4 ranks (torch lists empty chunks, mpidtensor's writers do not
# write them); 13, 11, 7 and 5 split unevenly at 2, 3 and 4.
SHAPES = {"w": (13, 7), "v": (11,), "m": (5, 7), "p": (7, 3)}


def layouts() -> list[tuple[tuple[int, ...], dict[str, list]]]:
    """(mesh shape, placements of each tensor): 1-D over all ranks, and 2x2 at 4 ranks
    (Shard(1) on mesh dim 0 and Shard(0) on dim 1: torch lists those chunks in rank
    order, which is not the order of their offsets)."""
    found = [((WORLD.size,), {"w": [Shard(0)], "v": [Shard(0)], "m": [Shard(1)], "p": [R]})]
    if WORLD.size == 4:
        found.append(((2, 2), {"w": [Shard(0), Shard(1)], "v": [Shard(0), R], "m": [Shard(1), Shard(0)],
                               "p": [Shard(0), Shard(0)]}))
    return found


def values() -> dict:
    return {"step": 11, "names": ["a", "b"], "betas": (0.9, 0.95), "groups": [{"lr": 0.5, "ids": [1, 2]}]}


def mpid_state(mesh, placements: dict) -> dict:
    model = {k: distribute_tensor(global_tensor(s, seed=i), mesh, placements[k])
             for i, (k, s) in enumerate(SHAPES.items())}
    model["p"].requires_grad_(True)  # a parameter: torch records requires_grad
    return {"model": model, "scalar": torch.tensor(2.5), **values()}


def torch_state(tmesh, placements: dict) -> dict:
    model = {k: tdt.distribute_tensor(global_tensor(s, seed=i), tmesh,
                                      [tdt.Shard(p.dim) if p.is_shard() else tdt.Replicate() for p in placements[k]])
             for i, (k, s) in enumerate(SHAPES.items())}
    model["p"].requires_grad_(True)
    return {"model": model, "scalar": torch.tensor(2.5), **values()}


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed on gloo over the MPI ranks, for torch's own DCP; taken down
    after the module when it set it up (later modules may expect none)."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    init_gloo_process_group(WORLD)
    yield
    if owned:
        WORLD.Barrier()
        dist.destroy_process_group()


def same_on_every_rank(obj) -> bool:
    return len(set(WORLD.allgather(pickle.dumps(obj)))) == 1


def coverage_problem(metadata: Metadata) -> str | None:
    """None when every tensor's chunks cover it exactly once (no empty chunk)."""
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            count = torch.zeros(meta.size, dtype=torch.int32)
            for chunk in meta.chunks:
                if not all(chunk.sizes):
                    return f"{key}: empty chunk at {chunk.offsets}"
                count[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] += 1
            if not bool((count == 1).all()):
                return f"{key}: chunks {meta.chunks} do not cover {tuple(meta.size)} exactly once"
    return None


def saved_metadata(directory: str) -> Metadata:
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return pickle.load(f)


def test_save_returns_what_torch_returns(gloo, ckpt_dir):
    """torch's save and mpidtensor's (native and torch format) of the same state dict:
    equal state_dict_metadata and planner_data; the torch-format writer's Metadata is
    its .metadata file, its storage_data keys are torch's; the same on every rank."""
    for n, (shape, placements) in enumerate(layouts()):
        torch_dir, ours = f"{ckpt_dir}-torch{n}", f"{ckpt_dir}-ours{n}"
        expected = tdcp.save(torch_state(torch_mesh("cpu", shape), placements), checkpoint_id=torch_dir)
        state = mpid_state(init_device_mesh("cpu", shape), placements)
        got = dcp.save(state, storage_writer=dcp.FileSystemWriter(ours))
        native = dcp.save(state, ours + "-native")
        for name, md in (("torch format", got), ("native", native)):
            assert_all_ranks(isinstance(md, Metadata) and same_on_every_rank(md), f"{shape} {name}: not one Metadata")
            assert_all_ranks(md.state_dict_metadata == expected.state_dict_metadata,
                             f"{shape} {name}: {md.state_dict_metadata} != torch's {expected.state_dict_metadata}")
            assert_all_ranks(md.planner_data == expected.planner_data, f"{shape} {name}: planner_data differs")
        assert_all_ranks(got == saved_metadata(ours), f"{shape}: the returned Metadata is not the .metadata file")
        assert_all_ranks(set(got.storage_data) == set(expected.storage_data), f"{shape}: storage_data keys differ")
        assert_all_ranks(got.version == expected.version and got.storage_meta.checkpoint_id == ours)


def chunk_bytes_problem(metadata: Metadata, directory: str, tensors: dict, read) -> str | None:
    """None when ``read(directory, key, info, chunk)`` of each chunk's storage_data gives
    the values of its box (tensors: the global tensors by flat key)."""
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            for n, chunk in enumerate(meta.chunks):
                info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
                box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                saved = read(directory, key, info, chunk)
                if saved.dtype != meta.properties.dtype or not torch.equal(saved, tensors[key][box]):
                    return f"{key} chunk {n} at {tuple(chunk.offsets)}: storage_data points at other bytes"
    return None


def file_range(directory: str, info) -> bytes:
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def read_raw(directory: str, key: str, info, chunk) -> torch.Tensor:
    """A native chunk: its raw row-major bytes (float32 here) at a byte range."""
    raw = np.frombuffer(file_range(directory, info), np.float32).copy()
    return torch.from_numpy(raw).reshape(tuple(chunk.sizes))


def read_torch_save(directory: str, key: str, info, chunk) -> torch.Tensor:
    """A torch-format chunk: ``torch.save`` bytes at a byte range."""
    return torch.load(io.BytesIO(file_range(directory, info)), weights_only=True)


def read_safetensors(directory: str, key: str, name: str, chunk) -> torch.Tensor:
    """A Hugging Face chunk: its box of the whole tensor in the consolidated file
    ``name``, or the part in the shard file ``name`` saved at the chunk's offsets."""
    with safe_open(os.path.join(directory, name), "pt") as f:
        saved, header = f.get_tensor(key), f.metadata() or {}
    if "DCP_SHARDING_INFO" in header:
        start = json.loads(header["DCP_SHARDING_INFO"])[key]["saved_offsets"]
        return saved if tuple(start) == tuple(chunk.offsets) else torch.empty(0)
    return saved[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]


@pytest.mark.parametrize("layout", ["1d", "2x2", "replicas"])
def test_every_writer_describes_its_save(ckpt_dir, layout):
    """Native, torch-format and Hugging Face (consolidated, sharded) saves return the
    same description, the same on every rank: chunks cover each tensor exactly once
    (uneven and empty shards, replicas written once), values are BytesStorageMetadata,
    and each chunk's storage_data leads to its values."""
    if layout != "1d" and WORLD.size != 4:
        pytest.skip("2x2 layouts run with 4 ranks")
    shape = (WORLD.size,) if layout == "1d" else (2, 2)
    mesh = init_device_mesh("cpu", shape)
    placements = {"1d": {"w": [Shard(0)], "m": [Shard(1)], "tiny": [Shard(0)]},
                  "2x2": {"w": [Shard(1), Shard(0)], "m": [Shard(0), Shard(0)], "tiny": [Shard(1), Shard(0)]},
                  "replicas": {"w": [R, Shard(0)], "m": [Shard(1), R], "tiny": [R, R]}}[layout]
    full = {"w": global_tensor((13, 7), seed=1), "m": global_tensor((5, 7), seed=2),
            "tiny": global_tensor((2, 1), seed=3)}  # empty shards at 3 and 4 ranks
    tensors = {k: distribute_tensor(t, mesh, placements[k]) for k, t in full.items()}
    flat = {f"model.{k}": t for k, t in full.items()}
    native = dcp.save({"model": tensors, "step": 3, "betas": (0.9, 0.95)}, ckpt_dir + "-native")
    torch_md = dcp.save({"model": tensors, "step": 3, "betas": (0.9, 0.95)},
                        storage_writer=dcp.FileSystemWriter(ckpt_dir + "-torch"))
    hf = {mode: dcp.save({"model": tensors}, storage_writer=dcp.HuggingFaceStorageWriter(
        f"{ckpt_dir}-{mode}", save_distributed=mode == "sharded")) for mode in ("consolidated", "sharded")}
    for name, md in (("native", native), ("torch", torch_md), *hf.items()):
        assert_all_ranks(isinstance(md, Metadata) and same_on_every_rank(md), f"{name}: not one Metadata")
        problem = coverage_problem(md)
        assert_all_ranks(problem is None, f"{name}: {problem}")
    assert_all_ranks(native.state_dict_metadata == torch_md.state_dict_metadata, "native and torch format differ")
    assert_all_ranks(native.state_dict_metadata["step"] == BytesStorageMetadata()
                     and native.state_dict_metadata["betas"] == BytesStorageMetadata())
    tensor_md = {k: v for k, v in torch_md.state_dict_metadata.items() if k.startswith("model.")}
    for mode, md in hf.items():
        assert_all_ranks(md.state_dict_metadata == tensor_md, f"{mode}: {md.state_dict_metadata} != {tensor_md}")
        assert_all_ranks(md.planner_data == {k: tuple(k.split(".")) for k in tensor_md})
    problem = None
    if WORLD.rank == 0:
        problem = (chunk_bytes_problem(native, ckpt_dir + "-native", flat, read_raw)
                   or chunk_bytes_problem(torch_md, ckpt_dir + "-torch", flat, read_torch_save)
                   or chunk_bytes_problem(hf["consolidated"], ckpt_dir + "-consolidated", flat, read_safetensors)
                   or chunk_bytes_problem(hf["sharded"], ckpt_dir + "-sharded", flat, read_safetensors))
    assert_all_ranks(WORLD.bcast(problem) is None, str(WORLD.bcast(problem)))


class ThreadStager:
    """torch's AsyncStager protocol, staging in a thread and returning its future."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1)

    def stage(self, state_dict) -> Future:
        return self.pool.submit(dcp.HostStager(cache=False).stage, state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: async_save waits for the staged state dict."""


def test_async_save_resolves_to_the_metadata(mesh1d, ckpt_dir):
    """async_save's future resolves to what save returns (for the torch format: the
    .metadata file), the same on every rank; a stager staging through a future gets
    torch's AsyncSaveResponse, staging done on return, upload resolving to it."""
    partial = DTensor.from_local(global_tensor((3, 4), seed=WORLD.rank), mesh1d, [Partial()])
    state = {"model": {"w": distribute_tensor(global_tensor((13, 7)), mesh1d, [Shard(0)]), "g": partial},
             "step": 3, "names": ["a"]}
    synced = dcp.save(state, storage_writer=dcp.FileSystemWriter(ckpt_dir + "-sync"))
    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(ckpt_dir))
    got = future.result(timeout=120)
    assert_all_ranks(isinstance(future, Future) and got == saved_metadata(ckpt_dir) and same_on_every_rank(got))
    assert_all_ranks(got.state_dict_metadata == synced.state_dict_metadata and got.planner_data == synced.planner_data,
                     f"{got.state_dict_metadata} != {synced.state_dict_metadata}")
    stager = ThreadStager()
    response = dcp.async_save(state, checkpoint_id=ckpt_dir + "-native", async_stager=stager)
    assert_all_ranks(isinstance(response, AsyncSaveResponse) and response.staging_completion.done()
                     and response.staging_completion.result() is None)
    native = response.upload_completion.result(timeout=120)
    stager.pool.shutdown()
    assert_all_ranks(isinstance(native, Metadata) and same_on_every_rank(native)
                     and native.state_dict_metadata == synced.state_dict_metadata)
    problem = coverage_problem(native)
    assert_all_ranks(problem is None, str(problem))


def test_no_dist_and_refused_state_dicts(mesh1d, ckpt_dir):
    """no_dist: each process's own save, one whole chunk per tensor; a state dict torch
    cannot flatten (not a dict) is refused on every rank before anything is written."""
    mine = f"{ckpt_dir}-rank{WORLD.rank}"
    md = dcp.save({"w": global_tensor((5, 3)), "n": WORLD.rank}, mine, no_dist=True)
    chunks = md.state_dict_metadata["w"].chunks
    assert_all_ranks(len(chunks) == 1 and tuple(chunks[0].sizes) == (5, 3) and md.storage_meta.checkpoint_id == mine
                     and md.state_dict_metadata["n"] == BytesStorageMetadata())
    raises_everywhere(TypeError, lambda: dcp.save([distribute_tensor(global_tensor((4,)), mesh1d, [Shard(0)])],
                                                  ckpt_dir), "a torch DCP state dict is a dict")
    assert_all_ranks(not os.path.exists(ckpt_dir) or not os.listdir(ckpt_dir), "a refused save wrote files")
