# Sourced by the slurm/*.sbatch scripts after `cd "$SLURM_SUBMIT_DIR"`: modules, venv,
# threads, the launcher, and the environment report as the job's first step.
#   MODULES   modules to load (the ones mpi4py was built with)      default: none
#   VENV      the virtual environment                               default: .venv
#   LAUNCHER  srun | mpiexec                                         default: srun
#   SRUN_MPI  the srun --mpi plugin                                  default: the one the MPI
#             speaks, asked of the library mpi4py loads (README, sec. 2)
#   CPU_BIND  srun --cpu-bind=, applied where the cluster binds (task/affinity)
#   SRUN_ARGS / MPIEXEC_ARGS  extra launcher options (mapping, binding)
#   MPIEXEC   the mpiexec of the MPI mpi4py was built against        default: mpiexec
set -euo pipefail
if [ -n "${MODULES:-}" ]; then module load $MODULES; fi
PY=${VENV:-.venv}/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# The PMI plugin of the MPI library mpi4py loads, read without initialising MPI:
# Open MPI 5 speaks only PMIx, Cray MPICH cray_shasta, MPICH and its kin PMI-2 unless
# built with PMIx (the PyPI mpich wheel is not).
srun_mpi_plugin() {
  local id
  id=$("$PY" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.get_vendor()[0]); print(MPI.Get_library_version().rstrip("\0"))')
  case "$id" in
    "Open MPI"*)                 echo pmix ;;
    *"CRAY MPICH"*|*"Cray MPICH"*) echo cray_shasta ;;
    *-pmix*|*PMIx*)              echo pmix ;;
    *)                           echo pmi2 ;;
  esac
}

# Whether srun can bind tasks to CPUs here (without task/affinity it warns and does not).
cluster_binds_cpus() {
  scontrol show config 2>/dev/null | grep -E '^TaskPlugin ' | grep -q affinity
}

case "${LAUNCHER:-srun}" in
  srun)
    SRUN_MPI=${SRUN_MPI:-$(srun_mpi_plugin)}
    if ! srun --mpi=list 2>&1 | grep -qw -- "$SRUN_MPI"; then
      echo "common.sh: this Slurm has no '--mpi=$SRUN_MPI' plugin (srun --mpi=list); set SRUN_MPI or LAUNCHER=mpiexec" >&2
      exit 2
    fi
    BIND=()
    if [ -n "${CPU_BIND:-}" ] && cluster_binds_cpus; then BIND=(--cpu-bind="$CPU_BIND"); fi
    LAUNCH=(srun --mpi="$SRUN_MPI" --kill-on-bad-exit=1 "${BIND[@]}" ${SRUN_ARGS:-})
    ;;
  mpiexec)
    LAUNCH=("${MPIEXEC:-mpiexec}" -n "${SLURM_NTASKS:?run inside a Slurm allocation}" ${MPIEXEC_ARGS:-})
    ;;
  *)
    echo "LAUNCHER must be srun or mpiexec, not '$LAUNCHER'" >&2
    exit 2
    ;;
esac
echo "launcher: ${LAUNCH[*]}"
# Every rank reports host, node-local rank and GPU; rank 0 prints the table. Exits 1
# (stopping the job) if the launcher made N single-rank MPI jobs instead of one N-rank job.
"${LAUNCH[@]}" "$PY" -m mpidtensor
