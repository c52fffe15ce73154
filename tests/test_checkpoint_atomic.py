"""A save that fails or dies midway leaves the previous checkpoint loadable and no partial
one visible.

Three ways: in this job, a write call raises on every rank after the first one, or on
one rank only (the save raises everywhere, nothing is committed and the failed save's
data files are removed); and a real kill: rank 0 starts a
separate one-process MPI program (clean environment, so it is an MPI singleton and not
part of this job: a nested ``mpiexec`` under ``mpiexec`` is fragile) that saves once,
then exits with ``os._exit`` in the middle of its second save's writes. This job then
loads the directory.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, global_tensor
import mpidtensor.checkpoint as dcp
from mpidtensor import Shard, distribute_tensor
from mpidtensor.tools import launcher
from mpidtensor.checkpoint import io as ckpt_io
from mpidtensor.checkpoint.formats import native

WORLD = MPI.COMM_WORLD


def state(mesh, seed):
    return {"w": distribute_tensor(global_tensor((64, 8), seed=seed), mesh, [Shard(0)]),
            "b": global_tensor((5,), seed=seed + 1), "step": seed}


def loads_as(mesh, ckpt_dir, seed) -> bool:
    target = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(1)]), "b": torch.zeros(5), "step": -1}
    dcp.load(target, ckpt_dir)
    expected = state(mesh, seed)
    return (torch.equal(target["w"].full_tensor(), expected["w"].full_tensor())
            and torch.equal(target["b"], expected["b"]) and target["step"] == seed)


def committed_files(ckpt_dir):
    return sorted([native.INDEX, *native.read_index(ckpt_dir)["data_files"]])


def test_failed_save_keeps_previous_checkpoint(mesh1d, ckpt_dir, monkeypatch):
    dcp.save(state(mesh1d, 1), ckpt_dir)
    index_before = native.read_index(ckpt_dir)
    calls = []

    def failing_write(fd, buffers, offset):
        calls.append(len(buffers))
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        return os.pwritev(fd, buffers, offset)

    monkeypatch.setattr(ckpt_io, "MAX_CHUNK_BYTES", 64)  # many write calls per rank
    monkeypatch.setattr(ckpt_io, "write_call", failing_write)
    with pytest.raises(OSError, match="simulated"):
        dcp.save(state(mesh1d, 2), ckpt_dir)
    monkeypatch.undo()
    assert_all_ranks(len(calls) == 2, f"{calls}")
    assert_all_ranks(native.read_index(ckpt_dir) == index_before, "the index changed")
    files = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(files == committed_files(ckpt_dir), f"the failed save left files: {files}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 1), "previous checkpoint does not load")
    dcp.save(state(mesh1d, 3), ckpt_dir)  # replaces the previous checkpoint and its data files
    files = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(files == committed_files(ckpt_dir), f"{files}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 3))


def test_write_failure_on_one_rank_fails_everywhere(mesh1d, ckpt_dir, monkeypatch):
    """Only the last rank's write fails: every rank raises its error, nothing is committed."""
    dcp.save(state(mesh1d, 1), ckpt_dir)
    index_before = native.read_index(ckpt_dir)
    if WORLD.rank == WORLD.size - 1:
        def failing_write(fd, buffers, offset):
            raise OSError(f"no space left on rank {WORLD.rank} (simulated)")

        monkeypatch.setattr(ckpt_io, "write_call", failing_write)
    with pytest.raises(OSError, match=f"no space left on rank {WORLD.size - 1}"):
        dcp.save(state(mesh1d, 2), ckpt_dir)
    monkeypatch.undo()
    assert_all_ranks(native.read_index(ckpt_dir) == index_before, "the index changed")
    files = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(files == committed_files(ckpt_dir), f"the failed save left files: {files}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 1), "previous checkpoint does not load")


KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch
    import mpidtensor.checkpoint as dcp
    from mpidtensor.checkpoint import io
    path, first, second = sys.argv[1], torch.load(sys.argv[2]), torch.load(sys.argv[3])
    dcp.save(first, path)
    io.MAX_CHUNK_BYTES = 256
    written = []
    def write_then_die(fd, buffers, offset):
        written.append(os.pwritev(fd, buffers, offset))
        if len(written) == 3:
            os._exit(17)  # killed mid-write: no cleanup, no exception handling
        return written[-1]
    io.write_call = write_then_die
    dcp.save(second, path)
    sys.exit("the save was not interrupted")
""")


@pytest.mark.quick_at(2)  # a fresh process importing torch: the same at every size
def test_killed_save_keeps_previous_checkpoint(mesh1d, ckpt_dir):
    result = None
    if WORLD.rank == 0:
        base = os.path.dirname(ckpt_dir)
        for seed in (1, 2):
            full = {"w": global_tensor((64, 8), seed=seed), "b": global_tensor((5,), seed=seed + 1), "step": seed}
            torch.save(full, os.path.join(base, f"state{seed}.pt"))
        proc = subprocess.run(
            [sys.executable, "-c", KILLED_SAVE, ckpt_dir, *(os.path.join(base, f"state{s}.pt") for s in (1, 2))],
            env=launcher.nested_env(), capture_output=True, text=True, timeout=120,
        )
        leftovers = [n for n in os.listdir(ckpt_dir) if n.startswith("data-")]
        result = (proc.returncode, proc.stderr[-2000:], len(leftovers))
    returncode, stderr, leftovers = WORLD.bcast(result)
    assert_all_ranks(returncode == 17, f"the saving process ended with {returncode}: {stderr}")
    assert_all_ranks(leftovers == 2, f"expected the old and the partial data file, found {leftovers}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 1), "the previous checkpoint does not load after the kill")
