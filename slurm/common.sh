# Sourced by the slurm/*.sbatch scripts after `cd "$SLURM_SUBMIT_DIR"`: modules, venv,
# threads, the launcher, and the environment report as the job's first step.
#   MODULES   modules to load (the ones mpi4py was built with)      default: none
#   VENV      the virtual environment                               default: .venv
#   LAUNCHER  srun | mpiexec      default: srun, or mpiexec where a trivial srun step with the
#             default plugin fails (a plugin listed by srun --mpi=list whose init fails)
#   SRUN_MPI  the srun --mpi plugin                                  default: the one the MPI
#             speaks, asked of the library mpi4py loads (README, sec. 2)
#   CPU_BIND  srun --cpu-bind=, applied where the cluster binds (task/affinity)
#   SRUN_ARGS / MPIEXEC_ARGS  extra launcher options (mapping, binding)
#   MPIEXEC   the mpiexec of the MPI mpi4py was built against        default: the venv's, else mpiexec
set -euo pipefail
if [ -n "${MODULES:-}" ]; then module load $MODULES; fi
PY=${VENV:-.venv}/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# The PMI plugin of the MPI library mpi4py loads, read without initialising MPI:
# Open MPI 5 speaks only PMIx, Cray MPICH cray_shasta, MPICH and its kin PMI-2 unless
# built with PMIx (the PyPI mpich wheel is not).
mpi_library() {
  "$PY" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.get_vendor()[0]); print(MPI.Get_library_version().rstrip("\0"))'
}

srun_mpi_plugin() {
  case "$(mpi_library)" in
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

MPIEXEC=${MPIEXEC:-$([ -x "${VENV:-.venv}/bin/mpiexec" ] && echo "${VENV:-.venv}/bin/mpiexec" || echo mpiexec)}

# Why `srun --mpi=$1` cannot start a step here (empty if it can): a plugin srun lists may still
# fail to load ("Plugin init() callback failed", e.g. a pmix plugin without its libpmix), so
# one trivial step (one task, `true`) tells.
srun_problem() {
  local out
  if ! srun --mpi=list 2>&1 | grep -qw -- "$1"; then
    echo "this Slurm has no '--mpi=$1' plugin (srun --mpi=list)"
  elif ! out=$(srun --mpi="$1" --ntasks=1 --nodes=1 true 2>&1); then
    echo "a trivial step under srun --mpi=$1 failed: $(echo "$out" | grep -m1 -i error || echo "$out" | head -n1)"
  fi
}

# Neither LAUNCHER nor SRUN_MPI given: srun with the library's plugin if a trivial step runs,
# else the MPI's own mpiexec inside the allocation, said in the job's output.
if [ -z "${LAUNCHER:-}" ] && [ -z "${SRUN_MPI:-}" ]; then
  SRUN_MPI=$(srun_mpi_plugin)
  LAUNCHER=srun
  problem=$(srun_problem "$SRUN_MPI")
  if [ -n "$problem" ]; then
    if ! mpiexec_out=$("$MPIEXEC" -n 1 true 2>&1); then
      echo "common.sh: no launcher can start the job's ranks here: $problem; and '$MPIEXEC -n 1 true' failed:" \
           "$(echo "$mpiexec_out" | head -n1)" >&2
      exit 3
    fi
    echo "common.sh: $problem; launching with $MPIEXEC inside the allocation instead (LAUNCHER=mpiexec)"
    LAUNCHER=mpiexec
  fi
fi

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
    UNBOUND=()  # Open MPI binds to cores by default, and refuses where the node has fewer than the
    # allocation's CPUs (a node declaring more): bind only where the cluster binds, as srun does
    if [ -z "${MPIEXEC_ARGS:-}" ] && ! cluster_binds_cpus && [[ "$(mpi_library)" == "Open MPI"* ]]; then
      UNBOUND=(--bind-to none)
    fi
    LAUNCH=("$MPIEXEC" -n "${SLURM_NTASKS:?run inside a Slurm allocation}" "${UNBOUND[@]}" ${MPIEXEC_ARGS:-})
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
