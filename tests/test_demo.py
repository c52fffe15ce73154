"""The FSDP x TP training demo (examples/train_fsdp_tp.py) run in-process for a few steps:
its losses and parameters must match the single-process run within its tolerance."""
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import assert_all_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_fsdp_tp as demo  # noqa: E402

WORLD = MPI.COMM_WORLD
SMALL = ["--steps", "2", "--seq", "8", "--dim", "32", "--heads", "4", "--kv-heads", "2",
         "--hidden", "64", "--vocab", "64", "--layers", "1"]


def _quiet(*args) -> None:
    pass


@pytest.mark.parametrize("mode", [[], ["--no-tp"]], ids=["fsdp_x_tp", "fsdp_1d"])
def test_demo_matches_single_process(mode):
    if mode and WORLD.size != 4:
        pytest.skip("--no-tp differs from the default only at 4 ranks")
    result = demo.run(demo.parse_args(SMALL + mode + ["--no-memory"]), say=_quiet)
    assert_all_ranks(len(result.losses) == 2 and len(result.step_s) == 2, f"{result}")
    assert_all_ranks(result.ok, f"max difference {result.max_diff} above {result.tol}")
    assert_all_ranks(result.losses[1] < result.losses[0], f"loss did not fall: {result.losses}")


def test_demo_main_prints_memory_and_fails_above_tolerance(capsys):
    assert_all_ranks(demo.main(SMALL + ["--steps", "1"]) == 0)
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert_all_ranks("without FSDP" in out and "peak alloc MiB" in out, out)
    else:
        assert_all_ranks(True)
    assert_all_ranks(demo.main(SMALL + ["--steps", "1", "--no-memory", "--tol", "-1"]) == 1)


def test_demo_rejects_bad_sizes():
    if WORLD.size == 1:
        pytest.skip("any batch divides over one rank")
    with pytest.raises(ValueError, match="--batch must divide"):
        demo.run(demo.parse_args(SMALL + ["--batch", str(2 * WORLD.size + 1)]), say=_quiet)
