"""mpidtensor.runtime.mpi_library: finding libmpi and asking it about CUDA; the override."""
import ctypes.util

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor.comm import buffers
from mpidtensor.runtime import mpi_library
from mpidtensor.runtime.settings import Settings, settings


def test_finds_the_loaded_libmpi():
    path = mpi_library.library_path()
    handle = ctypes.CDLL(path) if path else None
    assert_all_ranks(path is not None and "libmpi" in path, f"libmpi not found: {path}")
    assert_all_ranks(hasattr(handle, "MPI_Get_library_version"), f"{path} is not an MPI library")


def test_describe_matches_mpi4py():
    info = mpi_library.describe()
    vendor, _ = MPI.get_vendor()
    ok = (info.vendor == vendor and info.standard == "{}.{}".format(*MPI.Get_version())
          and info.version_text and info.version_text in " ".join(MPI.Get_library_version().split()))
    assert_all_ranks(bool(ok), str(info))
    assert_all_ranks(info.cuda_support in (True, False, None), str(info))


def test_query_answers_where_the_symbol_exists():
    """MPICH and Open MPI builds with the extension export MPIX_Query_cuda_support."""
    handle = ctypes.CDLL(mpi_library.library_path())
    answer = mpi_library.query_cuda_support()
    if hasattr(handle, "MPIX_Query_cuda_support"):
        assert_all_ranks(isinstance(answer, bool), f"answer {answer!r}")
    else:
        assert_all_ranks(answer is None, f"answer {answer!r} with no symbol")


def test_symbol_absent_gives_none_and_not_aware(monkeypatch):
    libc = ctypes.util.find_library("c")
    assert_all_ranks(mpi_library.query_cuda_support(libc) is None, "libc claims an answer")
    monkeypatch.setattr(settings, "cuda_aware", None)
    monkeypatch.setattr(mpi_library, "library_path", lambda: libc)
    monkeypatch.setattr(buffers, "query_cuda_support", mpi_library.query_cuda_support)
    buffers._mpi_cuda_support.cache_clear()
    try:
        assert_all_ranks(buffers.cuda_aware() is False, "no symbol must mean staging through the host")
    finally:
        buffers._mpi_cuda_support.cache_clear()


def test_library_not_found_gives_none(monkeypatch):
    monkeypatch.setattr(mpi_library, "_candidates", lambda: [])
    mpi_library.library_path.cache_clear()
    try:
        found = mpi_library.library_path()
    finally:
        mpi_library.library_path.cache_clear()
    assert_all_ranks(found is None, f"found {found}")


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False)])
def test_env_override_wins(value, expected):
    with settings.override(cuda_aware=Settings.from_environ({"MPIDTENSOR_CUDA_AWARE": value}).cuda_aware):
        assert_all_ranks(buffers.cuda_aware() is expected)


def test_unset_override_asks_the_library():
    with settings.override(cuda_aware=None):
        assert_all_ranks(buffers.cuda_aware() is bool(mpi_library.query_cuda_support()))


def test_mpi4py_build():
    build = mpi_library.mpi4py_build()
    import mpi4py

    assert_all_ranks(build["version"] == mpi4py.__version__ and build["abi"] and build["config"], str(build))
