"""The mis-launch check: N single-rank jobs where one N-rank job was meant."""
import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor.mesh import device_mesh, launch
from mpidtensor.runtime.settings import settings

WORLD = MPI.COMM_WORLD

LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                 "SLURM_PROCID")

# srun -n 4 with a PMI plugin the MPI library does not speak: the step says 4, MPI says 1.
SRUN_STEP = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_ID": "77"}


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and the once-per-process flag cleared (restored after)."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch, "_checked", False)
    return monkeypatch


def test_srun_step_of_single_rank_jobs_is_caught():
    message = launch.mislaunch_message(1, SRUN_STEP)
    assert_all_ranks(message is not None and "SLURM_STEP_NUM_TASKS=4" in message
                     and "SLURM_NTASKS=4" in message and "--mpi=" in message and launch.OPT_OUT in message,
                     str(message))


@pytest.mark.parametrize("env", [
    {},                                               # plain `python script.py` on a laptop
    {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "77"},      # the batch script or salloc shell: no step
    {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # srun -n 1
    {"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"},   # mpiexec -n 1 whose proxies srun started
    {"OMPI_COMM_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"},
])
def test_sound_single_rank_launches_pass(env):
    assert_all_ranks(launch.mislaunch_message(1, env) is None, str(env))


def test_the_opt_out_passes_a_mislaunch():
    with settings.override(launch_check=False):  # MPIDTENSOR_LAUNCH_CHECK=0
        assert_all_ranks(launch.mislaunch_message(1, SRUN_STEP) is None)
    assert_all_ranks(launch.mislaunch_message(1, SRUN_STEP) is not None)


@pytest.mark.parametrize("env", [
    {"PMI_SIZE": "3"},                # Hydra or srun --mpi=pmi2 started 3; mpi4py's MPI did not listen
    {"OMPI_COMM_WORLD_SIZE": "2"},    # Open MPI's mpirun driving an mpi4py built for another MPI
])
def test_other_launchers_single_rank_jobs_are_caught(env):
    assert_all_ranks(launch.mislaunch_message(1, env) is not None, str(env))


def test_a_real_multi_rank_world_passes():
    assert_all_ranks(launch.mislaunch_message(4, SRUN_STEP) is None)
    assert_all_ranks(launch.mislaunch_message(WORLD.size, {"PMI_SIZE": str(WORLD.size)}) is None)


def test_launched_size_reads_the_most_specific_variable():
    assert_all_ranks(launch.launched_size({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "8"}) == (2, "PMI_SIZE"))
    assert_all_ranks(launch.launched_size({"SLURM_STEP_NUM_TASKS": " 8 "}) == (8, "SLURM_STEP_NUM_TASKS"))
    assert_all_ranks(launch.launched_size({"PMI_SIZE": "", "SLURM_NTASKS": "4"}) is None)


def test_building_a_mesh_runs_the_check(clean_env):
    """The library itself stops: init_device_mesh raises in a mis-launched process."""
    for name, value in SRUN_STEP.items():
        clean_env.setenv(name, value)
    if WORLD.size == 1:
        with pytest.raises(RuntimeError, match="single-rank MPI job"):
            device_mesh.init_device_mesh("cpu", (1,))
        with pytest.raises(RuntimeError, match="single-rank MPI job"):
            device_mesh.DeviceMesh("cpu", [0])
    else:  # a real multi-rank world is never taken for a mis-launch
        mesh = device_mesh.init_device_mesh("cpu", (WORLD.size,))
        assert_all_ranks(mesh.size() == WORLD.size)
        mesh.free()


def test_check_runs_once_and_respects_the_opt_out(clean_env):
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "4")
    with settings.override(launch_check=False):
        launch.check_launch_once()
    launch.check_launch_once()  # already checked: not again
    assert_all_ranks(launch._checked)
