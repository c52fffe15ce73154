"""One MPI job on two simulated nodes (``tests/two_nodes.sh``: two network namespaces joined
by a veth pair, each process with its node's hostname), so that what only a multi-node
job exercises is tested: node-local ranks and GPU binding, meshes whose outer dim
crosses nodes, TCP between the nodes, the per-host memory table.

Needs root, network namespaces and MPICH's Hydra or Open MPI's PRRTE (each starts its
remote daemon through the script instead of ssh); skipped otherwise. Runs at one rank: the jobs start their own.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

from mpidtensor.tools import launcher

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "two_nodes.sh"
ROOT = HERE.parent


def _problem() -> str | None:
    if MPI.COMM_WORLD.size != 1:
        return "the two-node jobs start their own ranks: run at one rank"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if launcher.mpi_family() == "other" or MPI.get_vendor()[0] not in ("MPICH", "Open MPI"):
        return "the simulated nodes are wired up for MPICH's Hydra and Open MPI's PRRTE only"
    probe = subprocess.run(["ip", "netns", "add", "mdt-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "mdt-probe"])
    return None


PROBLEM = _problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))


@pytest.fixture(scope="module")
def nodes():
    subprocess.run([str(SCRIPT), "up"], check=True)
    yield
    subprocess.run([str(SCRIPT), "down"], check=True)


def _run(args: list[str], timeout: float = 600) -> str:
    """``two_nodes.sh run 4 python ARGS``; the job's output, which must end with success."""
    env = launcher.nested_env({"MPIEXEC": launcher.mpiexec(), "OMP_NUM_THREADS": "1"})
    done = subprocess.run([str(SCRIPT), "run", "4", sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


@pytest.mark.exhaustive  # the quick tier starts one two-node job: the mesh test's
def test_environment_report_shows_two_nodes(nodes):
    out = _run(["-m", "mpidtensor"])
    assert "ranks: 4 on 2 node(s); per node: mdt-node1 2, mdt-node2 2" in out, out
    rows = [line.split()[:3] for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert rows == [["0", "mdt-node1", "0/2"], ["1", "mdt-node1", "1/2"],
                    ["2", "mdt-node2", "0/2"], ["3", "mdt-node2", "1/2"]], out


def test_mesh_across_nodes_and_gpu_binding(nodes, tmp_path):
    """A 2x2 mesh whose outer dim ("dp") crosses the nodes: the dp groups span both hosts,
    the tp groups stay on one; every redistribution equals the global tensor; each rank
    binds the GPU of its node-local index (torch.cuda faked: no GPUs here)."""
    job = tmp_path / "mesh_job.py"
    job.write_text(textwrap.dedent('''
        import socket
        from unittest import mock

        import torch
        from mpi4py import MPI

        from mpidtensor import Replicate, Shard, distribute_tensor, init_device_mesh
        from mpidtensor.mesh import cuda

        world = MPI.COMM_WORLD
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        hosts = lambda comm: sorted(set(comm.allgather(socket.gethostname())))
        dp_hosts, tp_hosts = hosts(mesh.get_group("dp")), hosts(mesh.get_group("tp"))
        assert dp_hosts == ["mdt-node1", "mdt-node2"], dp_hosts
        assert len(tp_hosts) == 1, tp_hosts
        full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        for target in ([Replicate(), Replicate()], [Shard(1), Replicate()], [Replicate(), Shard(0)], [Shard(1), Shard(0)]):
            y = x.redistribute(mesh, target)
            assert torch.equal(y.full_tensor(), full), target
        local = cuda.node_local_rank(world)
        assert local == world.rank % 2, (world.rank, local)
        chosen = []
        with mock.patch("torch.cuda.is_available", return_value=True), \\
             mock.patch("torch.cuda.device_count", return_value=2), \\
             mock.patch("torch.cuda.set_device", side_effect=chosen.append):
            device = cuda.bind_local_gpu(world)
        assert chosen == [local] and device == torch.device("cuda", local), (chosen, device)
        ok = world.allreduce(1)
        if world.rank == 0:
            print(f"two-node mesh ok on {ok} ranks")
    '''))
    out = _run([str(job)])
    assert "two-node mesh ok on 4 ranks" in out, out


@pytest.mark.exhaustive
def test_fsdp_tp_demo_with_dp_across_nodes(nodes):
    """The training demo (2x2 mesh: "dp" across the nodes, "tp" inside each) equals one
    process; its per-rank memory table names both hosts."""
    out = _run(["examples/train_fsdp_tp.py", "--steps", "3"])
    assert "(ok --tol" in out, out
    assert "mdt-node1" in out and "mdt-node2" in out, out
