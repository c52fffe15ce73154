"""``python -m mpidtensor``: the environment report, in-process at any size and as a command."""
import io
import subprocess
import sys

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor import envreport, launcher
from mpidtensor.mesh import mpi_library

WORLD = MPI.COMM_WORLD


def test_report_has_every_rank_and_the_library(monkeypatch):
    monkeypatch.setenv("MPIDTENSOR_CUDA_AWARE", "0")
    out = io.StringIO()
    text = envreport.report(file=out)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "host"])
    rows = [line.split() for line in lines[header + 1: header + 1 + WORLD.size]]
    lib = mpi_library.describe()
    assert_all_ranks([row[0] for row in rows] == [str(r) for r in range(WORLD.size)], text)
    assert_all_ranks(f"ranks: {WORLD.size} on" in text and lib.vendor in text and lib.vendor_version in text, text)
    assert_all_ranks("MPIDTENSOR_CUDA_AWARE:   0" in text and "staged through host memory" in text, text)
    assert_all_ranks(out.getvalue() == (text + "\n" if WORLD.rank == 0 else ""), "printed on a rank other than 0")


def test_node_local_ranks_cover_each_node():
    text = envreport.report(file=None)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "host"])
    by_host = {}
    for line in lines[header + 1: header + 1 + WORLD.size]:
        _, host, local = line.split()[:3]
        index, size = map(int, local.split("/"))
        by_host.setdefault(host, []).append((index, size))
    ok = all(sorted(i for i, _ in v) == list(range(len(v))) and {s for _, s in v} == {len(v)}
             for v in by_host.values())
    assert_all_ranks(ok, text)


def test_report_names_a_mislaunch(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(WORLD.size + 3))
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPIDTENSOR_LAUNCH_CHECK"):
        monkeypatch.delenv(name, raising=False)
    text = envreport.report(file=None)
    assert_all_ranks(("LAUNCH PROBLEM" in text) == (WORLD.size == 1), text)


@pytest.mark.skipif(WORLD.size > 1, reason="runs `python -m mpidtensor` as a singleton: one rank only")
def test_python_dash_m_mpidtensor():
    done = subprocess.run([sys.executable, "-m", "mpidtensor"], capture_output=True, text=True,
                          env=launcher.nested_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "MPI library" in done.stdout and "ranks: 1 on 1 node(s)" in done.stdout, done.stdout
