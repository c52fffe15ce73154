"""Test harness for runs under ``mpiexec``.

Two rules keep a failing test from hanging the job:

* Tests compare results collectively (``assert_all_ranks`` / ``assert_close``
  reduce the verdict over ``COMM_WORLD`` first), so every rank fails at the same
  point and none is left waiting in a collective.
* Anything else that fails on one rank aborts the whole job at once: the report
  is printed to stderr and ``MPI_Abort`` ends every rank within a second.

Only rank 0 prints pytest's terminal report.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile

import pytest
import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    import tier

    if tier.TIER not in tier.TIERS:  # the same on every rank: all stop here
        raise pytest.UsageError(f"MPIDTENSOR_TEST_TIER={tier.TIER!r}: use one of {', '.join(tier.TIERS)}")
    config.addinivalue_line("markers", "exhaustive: runs in the full tier only (make test-all)")
    config.addinivalue_line("markers", "every_case: the quick tier runs all its cases (it samples inside)")
    config.addinivalue_line("markers", "quick_at(n): the quick tier runs the test at world size n only (a costly "
                                       "test whose other sizes add little: e.g. its work is a separate job)")
    if WORLD.rank != 0:  # stderr stays: the abort hook reports there
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The quick tier skips the tests marked exhaustive, runs those marked ``quick_at(n)``
    at world size n only and a fixed sample of each heavily parametrized test
    (``tier.sample``): the same items on every rank."""
    import tier

    if not tier.QUICK:
        return
    skip = pytest.mark.skip(reason="exhaustive: runs under make test-all")
    for item in items:
        only_at = item.get_closest_marker("quick_at")
        if "exhaustive" in item.keywords:
            item.add_marker(skip)
        elif only_at is not None and WORLD.size != only_at.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"the quick tier runs it at {only_at.args[0]} rank(s)"))
    kept = tier.sample(items, WORLD.size)
    if len(kept) < len(items):
        ids = set(map(id, kept))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in ids])
        items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """What imports and collection made lives for the whole run (torch, transformers,
    op_db: about 400k objects): freeze it, so that a garbage collection, and the object
    scan behind ``mpidtensor.tools.memory``'s figures, look only at what the tests make."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a module's last test: what outlives it (imported models, caches) is frozen
    too, so each later ``gc.collect()`` looks at one module's objects only (it took
    0.25-0.6 s once a run had left 350k objects behind)."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and WORLD.size > 1:
        sys.stderr.write(
            f"\n[rank {WORLD.rank}] FAILED {item.nodeid} ({report.when}); aborting job\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()
        WORLD.Abort(1)


@pytest.fixture
def world() -> MPI.Intracomm:
    return WORLD


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with ``settings.strict`` (MPIDTENSOR_STRICT=1): an op without a
    sharding rule fails the test instead of quietly replicating. Tests of the fallback
    unset it themselves."""
    from mpidtensor.runtime.settings import settings

    monkeypatch.setattr(settings, "strict", True)


@pytest.fixture(scope="session")
def mesh1d():
    """A 1-D mesh over all ranks."""
    from mpidtensor import init_device_mesh

    return init_device_mesh("cpu", (WORLD.size,))


@pytest.fixture(scope="session")
def mesh2d():
    """A 2x2 mesh named ("dp", "tp"); the tests using it run at 4 ranks only."""
    if WORLD.size != 4:
        pytest.skip("2-D mesh tests run with 4 ranks")
    from mpidtensor import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@pytest.fixture
def mpi_group():
    """mpidtensor's MPI backend as torch's default group for one test, taken down after
    (unless the test took it down itself)."""
    import torch.distributed as dist
    from mpidtensor.backend.process_group import init_process_group

    if dist.is_initialized():
        pytest.fail(f"a torch.distributed group ({dist.get_backend()}) is already up: an earlier test left it")
    init_process_group()
    yield
    WORLD.Barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def ckpt_dir():
    """A fresh directory shared by all ranks."""
    path = tempfile.mkdtemp(prefix="mpidtensor-ckpt-") if WORLD.rank == 0 else None
    path = WORLD.bcast(path)
    yield os.path.join(path, "ckpt")
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
