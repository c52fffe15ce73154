"""The batch scripts in ``slurm/`` under a real Slurm: submitted with ``sbatch`` as a user
would, with their defaults, and judged by the job's output and exit code.

Needs a running cluster (``slurm/local-cluster.sh start``: a single-node Slurm from
Debian's packages, which ``.ci/run`` starts where it can); skipped otherwise. Runs at
one rank: the jobs start their own ranks through ``srun``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpidtensor.tools import launcher

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = 900  # seconds: a demo of 4 ranks on 2 shared cores


def _cluster_problem() -> str | None:
    if MPI.COMM_WORLD.size != 1:
        return "the Slurm jobs start their own ranks: run at one rank"
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (start one: slurm/local-cluster.sh start)"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=_env(), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if done.returncode != 0 or not done.stdout.strip():
        return f"no Slurm cluster answers ({done.stderr.strip()[:200]}); start one: slurm/local-cluster.sh start"
    return None


def _env(**extra: str) -> dict[str, str]:
    """The submitting shell's environment without this test job's own launcher variables
    (which sbatch would export into the job), with SLURM_CONF kept and the scripts' VENV
    set to this Python's (so the jobs use the MPI this test runs on)."""
    env = launcher.nested_env({"VENV": str(Path(sys.executable).parents[1]), **extra})
    conf = os.environ.get("SLURM_CONF") or ("/tmp/mpidtensor-slurm/slurm.conf"
                                             if Path("/tmp/mpidtensor-slurm/slurm.conf").exists() else None)
    if conf:
        env["SLURM_CONF"] = conf
    return env


pytestmark = pytest.mark.skipif(_cluster_problem() is not None, reason=str(_cluster_problem()))


def _submit(script: str, *options: str, **env: str) -> tuple[str, str]:
    """``sbatch [options] script`` from the repository root; waits for the job to end.
    Returns (its final state and exit code, its output)."""
    out_dir = ROOT / ".slurm-test"
    out_dir.mkdir(exist_ok=True)
    done = subprocess.run(["sbatch", "--parsable", f"--output={out_dir}/%x-%j.out", *options, script],
                          cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        info = subprocess.run(["scontrol", "show", "job", "-o", job], env=_env(), capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
        state = fields.get("JobState", "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=_env())
            state = f"TIMEOUT after {JOB_TIMEOUT} s"
            break
        time.sleep(2)
    outputs = sorted(out_dir.glob(f"*-{job}.out"))
    text = outputs[0].read_text() if outputs else "(no output file)"
    for path in outputs:
        path.unlink()
    return f"{state} {fields.get('ExitCode', '')}", text


NO_LAUNCHER = "common.sh: no launcher can start the job's ranks here"


def _skip_without_a_launcher(status: str, out: str) -> None:
    """Skip, naming why, where the job found that neither srun (with its default plugin)
    nor the MPI's mpiexec can start a step in this allocation (``slurm/common.sh``)."""
    line = next((line for line in out.splitlines() if line.startswith(NO_LAUNCHER)), None)
    if not status.startswith("COMPLETED") and line is not None:
        pytest.skip(line)


def test_cpu_script_runs_the_tour_with_its_defaults():
    """With its defaults: srun with the library's plugin, or, where a trivial step under it
    fails (a listed plugin whose init fails), mpiexec inside the allocation, said in the
    job's output."""
    status, out = _submit("slurm/cpu.sbatch")
    _skip_without_a_launcher(status, out)
    assert status == "COMPLETED 0:0", f"{status}\n{out}"
    assert "ranks: 4 on 1 node(s)" in out, out  # the environment report, the first step
    assert "all checks passed" in out, out


@pytest.mark.exhaustive
def test_cpu_script_runs_the_training_demo():
    status, out = _submit("slurm/cpu.sbatch", SCRIPT="examples/train_fsdp_tp.py", SCRIPT_ARGS="--steps 3 --no-memory")
    _skip_without_a_launcher(status, out)
    assert status == "COMPLETED 0:0", f"{status}\n{out}"
    assert "largest difference from one process" in out and "(ok --tol" in out, out


@pytest.mark.exhaustive
def test_test_script_runs_pytest_on_the_jobs_ranks():
    status, out = _submit("slurm/run_tests.sbatch", "--nodes=1", "--ntasks-per-node=2", TESTS="tests/test_mesh.py")
    _skip_without_a_launcher(status, out)
    assert status == "COMPLETED 0:0", f"{status}\n{out}"
    assert "ranks: 2 on 1 node(s)" in out and " passed" in out, out


def test_a_wrong_plugin_is_caught_before_the_program_runs():
    """Open MPI's plugin for an MPICH build: the ranks start as single-rank jobs or fail
    in MPI_Init; either way the job fails in its first step, the environment report."""
    status, out = _submit("slurm/cpu.sbatch", SRUN_MPI="none")
    assert not status.startswith("COMPLETED"), f"{status}\n{out}"
    assert "all checks passed" not in out, out


def _two_node_problem() -> str | None:
    """Why ``sbatch --test-only`` of a 2-node script cannot be judged here: the running
    cluster must be the one ``slurm/local-cluster.sh`` configures (a second node declared
    for scheduling), not some other single-node Slurm, e.g. a workstation's own."""
    if _cluster_problem() is not None:
        return _cluster_problem()
    config = subprocess.run(["scontrol", "show", "config"], env=_env(), capture_output=True, text=True, timeout=30)
    name = next((line.split("=", 1)[1].strip() for line in config.stdout.splitlines()
                 if line.split("=", 1)[0].strip() == "ClusterName"), "?")
    # sinfo hides powered-down cloud nodes (local-cluster.sh's second node): count the
    # nodes the partitions declare instead.
    parts = subprocess.run(["scontrol", "-o", "show", "partition"], env=_env(), capture_output=True, text=True,
                           timeout=30)
    count = max((int(field.split("=", 1)[1]) for field in parts.stdout.split()
                 if field.startswith("TotalNodes=")), default=0)
    if name != "mpidtensor-local":
        return f"the running Slurm is cluster {name!r}, not slurm/local-cluster.sh's 'mpidtensor-local'"
    if count < 2:
        return f"the running Slurm declares {count} node(s); the 2-node scripts need 2"
    return None


@pytest.mark.parametrize("script", ["slurm/multinode_2d.sbatch", "slurm/run_tests.sbatch", "slurm/train_4d.sbatch"])
def test_two_node_scripts_are_accepted(script):
    """Two-node scripts, validated against the cluster's configuration (its second node,
    declared but down, is never started): ``sbatch --test-only``. Skipped, naming why, on
    a Slurm that is not ``slurm/local-cluster.sh``'s (another cluster answers "Requested
    node configuration is not available")."""
    problem = _two_node_problem()
    if problem is not None:
        pytest.skip(problem)
    done = subprocess.run(["sbatch", "--test-only", script], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr


def test_gpu_script_parses():
    """No GPUs here: the GPU script is checked by the shell only."""
    done = subprocess.run(["bash", "-n", "slurm/gpu.sbatch"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
