# Sourced by the slurm/*.sbatch scripts after `cd "$SLURM_SUBMIT_DIR"`: modules, venv,
# threads, the launcher, and the environment report as the job's first step.
#   MODULES   modules to load (the ones mpi4py was built with)      default: none
#   VENV      the virtual environment                               default: .venv
#   LAUNCHER  srun | mpiexec                                         default: srun
#   SRUN_MPI  the srun --mpi plugin the MPI speaks (README, sec. 2)  default: pmix
#   SRUN_ARGS / MPIEXEC_ARGS  extra launcher options (mapping, binding)
#   MPIEXEC   the mpiexec of the MPI mpi4py was built against        default: mpiexec
set -euo pipefail
if [ -n "${MODULES:-}" ]; then module load $MODULES; fi
PY=${VENV:-.venv}/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
case "${LAUNCHER:-srun}" in
  srun)    LAUNCH=(srun --mpi="${SRUN_MPI:-pmix}" --kill-on-bad-exit=1 ${SRUN_ARGS:-}) ;;
  mpiexec) LAUNCH=("${MPIEXEC:-mpiexec}" -n "${SLURM_NTASKS:?run inside a Slurm allocation}" ${MPIEXEC_ARGS:-}) ;;
  *)       echo "LAUNCHER must be srun or mpiexec, not '$LAUNCHER'" >&2; exit 2 ;;
esac
# Every rank reports host, node-local rank and GPU; rank 0 prints the table. Exits 1
# (stopping the job) if the launcher made N single-rank MPI jobs instead of one N-rank job.
"${LAUNCH[@]}" "$PY" -m mpidtensor
