"""Hugging Face safetensors, against transformers itself, both ways: save_pretrained ->
HuggingFaceStorageReader into FSDP, TP and 2x2 FSDP x TP models of a tiny Llama ->
logits equal to the unsharded model's; the writer from those layouts (files by an
fqn_to_index_mapping, bfloat16 and float16 too) -> from_pretrained -> logits equal;
torch's shard layout both ways; a failed save keeps the previous weights; corrupt,
truncated and mismatching files fail on every rank naming the file or key."""
import json
import os

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import assert_all_ranks, assert_close, raises_everywhere  # noqa: E402
from mpidtensor import DTensor, init_device_mesh  # noqa: E402
from mpidtensor.checkpoint import CheckpointError  # noqa: E402
from mpidtensor.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter  # noqa: E402
from mpidtensor.fsdp import fully_shard  # noqa: E402
from mpidtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

WORLD = MPI.COMM_WORLD
TP_PLAN = {
    **{f"model.layers.*.self_attn.{p}": ColwiseParallel for p in ("q_proj", "k_proj", "v_proj")},
    "model.layers.*.self_attn.o_proj": RowwiseParallel,
    "model.layers.*.mlp.gate_proj": ColwiseParallel, "model.layers.*.mlp.up_proj": ColwiseParallel,
    "model.layers.*.mlp.down_proj": RowwiseParallel,
}


def config():
    """Heads (12) divide by 1-4 ranks; the vocabulary (101) and the width (48) do not all."""
    return transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=12, num_key_value_heads=12, vocab_size=101,
                                    tie_word_embeddings=False, max_position_embeddings=64)


def llama(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config()).to(dtype).eval()


def ids():
    return torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        out = model(ids()).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def parallel(model, layout: str):
    """``model`` made FSDP (over all ranks), TP (over all ranks) or FSDP x TP (2x2)."""
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD.size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if layout == "tp":
        mesh = init_device_mesh("cpu", (WORLD.size,))
        return parallelize_module(model, mesh, {k: style() for k, style in TP_PLAN.items()})
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {k: style() for k, style in TP_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


LAYOUTS = ["fsdp", "tp", "fsdp_tp"]


def skip_unless_world(layout):
    if layout == "fsdp_tp" and WORLD.size != 4:
        pytest.skip("FSDP x TP runs on a 2x2 mesh (4 ranks)")


def save_pretrained(model, path):
    if WORLD.rank == 0:
        model.save_pretrained(path)
    WORLD.Barrier()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_save_pretrained_into_sharded_model(ckpt_dir, layout):
    skip_unless_world(layout)
    source = llama(seed=1)
    save_pretrained(source, ckpt_dir)
    assert_all_ranks(HuggingFaceStorageReader.recognizes(ckpt_dir), "not recognized")
    model = parallel(llama(seed=2), layout)
    state = model.state_dict()
    assert_all_ranks(any(isinstance(v, DTensor) for v in state.values()), "nothing is sharded")
    HuggingFaceStorageReader(ckpt_dir).read(state, WORLD)
    for key, value in source.state_dict().items():
        got = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
        assert_all_ranks(torch.equal(got, value), f"{key} differs")
    assert_close(logits(model), logits(source))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_sharded_model_for_from_pretrained(ckpt_dir, layout):
    """Several files (by fqn_to_index_mapping), each rank writing its parts into them."""
    skip_unless_world(layout)
    source = llama(seed=1)
    model = parallel(llama(seed=1), layout)
    state = model.state_dict()
    mapping = {key: 1 + i % 3 for i, key in enumerate(state)}
    HuggingFaceStorageWriter(ckpt_dir, fqn_to_index_mapping=mapping, save_distributed=True,
                             enable_consolidation=True).write(state, WORLD)
    if WORLD.rank == 0:
        source.config.save_pretrained(ckpt_dir)
    WORLD.Barrier()
    names = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".safetensors"))
    assert_all_ranks(names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], str(names))
    loaded = transformers.LlamaForCausalLM.from_pretrained(ckpt_dir).eval()
    for key, value in source.state_dict().items():
        assert_all_ranks(torch.equal(loaded.state_dict()[key], value), f"{key} differs")
    assert_close(logits(loaded), logits(source))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_both_ways(ckpt_dir, dtype):
    """TP in bfloat16 / float16 -> one file -> from_pretrained; save_pretrained in that
    dtype -> an FSDP model."""
    source = llama(seed=4, dtype=dtype)
    model = parallel(llama(seed=4, dtype=dtype), "tp")
    HuggingFaceStorageWriter(ckpt_dir).write(model.state_dict(), WORLD)
    if WORLD.rank == 0:
        source.config.save_pretrained(ckpt_dir)
    WORLD.Barrier()
    loaded = transformers.LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=dtype)
    same = all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())
    assert_all_ranks(same and loaded.dtype == dtype, "from_pretrained differs")
    other = os.path.join(ckpt_dir, "pretrained")
    save_pretrained(source, other)
    target = parallel(llama(seed=5, dtype=dtype), "fsdp")
    state = target.state_dict()
    HuggingFaceStorageReader(other).read(state, WORLD)
    same = all(torch.equal(state[k].full_tensor(), v) for k, v in source.state_dict().items())
    assert_all_ranks(same, "read of save_pretrained differs")


def test_torch_shard_layout_both_ways(ckpt_dir):
    """save_distributed without consolidation: torch's per-rank shard files with their
    offsets; read back into another layout here and by torch's safetensors reader."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    source = llama(seed=6)
    model = parallel(llama(seed=6), "fsdp")
    HuggingFaceStorageWriter(ckpt_dir, save_distributed=True).write(model.state_dict(), WORLD)
    names = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(names == [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in range(WORLD.size)],
                     str(names))
    target = parallel(llama(seed=7), "tp")
    state = target.state_dict()
    HuggingFaceStorageReader(ckpt_dir).read(state, WORLD)
    assert_close(logits(target), logits(source))
    out = os.path.join(ckpt_dir, "consolidated")
    if WORLD.rank == 0:  # torch's consolidation of the shard files, read by transformers
        os.makedirs(out)
        consolidate_safetensors_files(ckpt_dir, out, dict.fromkeys(state, 1))
        source.config.save_pretrained(out)
    WORLD.Barrier()
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert_close(logits(loaded), logits(source))


@pytest.mark.parametrize("save_distributed", [False, True])
def test_failed_save_keeps_previous_weights(ckpt_dir, monkeypatch, save_distributed):
    """A write failing on the last rank raises everywhere and leaves the files of the
    previous save as they were (consolidated, or torch's shard files), and no others."""
    from mpidtensor.checkpoint import io as ckpt_io

    source = llama(seed=1)
    model = parallel(llama(seed=1), "fsdp")
    HuggingFaceStorageWriter(ckpt_dir, save_distributed=save_distributed).write(model.state_dict(), WORLD)
    before = sorted(os.listdir(ckpt_dir))
    real = ckpt_io.write_call

    def failing(fd, buffers, offset):
        if WORLD.rank == WORLD.size - 1:
            raise OSError("disk full")
        return real(fd, buffers, offset)

    monkeypatch.setattr(ckpt_io, "write_call", failing)
    changed = {k: v.detach() + 1 for k, v in model.state_dict().items()}
    raises_everywhere(OSError, lambda: HuggingFaceStorageWriter(ckpt_dir, save_distributed=save_distributed)
                      .write(changed, WORLD), "disk full")
    monkeypatch.undo()
    WORLD.Barrier()
    names = sorted(os.listdir(ckpt_dir))
    if not save_distributed:
        assert_all_ranks(names == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"], str(names))
    assert_all_ranks(names == before, f"{names} after the failed save, {before} before it")
    state = {k: torch.zeros_like(v) for k, v in source.state_dict().items()}
    HuggingFaceStorageReader(ckpt_dir).read(state, WORLD)
    assert_all_ranks(all(torch.equal(state[k], v) for k, v in source.state_dict().items()), "previous weights")


def _weights(ckpt_dir):
    source = llama(seed=1)
    save_pretrained(source, ckpt_dir)
    return os.path.join(ckpt_dir, "model.safetensors"), {k: torch.zeros_like(v) for k, v in
                                                         source.state_dict().items()}


@pytest.mark.parametrize("damage", ["header", "truncate", "length"])
def test_damaged_file(ckpt_dir, damage):
    path, state = _weights(ckpt_dir)
    if WORLD.rank == 0:
        if damage == "header":
            with open(path, "r+b") as f:
                f.seek(8)
                f.write(b"\xff\xfe not json")
        elif damage == "truncate":
            os.truncate(path, os.path.getsize(path) - 100)
        else:
            with open(path, "r+b") as f:
                f.write((10 ** 12).to_bytes(8, "little"))
    WORLD.Barrier()
    raises_everywhere(CheckpointError, lambda: HuggingFaceStorageReader(ckpt_dir).read(state, WORLD), path)


def test_index_names_missing_file(ckpt_dir):
    model = llama(seed=1)
    state = model.state_dict()
    HuggingFaceStorageWriter(ckpt_dir, fqn_to_index_mapping={k: 1 + i % 2 for i, k in enumerate(state)}).write(
        state, WORLD)
    victim = os.path.join(ckpt_dir, "model-00002-of-00002.safetensors")
    if WORLD.rank == 0:
        os.remove(victim)
    WORLD.Barrier()
    raises_everywhere(FileNotFoundError, lambda: HuggingFaceStorageReader(ckpt_dir).read(state, WORLD), victim)
    with open(os.path.join(ckpt_dir, "model.safetensors.index.json")) as f:
        assert_all_ranks(set(json.load(f)["weight_map"]) == set(state))


@pytest.mark.parametrize("problem", ["missing", "shape", "dtype", "not_tensor"])
def test_mismatching_target(ckpt_dir, problem):
    _, state = _weights(ckpt_dir)
    key = "model.layers.0.mlp.up_proj.weight"
    expected = {"missing": "missing key 'extra.weight'", "shape": f"shape mismatch for {key!r}",
                "dtype": f"dtype mismatch for {key!r}", "not_tensor": "'step' is not a tensor"}[problem]
    if problem == "missing":
        state["extra.weight"] = torch.zeros(2)
    elif problem == "shape":
        state[key] = torch.zeros(3, 3)
    elif problem == "dtype":
        state[key] = state[key].to(torch.bfloat16)
    else:
        state["step"] = 3
    raises_everywhere(CheckpointError, lambda: HuggingFaceStorageReader(ckpt_dir).read(state, WORLD), expected)


def test_writer_refuses_values_and_unmapped_keys(ckpt_dir):
    state = {"w": torch.ones(3), "step": 2}
    raises_everywhere(TypeError, lambda: HuggingFaceStorageWriter(ckpt_dir).write(state, WORLD), "step")
    state = {"w": torch.ones(3), "b": torch.ones(2)}
    raises_everywhere(ValueError, lambda: HuggingFaceStorageWriter(ckpt_dir, fqn_to_index_mapping={"w": 1}).write(
        state, WORLD), "['b']")


def test_through_save_and_load(ckpt_dir):
    """``checkpoint.save`` / ``load`` with the storage_writer= / storage_reader= arguments."""
    import mpidtensor.checkpoint as dcp

    source = llama(seed=1)
    model = parallel(llama(seed=1), "tp")
    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
        ckpt_dir, save_distributed=True, enable_consolidation=True))
    target = parallel(llama(seed=2), "fsdp")
    state = target.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(ckpt_dir))
    assert_close(logits(target), logits(source))
