#!/usr/bin/env bash
# A single-node Slurm on this machine, from Debian's packages, for testing the batch
# scripts against a real sbatch/srun (tests/test_slurm.py). Root, no systemd.
#   slurm/local-cluster.sh start [CPUS]   install (apt) if needed, write the config, start
#                                         munged, slurmctld and slurmd; wait until the node
#                                         is idle. CPUS (default 8) may exceed the cores.
#   slurm/local-cluster.sh stop           stop the daemons, remove the state and config
#   slurm/local-cluster.sh status         sinfo
# The node is this host's short hostname. A second node, "ghost", is declared as a
# powered-down cloud node that never starts (its resume program does nothing; the real
# node has the lower weight, so jobs go there): sbatch --test-only then accepts 2-node
# scripts, which is all that can be checked of them here.
# CLUSTER_NAME (default mpidtensor-local) and GHOST=0 (no second node) make it another,
# single-node cluster, as on a workstation: tests/test_slurm.py then skips the 2-node checks.
# The config lives in $SLURM_LOCAL (default /tmp/mpidtensor-slurm); the scripts export
# SLURM_CONF to point there, so nothing under /etc/slurm is touched.
set -euo pipefail
BASE=${SLURM_LOCAL:-/tmp/mpidtensor-slurm}
export SLURM_CONF=$BASE/slurm.conf
NODE=$(hostname -s)

need_packages() {
  # libpmix.so (libpmix-dev) is what Slurm's pmix plugin loads, for Open MPI's srun --mpi=pmix
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && ldconfig -p | grep -q 'libpmix\.so ' && return
  [ "$(id -u)" = 0 ] || { echo "local-cluster: installing Slurm needs root" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge libpmix-dev >/dev/null
}

write_config() {
  local cpus=$1
  mkdir -p "$BASE"/{ctld,slurmd,log,run}
  cat >"$SLURM_CONF" <<EOF
ClusterName=${CLUSTER_NAME:-mpidtensor-local}
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/slurmd
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=INFINITE
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$NODE CPUs=$cpus Weight=1 State=UNKNOWN
$( [ "${GHOST:-1}" = 1 ] && echo "NodeName=ghost NodeAddr=127.0.0.2 CPUs=$cpus Weight=100 State=CLOUD" )
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  pgrep -x munged >/dev/null && return
  [ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  if id munge >/dev/null 2>&1; then runuser -u munge -- munged; else munged --force; fi
}

wait_idle() {
  for _ in $(seq 60); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in idle*|mix*|alloc*) return 0 ;; esac
    sleep 1
  done
  echo "local-cluster: node $NODE is '${state:-unknown}' after 60 s; logs in $BASE/log" >&2
  return 1
}

case "${1:-}" in
  start)
    need_packages
    write_config "${2:-8}"
    start_munge
    pgrep -x slurmctld >/dev/null || slurmctld -i -f "$SLURM_CONF"
    pgrep -x slurmd >/dev/null || slurmd -f "$SLURM_CONF"
    wait_idle
    echo "local-cluster: up (export SLURM_CONF=$SLURM_CONF)"
    ;;
  stop)
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    for _ in $(seq 20); do pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break; sleep 0.5; done
    rm -rf "$BASE"
    ;;
  status)
    sinfo
    ;;
  *)
    echo "usage: $0 start [CPUS] | stop | status" >&2
    exit 2
    ;;
esac
