"""``python -m mpidtensor``: the environment report, in-process at any size and as a command."""
import io
import subprocess
import sys

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor.tools import envreport, launcher
from mpidtensor.runtime import mpi_library
from mpidtensor.runtime import effects
from mpidtensor.runtime.settings import ENVIRONMENT, settings

WORLD = MPI.COMM_WORLD


def test_report_has_every_rank_and_the_library():
    out = io.StringIO()
    with settings.override(cuda_aware=False):  # MPIDTENSOR_CUDA_AWARE=0
        text = envreport.report(file=out)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "host"])
    rows = [line.split() for line in lines[header + 1: header + 1 + WORLD.size]]
    lib = mpi_library.describe()
    assert_all_ranks([row[0] for row in rows] == [str(r) for r in range(WORLD.size)], text)
    assert_all_ranks(f"ranks: {WORLD.size} on" in text and lib.vendor in text and lib.vendor_version in text, text)
    assert_all_ranks("MPIDTENSOR_CUDA_AWARE:   0" in text and "staged through host memory" in text, text)
    assert_all_ranks(out.getvalue() == (text + "\n" if WORLD.rank == 0 else ""), "printed on a rank other than 0")


def test_report_lists_every_setting_and_effect():
    text = envreport.report(file=None)
    with settings.override(timeout=7.5):
        changed = envreport.report(file=None)
    rows = {line.split()[0]: line.split() for line in changed.splitlines() if line.startswith("  MPIDTENSOR_")}
    listed = all(f"  {env} " in text for env, *_ in ENVIRONMENT)
    effects_listed = all(f"  {name} " in text for name, *_ in effects.describe())
    assert_all_ranks(listed and effects_listed and rows["MPIDTENSOR_TIMEOUT"][1] == "7.5", changed)


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
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    text = envreport.report(file=None)
    assert_all_ranks(("LAUNCH PROBLEM" in text) == (WORLD.size == 1), text)


@pytest.mark.skipif(WORLD.size > 1, reason="runs `python -m mpidtensor` as a singleton: one rank only")
def test_python_dash_m_mpidtensor():
    done = subprocess.run([sys.executable, "-m", "mpidtensor"], capture_output=True, text=True,
                          env=launcher.nested_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "MPI library" in done.stdout and "ranks: 1 on 1 node(s)" in done.stdout, done.stdout


def test_contention_warning_only_for_separate_groups_on_too_few_cpus(tmp_path):
    from mpidtensor.runtime import scheduling

    two = frozenset({0, 1})
    four_sessions = [(two, 10), (two, 11), (two, 12), (two, 13)]
    one_session = [(two, 10)] * 4
    message = scheduling.contention_message("n1", four_sessions, True)
    assert message is not None and "4 ranks share 2 CPU(s) on n1" in message
    assert scheduling.contention_message("n1", four_sessions, False) is None  # autogroup off
    assert scheduling.contention_message("n1", four_sessions, None) is None  # not Linux
    assert scheduling.contention_message("n1", one_session, True) is None  # Open MPI: one session
    assert scheduling.contention_message("n1", four_sessions[:2], True) is None  # a CPU each
    bound = [(frozenset({i}), 10 + i) for i in range(4)]
    assert scheduling.contention_message("n1", bound, True) is None  # four CPUs in all
    flag = tmp_path / "autogroup"
    flag.write_text("1\n")
    assert scheduling.autogroup_enabled(str(flag)) is True
    flag.write_text("0\n")
    assert scheduling.autogroup_enabled(str(flag)) is False
    assert scheduling.autogroup_enabled(str(tmp_path / "missing")) is None


def test_report_warns_exactly_when_this_launch_contends():
    import os

    from mpidtensor.runtime import scheduling

    text = envreport.report(file=None)
    host = __import__("socket").gethostname()
    mine = (frozenset(os.sched_getaffinity(0)), os.getsid(0))
    ranks = WORLD.allgather(mine)
    hosts = WORLD.allgather(host)
    expected = scheduling.contention_message(
        host, [r for r, h in zip(ranks, hosts) if h == host], scheduling.autogroup_enabled())
    assert_all_ranks(("OVERSUBSCRIBED" in text) == (expected is not None) or len(set(hosts)) > 1, text)
