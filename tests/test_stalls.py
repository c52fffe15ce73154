"""Nothing hangs: a rank that stops inside a training step (FSDP, HSDP, TP, GPipe, 1F1B,
ZB-V, ring attention, an ``async_save`` in flight, ``dist.all_reduce(async_op=True).wait()``
under the switch) makes the watchdog end the job within its timeout, its report naming
what the others wait for; a rank that dies (SIGKILL) there ends the job too.

Each case is a job of its own (tests/programs/stall.py at 2 ranks, HSDP at 4) with
``MPIDTENSOR_TIMEOUT=5``; the outer world size changes nothing, so they run at 1 rank.
The quick tier runs the FSDP stall (on MPICH and on Open MPI in CI); the full tier all.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import assert_all_ranks
from subjob import WORLD, run_command

PROGRAM = Path(__file__).resolve().parent / "programs" / "stall.py"
TIMEOUT = 5  # the watchdog's, in the jobs
ENDS_WITHIN = TIMEOUT + 40  # seconds from the stop to the job's end: generous on 2 shared cores

# path: (ranks, what a report must name: any of these)
PATHS = {
    "fsdp": (2, ("in iall_gather",)),
    "hsdp": (4, ("in iall_reduce", "in ireduce_scatter", "in reduce_scatter", "in iall_gather")),
    "tp": (2, ("in all_reduce",)),
    "gpipe": (2, ("point-to-point receive", "for pipeline action")),
    "1f1b": (2, ("point-to-point receive", "for pipeline action")),
    "zbv": (2, ("point-to-point receive", "for pipeline action")),
    "ring": (2, ("in ring shift (key/value",)),
    "async_save": (2, ("in async checkpoint write",)),
    "switch": (2, ("in all_reduce",)),
    "group_timeout": (2, ("new_group(timeout=2 s)",)),
    "wait_timeout": (2, ("[Rank 0]: Timed out waiting 2000ms for torch.distributed recv",)),
}
# paths whose stall raises torch's error on the waiting rank (the job then ends by the abort
# hook) rather than printing the watchdog's report
RAISES = {"wait_timeout"}
SWITCH = {"switch", "group_timeout", "wait_timeout"}  # run under python -m mpidtensor.run

pytestmark = [pytest.mark.skipif(WORLD.size != 1, reason="each case runs a job of its own")]


def _run(path: str, mode: str, tmp_path: Path):
    ranks, _ = PATHS[path]
    argv = [sys.executable, *(["-m", "mpidtensor.run"] if path in SWITCH else []), str(PROGRAM), path, mode,
            str(tmp_path)]
    return run_command(argv, ranks=ranks, env={"MPIDTENSOR_TIMEOUT": str(TIMEOUT)}, timeout=300, cwd=tmp_path)


def _check(path: str, mode: str, tmp_path: Path) -> None:
    result = _run(path, mode, tmp_path)
    problems = result.abort_problems(("STALL=",), went_on="went on")
    if mode == "sleep":
        marker = "Timed out waiting" if path in RAISES else "[mpidtensor watchdog]"
        reports = [line for line in result.output.splitlines() if marker in line]
        if not reports:
            problems.append(f"no line with {marker}")
        elif not any(needle in line for line in reports for needle in PATHS[path][1]):
            problems.append(f"no report names {PATHS[path][1]}")
    after = result.seconds_after("STALL")
    if after is not None and after > ENDS_WITHIN:
        problems.append(f"the job ended {after:.0f} s after the stop (limit {ENDS_WITHIN} s)")
    assert_all_ranks(not problems, f"{path} {mode}: {problems}, rc {result.returncode}, {result.seconds:.0f} s:\n"
                                   f"{result.output[-4000:]}")


@pytest.mark.quick_at(1)
def test_a_rank_stopping_inside_an_fsdp_step_ends_the_job(tmp_path):
    _check("fsdp", "sleep", tmp_path)


@pytest.mark.exhaustive
@pytest.mark.parametrize("path", [p for p in PATHS if p not in ("fsdp", "group_timeout", "wait_timeout")])
def test_a_rank_stopping_inside_a_step_ends_the_job(path, tmp_path):
    _check(path, "sleep", tmp_path)


@pytest.mark.exhaustive
def test_a_timeout_given_to_torch_ends_the_wait_in_seconds(tmp_path):
    """``new_group(timeout=2 s)`` and ``Work.wait(timeout=2 s)`` under the switch: the stall
    ends the job within a few seconds of the stop although the job's own timeout is 5 s or 300 s."""
    for path in ("group_timeout", "wait_timeout"):
        _check(path, "sleep", tmp_path)


@pytest.mark.exhaustive
@pytest.mark.parametrize("path", [p for p in PATHS if p not in ("group_timeout", "wait_timeout")])
def test_a_rank_dying_inside_a_step_ends_the_job(path, tmp_path):
    _check(path, "kill", tmp_path)
