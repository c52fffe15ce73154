"""An uncaught exception on one rank ends the whole job with that rank's traceback."""
from __future__ import annotations

import sys
import textwrap

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks, bcast_after_rank0
from mpidtensor.runtime import abort
from mpidtensor.runtime.settings import settings
from subjob import run_command, run_job

WORLD = MPI.COMM_WORLD

RAISE_ON_RANK_1 = """
    import time
    import torch
    from mpi4py import MPI
    import mpidtensor
    from mpidtensor.comm import collectives

    comm = MPI.COMM_WORLD
    mpidtensor.init_device_mesh("cpu", (comm.size,))  # the first mesh installs the hook
    comm.Barrier()
    if comm.rank == 1:
        print(f"RAISED={time.time()}", flush=True)
        raise RuntimeError("boom on rank one")
    collectives.all_reduce(torch.ones(3), comm)  # rank 0 would wait here forever
    print("rank 0 finished", flush=True)
"""


@pytest.mark.quick_at(2)  # a separate 2-rank job: the same at every size
def test_uncaught_exception_aborts_the_job(tmp_path):
    result = run_job(RAISE_ON_RANK_1, tmp_path, timeout=120)
    problems = result.abort_problems(("RuntimeError: boom on rank one", "Traceback", "aborting the MPI job"),
                                     went_on="rank 0 finished")
    assert_all_ranks(not problems, f"{problems} after {result.seconds:.1f} s:\n{result.output[-2000:]}")
    after = result.seconds_after("RAISED")
    assert_all_ranks(after is not None and after < 5, f"ended {after} s after the exception")


UNCHANGED_PROGRAM = """
    import torch.distributed as dist
    dist.init_process_group("gloo")  # torch wraps sys.excepthook, capturing what it prints
    if dist.get_rank() == 1:
        raise RuntimeError("boom under the switch")
    dist.barrier()
    print("rank 0 finished", flush=True)
"""


@pytest.mark.quick_at(2)
def test_traceback_shows_under_the_switch(tmp_path):
    """Under ``python -m mpidtensor.run``, torch's ``init_process_group`` chains a hook that
    captures stderr and writes it after the hooks return: the traceback still shows."""
    script = tmp_path / "program.py"
    if WORLD.rank == 0:
        script.write_text(textwrap.dedent(UNCHANGED_PROGRAM))
    result = run_command([sys.executable, "-m", "mpidtensor.run", str(bcast_after_rank0(script))], ranks=2,
                         timeout=120)
    problems = result.abort_problems(("RuntimeError: boom under the switch", "Traceback", "aborting the MPI job"),
                                     went_on="rank 0 finished")
    assert_all_ranks(not problems, f"{problems} after {result.seconds:.1f} s:\n{result.output[-2000:]}")


def test_opt_out_and_single_rank(monkeypatch: pytest.MonkeyPatch):
    """``MPIDTENSOR_ABORT_ON_EXCEPTION=0`` and a world of one rank install nothing."""
    monkeypatch.setattr(abort, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    with settings.override(abort_on_exception=False):
        assert_all_ranks(abort.install() is False and sys.excepthook is sys.__excepthook__, "installed")
    installed = abort.install()
    expected = abort.MPI.COMM_WORLD.size > 1
    assert_all_ranks(installed is expected and (sys.excepthook is not sys.__excepthook__) is expected,
                     f"install() gave {installed} at world size {abort.MPI.COMM_WORLD.size}")


def test_hook_prints_through_the_previous_hook_then_aborts(monkeypatch: pytest.MonkeyPatch):
    if abort.MPI.COMM_WORLD.size == 1:
        pytest.skip("the hook is installed in jobs of more than one rank")
    calls = []
    monkeypatch.setattr(abort, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", lambda *exc: calls.append(("previous", exc[0])))
    monkeypatch.setattr(abort, "_abort", lambda: calls.append(("abort", None)))
    abort.install()
    try:
        raise KeyError("x")
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert_all_ranks(calls == [("previous", KeyError), ("abort", None)], str(calls))
