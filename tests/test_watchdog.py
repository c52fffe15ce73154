"""MPIDTENSOR_TIMEOUT: a rank stuck in a collective reports where and ends the job."""
from __future__ import annotations

import pytest

from helpers import assert_all_ranks
from mpidtensor.runtime import watchdog
from mpidtensor.runtime.settings import Settings, settings
from subjob import run_job

HANG = """
    import time
    import torch
    from mpi4py import MPI
    from mpidtensor.comm import collectives

    comm = MPI.COMM_WORLD
    comm.Barrier()  # unwatched: waits for the slower rank's imports
    collectives.all_reduce(torch.ones(2), comm)  # the previous collective in the report
    if comm.rank == 1:
        time.sleep(120)  # never joins the all-gather below
    print(f"HANG={time.time()}", flush=True)
    collectives.all_gather(torch.ones(2, 3), comm, dim=0, sizes=[2, 2])
"""


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
def test_watchdog_aborts_a_hung_collective(tmp_path):
    result = run_job(HANG, tmp_path, env={"MPIDTENSOR_TIMEOUT": "1"}, timeout=100)
    problems = [] if result.returncode not in (None, 0) else ["the job was not aborted"]
    for needle in ("[mpidtensor watchdog] rank 0", "in all_gather on a communicator of 2 ranks (world ranks [0, 1])",
                   "counts=[6, 6]", "previous completed wait: all_reduce", "MPIDTENSOR_TIMEOUT=1", "job.py"):
        if needle not in result.output:
            problems.append(f"output lacks {needle!r}")
    assert_all_ranks(not problems, f"{problems} after {result.seconds:.1f} s:\n{result.output[-3000:]}")
    after = result.seconds_after("HANG")
    assert_all_ranks(after is not None and after < 6, f"ended {after} s after the hang began")


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
def test_no_false_alarm(tmp_path):
    """A job slower than the timeout between collectives, but never inside one, finishes."""
    script = """
        import time
        import torch
        from mpi4py import MPI
        from mpidtensor.comm import collectives

        comm = MPI.COMM_WORLD
        for _ in range(2):
            comm.Barrier()  # unwatched: the ranks enter the all-reduce together
            collectives.all_reduce(torch.ones(2), comm)
            time.sleep(1.5)
        print(f"done {comm.rank}", flush=True)  # one write: ranks share the output pipe
    """
    result = run_job(script, tmp_path, env={"MPIDTENSOR_TIMEOUT": "1"}, timeout=100)
    ok = result.returncode == 0 and "done 0" in result.output and "done 1" in result.output
    assert_all_ranks(ok, f"rc {result.returncode}:\n{result.output[-2000:]}")


def test_on_by_default_and_off_at_zero():
    """As torch's NCCL watchdog: on with 10 minutes unless the setting says otherwise."""
    default, off = Settings.from_environ({}).timeout, Settings.from_environ({"MPIDTENSOR_TIMEOUT": "0"}).timeout
    assert_all_ranks(default == 600.0 and off is None, f"default {default}, at 0: {off}")
    with settings.override(timeout=None):
        assert_all_ranks(not watchdog.ENABLED, "the watchdog stays on with the timeout off")
    with settings.override(timeout=600.0):
        assert_all_ranks(watchdog.ENABLED, "the watchdog is off with a timeout set")
