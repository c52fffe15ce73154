"""A save that fails or dies midway leaves the previous checkpoint loadable and no partial
one visible.

Two ways: in this job, the collective write raises on every rank after the first piece
(the save raises everywhere; nothing is committed); and a real kill: rank 0 starts a
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
from mpidtensor.checkpoint import format as fmt
from mpidtensor.checkpoint import io as ckpt_io

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


def test_failed_save_keeps_previous_checkpoint(mesh1d, ckpt_dir, monkeypatch):
    dcp.save(state(mesh1d, 1), ckpt_dir)
    index_before = fmt.read_index(ckpt_dir)
    calls = []

    def failing_write(fh, buf):
        calls.append(buf[1])
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        fh.Write_all(buf)

    monkeypatch.setattr(ckpt_io, "MAX_CHUNK_BYTES", 64)  # many pieces per rank
    monkeypatch.setattr(ckpt_io, "write_piece", failing_write)
    with pytest.raises(OSError, match="simulated"):
        dcp.save(state(mesh1d, 2), ckpt_dir)
    monkeypatch.undo()
    assert_all_ranks(fmt.read_index(ckpt_dir) == index_before, "the index changed")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 1), "previous checkpoint does not load")
    dcp.save(state(mesh1d, 3), ckpt_dir)  # the next save cleans up the leftover data file
    files = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(files == sorted([fmt.INDEX, fmt.read_index(ckpt_dir)["data_file"]]), f"{files}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 3))


KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch
    import mpidtensor.checkpoint as dcp
    from mpidtensor.checkpoint import io
    path, first, second = sys.argv[1], torch.load(sys.argv[2]), torch.load(sys.argv[3])
    dcp.save(first, path)
    io.MAX_CHUNK_BYTES = 256
    written = []
    def write_then_die(fh, buf):
        fh.Write_all(buf)
        written.append(buf[1])
        if len(written) == 3:
            os._exit(17)  # killed mid-write: no cleanup, no exception handling
    io.write_piece = write_then_die
    dcp.save(second, path)
    sys.exit("the save was not interrupted")
""")


def test_killed_save_keeps_previous_checkpoint(mesh1d, ckpt_dir):
    result = None
    if WORLD.rank == 0:
        base = os.path.dirname(ckpt_dir)
        for seed in (1, 2):
            full = {"w": global_tensor((64, 8), seed=seed), "b": global_tensor((5,), seed=seed + 1), "step": seed}
            torch.save(full, os.path.join(base, f"state{seed}.pt"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_"))}
        proc = subprocess.run(
            [sys.executable, "-c", KILLED_SAVE, ckpt_dir, *(os.path.join(base, f"state{s}.pt") for s in (1, 2))],
            env=env, capture_output=True, text=True, timeout=120,
        )
        leftovers = [n for n in os.listdir(ckpt_dir) if n.startswith("data-")]
        result = (proc.returncode, proc.stderr[-2000:], len(leftovers))
    returncode, stderr, leftovers = WORLD.bcast(result)
    assert_all_ranks(returncode == 17, f"the saving process ended with {returncode}: {stderr}")
    assert_all_ranks(leftovers == 2, f"expected the old and the partial data file, found {leftovers}")
    assert_all_ranks(loads_as(mesh1d, ckpt_dir, 1), "the previous checkpoint does not load after the kill")
