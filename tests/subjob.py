"""Run a separate small MPI job from inside the test job (for hangs and aborts that
would take the test job down with them).

Only rank 0 of the outer job launches ``mpiexec -n N python script`` with a clean
environment and the flags of the MPI library in use (``mpidtensor.tools.launcher``) and a
timeout; the others wait without spinning. Every rank gets
the same result, so the tests' verdicts stay collective.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

from helpers import bcast_after_rank0
from mpidtensor.tools import launcher

WORLD = MPI.COMM_WORLD


@dataclass
class Result:
    returncode: int | None  # None: killed by the timeout
    output: str  # stdout and stderr of all inner ranks
    seconds: float
    finished_at: float  # time.time() when the job ended

    def seconds_after(self, mark: str) -> float | None:
        """Seconds from the ``time.time()`` that the script printed as ``<mark>=<t>`` to the end."""
        for line in self.output.splitlines():
            if line.startswith(mark + "="):
                return self.finished_at - float(line.split("=", 1)[1])
        return None

    def abort_problems(self, needles: tuple[str, ...], went_on: str) -> list[str]:
        """What is wrong with a job that should have been aborted: it hung or succeeded, its
        output lacks one of ``needles``, or it shows ``went_on`` (a rank that carried on)."""
        problems = []
        if self.returncode in (None, 0):
            problems.append(f"job {'hung' if self.returncode is None else 'succeeded'}")
        problems += [f"output lacks {needle!r}" for needle in needles if needle not in self.output]
        if went_on in self.output:
            problems.append(f"output shows {went_on!r}: a rank went on")
        return problems


def run_job(script: str, tmp_dir: Path, *, ranks: int = 2, env: dict[str, str] | None = None,
            timeout: float = 20) -> Result:
    """Run ``script`` (Python source, dedented) on ``ranks`` fresh MPI ranks; collective.

    Importing torch alone can take many seconds on loaded shared cores: scripts print a
    time mark (see ``Result.seconds_after``) to time what matters, and ``timeout`` is generous.
    """
    result = _launch(script, tmp_dir, ranks, env or {}, timeout) if WORLD.rank == 0 else None
    return bcast_after_rank0(result)  # the others sleep: the inner job needs the cores


def run_command(argv: list[str], *, ranks: int | None, env: dict[str, str] | None = None, timeout: float = 600,
                cwd: Path | None = None) -> Result:
    """Run ``argv`` (a program written for torch.distributed, a driver...) on ``ranks`` fresh
    MPI ranks, or alone as one process when ``ranks`` is None; collective, like :func:`run_job`."""
    result = _start(argv, ranks, env or {}, timeout, cwd) if WORLD.rank == 0 else None
    return bcast_after_rank0(result)


def run_peer(argv: list[str], *, ranks: int | None, timeout: float = 600, cwd: Path | None = None) -> Result:
    """Run a peer's program (torch on gloo), as :func:`run_command` does, once more if it fails.

    torch's gloo now and then aborts in its teardown after the program's last step (SIGABRT,
    "terminate called without an active exception"; seen once in CI at 2 ranks). That says
    nothing about mpidtensor, so one failure is retried; a second one is reported with both
    outputs."""
    first = run_command(argv, ranks=ranks, timeout=timeout, cwd=cwd)
    if first.returncode == 0:
        return first
    second = run_command(argv, ranks=ranks, timeout=timeout, cwd=cwd)
    if second.returncode != 0:
        second.output = f"{first.output[-3000:]}\n--- the same, run again (exit {second.returncode}):\n{second.output}"
    return second


def _launch(script: str, tmp_dir: Path, ranks: int, extra: dict[str, str], timeout: float) -> Result:
    path = tmp_dir / "job.py"
    path.write_text(textwrap.dedent(script))
    return _start([sys.executable, str(path)], ranks, extra, timeout, None)


def _start(argv: list[str], ranks: int | None, extra: dict[str, str], timeout: float, cwd: Path | None) -> Result:
    start = time.monotonic()
    proc = subprocess.Popen(
        argv if ranks is None else launcher.command(ranks, argv), env=launcher.nested_env(extra), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return Result(proc.returncode, output, time.monotonic() - start, time.time())
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and the ranks
        output, _ = proc.communicate()
        return Result(None, output, time.monotonic() - start, time.time())
