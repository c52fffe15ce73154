"""Checkpoints of tensor subclasses that cannot be viewed as bytes: a QLoRA model (torchao
NF4 base weights, float LoRA adapters) sharded with fully_shard, saved and loaded in the
native format and torch DCP's layout (each rank's block as its torch.save bytes), a
layout that cannot be resharded and plain/subclass mix-ups refused on every rank,
safetensors refused, one-process round trips through torch's own DCP both ways, and
load_plain / dcp_to_torch_save."""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from mpi4py import MPI
from torch import nn

import mpidtensor.checkpoint as dcp
from helpers import assert_all_ranks, raises_everywhere
from mpidtensor import DTensor
from mpidtensor.checkpoint import (
    CheckpointError,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    TensorStorageMetadata,
    dcp_to_torch_save,
    load_plain,
)
from mpidtensor.fsdp import fully_shard

pytest.importorskip("torchao.quantization")
from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor  # noqa: E402

WORLD = MPI.COMM_WORLD
DIM = 768  # rows split into whole NF4 scaler blocks (64 x 256 values) over 1-4 ranks
NF4_CLASS = f"{NF4Tensor.__module__}.NF4Tensor"
NF4_FIELDS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class QLoRALinear(nn.Module):
    """A frozen NF4 weight (``quantized`` False: a plain float one) plus a LoRA adapter."""

    def __init__(self, quantized: bool) -> None:
        super().__init__()
        weight = torch.randn(DIM, DIM) / DIM ** 0.5
        self.weight = nn.Parameter(to_nf4(weight) if quantized else weight, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(8, DIM))
        self.lora_b = nn.Parameter(torch.randn(DIM, 8))


def qlora(seed: int, shard: bool = True, quantized: bool = True) -> nn.Sequential:
    """Two QLoRA layers (the same on every rank), each layer and the root fully_shard-ed."""
    torch.manual_seed(seed)
    net = nn.Sequential(QLoRALinear(quantized), QLoRALinear(quantized))
    if shard:
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
    return net


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p


def differences(a: nn.Module, b: nn.Module) -> list[str]:
    """The parameters (NF4: their inner tensors) whose local blocks differ bitwise."""
    out = []
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        x, y = _local(p), _local(q)
        if isinstance(x, NF4Tensor):
            if type(y) is not NF4Tensor:
                out.append(f"{name} is a {type(y).__name__}")
            else:
                out += [f"{name}.{f}" for f in NF4_FIELDS if not torch.equal(getattr(x, f), getattr(y, f))]
        elif not torch.equal(x, y):
            out.append(name)
    return out


def check_loaded(saved: nn.Module, loaded: nn.Module, before: list[str]) -> None:
    """``loaded`` differed from ``saved`` before the load (``before``) and equals it now."""
    after = differences(saved, loaded)
    assert_all_ranks(any(".weight." in d for d in before) and not after, f"before {before}, after {after}")


def rank_dir(ckpt_dir: str) -> str:
    """A directory of this rank's own under the shared ``ckpt_dir``."""
    return os.path.join(ckpt_dir, f"rank{WORLD.rank}")


@pytest.mark.parametrize("storage", ["native", "torch"])
def test_fsdp_round_trip(ckpt_dir, storage):
    """Saved sharded, loaded into a fresh model with other values in the same layout: every
    local block bit-equal; the returned Metadata lists the NF4 weights as torch's does."""
    net, fresh = qlora(0), qlora(5)
    writer = FileSystemWriter(ckpt_dir) if storage == "torch" else None
    metadata = dcp.save(net.state_dict(), checkpoint_id=ckpt_dir, storage_writer=writer)
    before = differences(net, fresh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    check_loaded(net, fresh, before)
    md = metadata.state_dict_metadata["0.weight"]
    rows = DIM // WORLD.size
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    infos = [info for index, info in metadata.storage_data.items() if index.fqn == "0.weight"]
    ok = (isinstance(md, TensorStorageMetadata) and md.size == (DIM, DIM) and md.properties.dtype == torch.float32
          and chunks == [((r * rows, 0), (rows, DIM)) for r in range(WORLD.size)] and len(infos) == WORLD.size)
    assert_all_ranks(ok, f"metadata {md}, storage {infos}")
    if storage == "native":
        entry = next(e for e in json.load(open(os.path.join(ckpt_dir, "index.json")))["entries"]
                     if e["key"] == "0.weight")["tensor"]
        ok = entry["encoding"] == "torch.save" and entry["class"].endswith(".NF4Tensor") and all(
            info.length == b["nbytes"] for info, b in zip(infos, sorted(entry["blocks"], key=lambda b: b["file"])))
        assert_all_ranks(ok, f"index entry {entry}")


@pytest.mark.parametrize("storage", ["native", "torch"])
def test_other_layout_refused_everywhere(ckpt_dir, storage):
    """Opaque blocks are not resharded: a target holding the whole weight on every rank
    (collectively, and each rank alone under no_dist) loads at 1 rank and raises
    CheckpointError naming the key and both layouts on every rank otherwise."""
    writer = FileSystemWriter(ckpt_dir) if storage == "torch" else None
    net, rows = qlora(0), DIM // WORLD.size
    dcp.save(net.state_dict(), checkpoint_id=ckpt_dir, storage_writer=writer)
    for no_dist in (False, True):
        whole = qlora(5, shard=False)
        if WORLD.size == 1:
            before = differences(qlora(0, shard=False), whole)
            dcp.load(whole.state_dict(), checkpoint_id=ckpt_dir, no_dist=no_dist)
            check_loaded(qlora(0, shard=False), whole, before)
        else:
            try:
                dcp.load(whole.state_dict(), checkpoint_id=ckpt_dir, no_dist=no_dist)
                verdict = "loaded"
            except CheckpointError as err:
                parts = (f"'0.weight' ({NF4_CLASS}) was saved as opaque torch.save blocks [((0, 0), ({rows}, {DIM}))",
                         f"into the target boxes [((0, 0), ({DIM}, {DIM}))]")
                verdict = None if all(part in str(err) for part in parts) else f"message: {err}"
            assert_all_ranks(verdict is None, f"no_dist={no_dist}: {verdict}")


@pytest.mark.parametrize("storage", ["native", "torch", "safetensors"])
def test_plain_and_subclass_do_not_mix(ckpt_dir, storage):
    """A plain target of a saved NF4 leaf, and an NF4 target of a saved plain one, raise
    CheckpointError naming the key on every rank (native, safetensors: before any data
    moves; torch's layout, whose metadata does not say which chunks are subclasses: once
    the chunk is read). torchao's NF4 copy_ from a plain tensor into a row shard recurses
    without end, so the mix-up is refused rather than quantized."""
    writers = {"native": None, "torch": FileSystemWriter, "safetensors": HuggingFaceStorageWriter}
    pairs = [(qlora(0, quantized=False), qlora(5))]
    if storage != "safetensors":
        pairs.append((qlora(0), qlora(5, quantized=False)))
    for n, (saved, target) in enumerate(pairs):
        path = os.path.join(ckpt_dir, str(n))
        writer = writers[storage] and writers[storage](path)
        dcp.save(saved.state_dict(), checkpoint_id=path, storage_writer=writer)
        keep = {k: _local(v).clone() for k, v in target.state_dict().items()}
        kinds = ("a plain tensor", f"a {NF4_CLASS}")
        reader = HuggingFaceStorageReader(path) if storage == "safetensors" else None
        raises_everywhere(CheckpointError, lambda: dcp.load(target.state_dict(), checkpoint_id=path,
                                                            storage_reader=reader),
                          f"'0.weight' is {kinds[n]} in the checkpoint but {kinds[1 - n]} in the state dict")
        if storage != "torch":
            untouched = all(torch.equal(_local(v), keep[k]) if not isinstance(keep[k], NF4Tensor) else
                            torch.equal(_local(v).quantized_data, keep[k].quantized_data)
                            for k, v in target.state_dict().items())
            assert_all_ranks(untouched, "a refused load changed the target")


def test_safetensors_refuses(ckpt_dir):
    """safetensors hold plain dtypes: TypeError naming the key on every rank, no file written."""
    net = qlora(0)
    raises_everywhere(TypeError, lambda: dcp.save(net.state_dict(), storage_writer=HuggingFaceStorageWriter(ckpt_dir)),
                      f"'0.weight' ({NF4_CLASS})")
    written = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    assert_all_ranks(not written, f"files written: {written}")


def test_torch_dcp_interop_one_process(ckpt_dir):
    """Each rank alone (no_dist): torch's DCP loads an unsharded NF4 model that
    mpidtensor's FileSystemWriter wrote, and mpidtensor loads one torch wrote."""
    directory = rank_dir(ckpt_dir)
    problems = []
    for writer in ("mpidtensor", "torch"):
        path = os.path.join(directory, writer)
        net, fresh = qlora(0, shard=False), qlora(5, shard=False)
        if writer == "mpidtensor":
            dcp.save(net.state_dict(), storage_writer=FileSystemWriter(path), no_dist=True)
        else:
            tdcp.save(net.state_dict(), checkpoint_id=path, no_dist=True)
        before = differences(net, fresh)
        state = fresh.state_dict()
        if writer == "mpidtensor":
            tdcp.load(state, checkpoint_id=path, no_dist=True)
        else:
            dcp.load(state, checkpoint_id=path, no_dist=True)
        after = differences(net, fresh)
        if not any(".weight." in d for d in before) or after:
            problems.append(f"{writer} wrote: before {before}, after {after}")
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.parametrize("storage", ["native", "torch"])
def test_load_plain_and_dcp_to_torch_save(ckpt_dir, storage):
    """One process: an NF4 leaf saved as one block comes back as an NF4Tensor (load_plain,
    dcp_to_torch_save); a sharded one (2+ ranks) raises CheckpointError naming the key."""
    net = qlora(0, shard=False)
    one = os.path.join(rank_dir(ckpt_dir), "one")
    writer = FileSystemWriter(one) if storage == "torch" else None
    dcp.save(net.state_dict(), checkpoint_id=one, storage_writer=writer, no_dist=True)
    sharded = os.path.join(ckpt_dir, "sharded")
    writer = FileSystemWriter(sharded) if storage == "torch" else None
    dcp.save(qlora(0).state_dict(), checkpoint_id=sharded, storage_writer=writer)
    problems = []
    file = os.path.join(rank_dir(ckpt_dir), "whole.pt")
    dcp_to_torch_save(one, file)
    readers = [("dcp_to_torch_save", torch.load(file, weights_only=True))]
    if storage == "native":
        readers.append(("load_plain", load_plain(one)))
    for how, state in readers:
        for name, p in net.state_dict().items():
            got = state[name]
            if isinstance(p, NF4Tensor):
                same = type(got) is NF4Tensor and all(torch.equal(getattr(p, f), getattr(got, f)) for f in NF4_FIELDS)
            else:
                same = torch.equal(p, got)
            if not same:
                problems.append(f"{how}: {name}")
    if WORLD.size > 1:
        try:
            load_plain(sharded) if storage == "native" else dcp_to_torch_save(sharded, file)
            problems.append("a sharded NF4 leaf was read whole")
        except CheckpointError as err:
            if "'0.weight'" not in str(err):
                problems.append(f"the error does not name the key: {err}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_refused_class_and_safe_globals(ckpt_dir):
    """A subclass that torch.load(weights_only=True) refuses raises CheckpointError naming
    the key and add_safe_globals on every rank; allowed, it loads (a replicated leaf)."""
    from torch.testing._internal.two_tensor import TwoTensor

    saved = TwoTensor(torch.arange(12.0).reshape(3, 4), -torch.arange(12.0).reshape(3, 4))
    dcp.save({"t": saved}, checkpoint_id=ckpt_dir)
    target = {"t": TwoTensor(torch.zeros(3, 4), torch.zeros(3, 4))}
    raises_everywhere(CheckpointError, lambda: dcp.load(target, checkpoint_id=ckpt_dir), "add_safe_globals")
    with torch.serialization.safe_globals([TwoTensor]):
        dcp.load(target, checkpoint_id=ckpt_dir)
    got = target["t"]
    assert_all_ranks(torch.equal(got.a, saved.a) and torch.equal(got.b, saved.b), f"loaded {got.a}, {got.b}")


def test_float8_training_weights_stay_raw_and_reshard(ckpt_dir):
    """torchao's float8 training weights are wrapper subclasses that hand out their
    high-precision values: they are stored as raw blocks (no ``encoding``), so a model of
    another layout loads them, here an unsharded one in each process (``no_dist``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def float8_model(seed: int, shard: bool) -> nn.Sequential:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
        convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        return fully_shard(net) if shard else net

    net = float8_model(0, shard=True)
    dcp.save(net.state_dict(), checkpoint_id=ckpt_dir)
    entries = json.load(open(os.path.join(ckpt_dir, "index.json")))["entries"]
    encoded = [e["key"] for e in entries if "tensor" in e and "encoding" in e["tensor"]]
    whole = {key: p.full_tensor() for key, p in net.state_dict().items()}
    alone = float8_model(5, shard=False)
    state = alone.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir, no_dist=True)
    differ = [key for key, value in state.items() if not torch.equal(value, whole[key])]
    assert_all_ranks(not encoded and not differ, f"stored opaquely: {encoded}; loaded values differ: {differ}")


def test_async_save_snapshots_the_nf4_shards(ckpt_dir):
    """``async_save`` stages an NF4 shard as a zeroed NF4 it copies itself into (exact; its
    ``clone`` re-quantizes): the checkpoint holds the values of the call, changes made
    while it is written included."""
    net, same, fresh = qlora(0), qlora(0), qlora(5)
    future = dcp.async_save(net.state_dict(), checkpoint_id=ckpt_dir)
    with torch.no_grad():
        _local(net[0].weight).quantized_data.zero_()
        net[0].lora_a.add_(1.0)
    future.result()
    before = differences(same, fresh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    check_loaded(same, fresh, before)
