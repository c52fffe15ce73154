"""async_save: the checkpoint holds the values of the call while training (collectives
included) goes on during the write; errors on one rank reach result() on every rank and
leave the previous checkpoint; staging, its failures and the options; the synchronous
fallback where MPI lacks MPI_THREAD_MULTIPLE."""
import os
import threading
from concurrent.futures import Future

import pytest
import torch
from mpi4py import MPI
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from helpers import assert_all_ranks, global_tensor, raises_everywhere
import mpidtensor.checkpoint as dcp
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.checkpoint import async_saver
from mpidtensor.checkpoint import io as ckpt_io
from mpidtensor.checkpoint.formats import native
from mpidtensor.fsdp import fully_shard

WORLD = MPI.COMM_WORLD


def make_state(mesh, seed: int) -> dict:
    partial = DTensor.from_local(global_tensor((3, 4), seed=seed + WORLD.rank), mesh, [Partial()])
    return {"w": distribute_tensor(global_tensor((9, 4), seed=seed), mesh, [Shard(0)]), "p": partial,
            "b": global_tensor((5,), seed=seed + 100), "meta": {"step": seed, "tags": ["a", seed]}}


def expected_of(state: dict) -> dict:
    """The whole values of ``state`` (collective: Partial summed, shards gathered)."""
    return {"w": state["w"].full_tensor().clone(), "p": state["p"].full_tensor().clone(),
            "b": state["b"].clone(), "meta": {"step": state["meta"]["step"], "tags": list(state["meta"]["tags"])}}


def loads_as(mesh, path: str, expected: dict) -> bool:
    target = {"w": distribute_tensor(torch.zeros(9, 4), mesh, [Shard(1)]), "p": torch.zeros(3, 4),
              "b": torch.zeros(5), "meta": {"step": -1, "tags": ["", 0]}}
    dcp.load(target, path)
    return (torch.equal(target["w"].full_tensor(), expected["w"]) and torch.allclose(target["p"], expected["p"])
            and torch.equal(target["b"], expected["b"]) and target["meta"] == expected["meta"])


def test_training_goes_on_while_the_save_writes(mesh1d, ckpt_dir, monkeypatch):
    """The background writes wait until the caller has run FSDP training steps (their
    all-gathers and reduce-scatters), changed every other value in place and run more
    collectives; no deadlock, and the checkpoint holds the values of the call."""
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(16, 8), mesh=mesh1d)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {**make_state(mesh1d, 1), "model": model}
    expected = expected_of(state)
    expected_model = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    trained = threading.Event()
    real_write = ckpt_io.write_call

    def write_after_training(fd, buffers, offset):
        assert trained.wait(timeout=120), "the caller's training did not finish"
        return real_write(fd, buffers, offset)

    monkeypatch.setattr(ckpt_io, "write_call", write_after_training)
    future = dcp.async_save(state, checkpoint_id=ckpt_dir)
    for step in range(3):  # the caller's training: FSDP steps, in-place updates, collectives
        model(torch.rand(4, 16, generator=torch.Generator().manual_seed(step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            state["w"].add_(1.0)
            state["p"]._local_tensor.mul_(2.0)
            state["b"].sub_(1.0)
        state["meta"]["step"] += 1
        state["meta"]["tags"][1] = -step
        WORLD.allreduce(float(state["w"].redistribute(mesh1d, [Replicate()]).to_local().sum()))
    trained.set()
    assert_all_ranks(isinstance(future.result(timeout=120), Metadata))
    monkeypatch.undo()
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, expected), "the checkpoint does not hold the values of the call")
    fresh = fully_shard(torch.nn.Linear(16, 8), mesh=mesh1d)
    target = {"model": fresh}
    dcp.load(target, ckpt_dir)
    ok = all(torch.equal(v.full_tensor(), expected_model[k]) for k, v in fresh.state_dict().items())
    assert_all_ranks(ok and not torch.equal(model.weight.full_tensor(), expected_model["weight"]))


def test_write_error_on_one_rank_reaches_every_result(mesh1d, ckpt_dir, monkeypatch):
    """The last rank's write fails: result() raises that error on every rank; nothing is
    committed and the previous checkpoint loads; the next async_save succeeds."""
    state = make_state(mesh1d, 1)
    expected = expected_of(state)
    dcp.async_save(state, checkpoint_id=ckpt_dir).result()
    index_before = native.read_index(ckpt_dir)
    if WORLD.rank == WORLD.size - 1:
        def failing_write(fd, buffers, offset):
            raise OSError(f"disk full on rank {WORLD.rank} (simulated)")

        monkeypatch.setattr(ckpt_io, "write_call", failing_write)
    future = dcp.async_save(make_state(mesh1d, 2), checkpoint_id=ckpt_dir)
    raises_everywhere(OSError, lambda: future.result(timeout=120), f"disk full on rank {WORLD.size - 1}")
    monkeypatch.undo()
    assert_all_ranks(native.read_index(ckpt_dir) == index_before, "the failed save changed the index")
    files = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(files == sorted([native.INDEX, *index_before["data_files"]]), f"left files: {files}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, expected), "the previous checkpoint does not load")
    again = make_state(mesh1d, 3)
    expected = expected_of(again)
    dcp.async_save(again, checkpoint_id=ckpt_dir).result(timeout=120)
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, expected))


def test_save_and_load_wait_for_the_save_in_flight(mesh1d, ckpt_dir, monkeypatch):
    """A save right after an async_save to the same directory waits for it (no race on
    the files), and the later save is the one committed."""
    first, second = make_state(mesh1d, 4), make_state(mesh1d, 5)
    expected = expected_of(second)
    real_write = ckpt_io.write_call
    slowed = threading.Event()

    def slow_write(fd, buffers, offset):
        slowed.set()
        threading.Event().wait(0.2)
        return real_write(fd, buffers, offset)

    monkeypatch.setattr(ckpt_io, "write_call", slow_write)
    future = dcp.async_save(first, checkpoint_id=ckpt_dir)
    dcp.save(second, ckpt_dir)
    assert_all_ranks(future.done() and future.exception() is None and slowed.is_set())
    monkeypatch.undo()
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, expected))


def test_fallback_without_thread_multiple(mesh1d, ckpt_dir, monkeypatch):
    """Where MPI gives less than MPI_THREAD_MULTIPLE the write runs in the call (with a
    warning) and the future is done on return."""
    monkeypatch.setattr(async_saver, "threads_may_call_mpi", lambda: False)
    monkeypatch.setattr(async_saver, "_warned", threading.Event())
    state = make_state(mesh1d, 6)
    expected = expected_of(state)
    with pytest.warns(UserWarning, match="MPI_THREAD_MULTIPLE"):
        future = dcp.async_save(state, checkpoint_id=ckpt_dir)
    assert_all_ranks(future.done() and isinstance(future.result(), Metadata))
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, expected))


class FutureStager:
    """torch's AsyncStager protocol, staging through a future (as torch's async staging does)."""

    should_synchronize_after_execute = True

    def __init__(self, fail_on_last_rank: bool = False) -> None:
        self.fail, self.synchronized = fail_on_last_rank, 0

    def stage(self, state_dict):
        if self.fail and WORLD.rank == WORLD.size - 1:
            raise MemoryError("no host memory (simulated)")
        future = Future()
        future.set_result(dcp.HostStager(cache=False).stage(state_dict))
        return future

    def synchronize_staging(self):
        self.synchronized += 1


def test_stagers_and_options(mesh1d, ckpt_dir):
    """HostStager keeps its buffers for the next stage (unless cache=False); a stager of
    torch's protocol is used; PROCESS, a stager failing on one rank and Partial DTensors
    that differ between ranks are refused on every rank."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = make_state(mesh1d, 7)
    for cache in (True, False):
        stager = dcp.HostStager(cache=cache)
        first = stager.stage({"b": state["b"]})["b"]
        second = stager.stage({"b": state["b"]})["b"]
        assert_all_ranks((first.data_ptr() == second.data_ptr()) == cache and torch.equal(second, state["b"]))
        stager.close()
    reduced = expected_of(state)
    stager = FutureStager()
    response = dcp.async_save(state, checkpoint_id=ckpt_dir, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)
    assert_all_ranks(isinstance(response, AsyncSaveResponse) and response.staging_completion.done())
    assert_all_ranks(isinstance(response.upload_completion.result(timeout=120), Metadata)
                     and stager.synchronized == 1)
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, reduced))
    raises_everywhere(ValueError, lambda: dcp.async_save(state, checkpoint_id=ckpt_dir,
                                                         async_checkpointer_type=AsyncCheckpointerType.PROCESS),
                      "not supported")
    raises_everywhere(dcp.CheckpointError, lambda: dcp.async_save(state, checkpoint_id=ckpt_dir,
                                                                  async_stager=FutureStager(True)),
                      f"stage the state dict: MemoryError: no host memory (simulated) (on rank {WORLD.size - 1})")
    if WORLD.size > 1:
        odd = {"x": DTensor.from_local(torch.ones(2), mesh1d, [Partial()] if WORLD.rank else [Replicate()])}
        raises_everywhere(ValueError, lambda: dcp.async_save(odd, checkpoint_id=ckpt_dir), "differs from rank 0's")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, reduced), "a refused call changed the checkpoint")


def test_async_save_through_another_writer(mesh1d, ckpt_dir):
    """Any storage writer runs in the background unchanged: torch DCP's layout here,
    loaded back with the reader found from the directory."""
    state = make_state(mesh1d, 8)
    expected = expected_of(state)
    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(ckpt_dir))
    with torch.no_grad():
        state["w"].add_(1.0)
    future.result(timeout=120)
    assert_all_ranks(os.path.exists(os.path.join(ckpt_dir, ".metadata")) and loads_as(mesh1d, ckpt_dir, expected))
