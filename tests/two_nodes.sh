#!/usr/bin/env bash
# Two simulated nodes on one machine, for multi-node tests (tests/test_two_nodes.py). Root.
#   tests/two_nodes.sh up                  two network namespaces, mdt-node1 and mdt-node2,
#                                          joined by a veth pair (10.213.7.1 and .2, names in
#                                          /etc/hosts)
#   tests/two_nodes.sh run N ARGS...       mpiexec -n N ARGS with ranks 0..N/2-1 on mdt-node1
#                                          and the rest on mdt-node2, every process in its
#                                          node's network namespace and in a UTS namespace
#                                          whose hostname is the node's name ($MPIEXEC: MPICH's
#                                          Hydra or Open MPI's PRRTE; default the .venv's)
#   tests/two_nodes.sh down                remove both namespaces and the /etc/hosts lines
# The launcher starts its remote daemon (Hydra's proxy, PRRTE's prted) through this script
# itself (the `ssh` mode below) instead of ssh: `ip netns exec` into the node, a new UTS
# namespace, the hostname set. Between the nodes, MPI traffic goes over TCP on the veth
# pair (MPICH: UCX_TLS=tcp,self; Open MPI picks its tcp BTL by itself).
set -euo pipefail
NODES=(mdt-node1 mdt-node2)
ADDRS=(10.213.7.1 10.213.7.2)
TAG="# mpidtensor two_nodes.sh"
SELF=$(readlink -f "$0")

on_node() {  # on_node NODE COMMAND-STRING: run the string in NODE's namespaces
  local node=$1; shift
  exec ip netns exec "$node" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$node" "$*"
}

case "${1:-}" in
  up)
    "$SELF" down >/dev/null 2>&1 || true
    for i in 0 1; do ip netns add "${NODES[$i]}"; done
    ip link add mdt-veth1 type veth peer name mdt-veth2
    for i in 0 1; do
      dev=mdt-veth$((i + 1))
      ip link set "$dev" netns "${NODES[$i]}"
      ip -n "${NODES[$i]}" addr add "${ADDRS[$i]}/24" dev "$dev"
      ip -n "${NODES[$i]}" link set "$dev" up
      ip -n "${NODES[$i]}" link set lo up
      echo "${ADDRS[$i]} ${NODES[$i]} $TAG" >>/etc/hosts
    done
    ;;
  down)
    for node in "${NODES[@]}"; do ip netns del "$node" 2>/dev/null || true; done
    sed -i "/$TAG\$/d" /etc/hosts
    ;;
  run)
    n=$2; shift 2
    half=$((n / 2))
    # mpiexec itself runs on node 1 (Hydra: -localhost names it so the remote proxy can call back).
    export UCX_TLS=${UCX_TLS:-tcp,self}
    mpiexec=${MPIEXEC:-$(dirname "$SELF")/../.venv/bin/mpiexec}
    cmd=$(printf '%q ' "$mpiexec")
    if "$mpiexec" --version 2>&1 | grep -q "Open MPI"; then
      cmd+="--prtemca plm_ssh_agent $(printf '%q' "$SELF") --map-by slot "
      cmd+="--host ${NODES[0]}:$half,${NODES[1]}:$((n - half)) -n $n $(printf '%q ' "$@")"
    else
      cmd+="-launcher ssh -launcher-exec $(printf '%q' "$SELF") -localhost ${NODES[0]} "
      cmd+="-hosts ${NODES[0]}:$half,${NODES[1]}:$((n - half)) -n $n $(printf '%q ' "$@")"
    fi
    on_node "${NODES[0]}" "$cmd"
    ;;
  -x|*)
    # Called by Hydra or PRRTE as their ssh: [options] HOST COMMAND...
    while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
    [ $# -ge 2 ] || { echo "usage: $0 up | down | run N ARGS..." >&2; exit 2; }
    node=$1; shift
    on_node "$node" "$*"
    ;;
esac
