"""The collective steps of the checkpoint transaction (``mpidtensor.checkpoint.transaction``)
and the agreement helper it uses (``mpidtensor.runtime.agreement``): rank 0's result reaches
every rank; an error met by rank 0, or by any rank before a commit, is raised on every
rank with the same type and message, and the commit does not run; the superseded files
are removed by all ranks together."""
import os

from mpi4py import MPI

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.checkpoint import CheckpointError, transaction
from mpidtensor.runtime import agreement

WORLD = MPI.COMM_WORLD


def test_on_rank0_runs_once_and_shares_its_result():
    calls = []

    def look(x):
        calls.append(x)
        return {"rank": WORLD.rank, "x": x}

    result = agreement.on_rank0(WORLD, look, 7)
    assert_all_ranks(result == {"rank": 0, "x": 7}, f"{result}")
    assert_all_ranks(calls == ([7] if WORLD.rank == 0 else []), f"{calls}")


def test_on_rank0_error_is_raised_everywhere():
    def broken():
        raise FileNotFoundError("no checkpoint at 'x'")

    raises_everywhere(FileNotFoundError, lambda: agreement.on_rank0(WORLD, broken), "no checkpoint at 'x'")


def test_commit_sees_every_part_in_rank_order():
    committed = []

    def commit(parts):
        committed.append(parts)
        return sorted(parts, reverse=True)

    result = agreement.gather_to_rank0(WORLD, WORLD.rank * 10, None, commit)
    assert_all_ranks(result == [r * 10 for r in reversed(range(WORLD.size))], f"{result}")
    assert_all_ranks(len(committed) == (WORLD.rank == 0), f"{committed}")


def test_an_error_on_the_last_rank_stops_the_commit_everywhere():
    committed = []
    last = WORLD.size - 1
    part, error = agreement.attempt(lambda: 1 / (WORLD.rank - last))  # ZeroDivisionError on the last rank
    raises_everywhere(ZeroDivisionError, lambda: agreement.gather_to_rank0(WORLD, part, error, committed.append),
                      "division by zero")
    assert_all_ranks(committed == [], "the commit ran")


def test_problems_found_on_any_rank_are_named_everywhere():
    mine = [f"missing key 'k{WORLD.rank}'"] if WORLD.rank == WORLD.size - 1 else []
    raises_everywhere(CheckpointError,
                      lambda: agreement.raise_found(WORLD, ["shared problem"] + mine, CheckpointError),
                      f"shared problem; missing key 'k{WORLD.size - 1}'")


def test_remove_stale_removes_every_named_file(ckpt_dir):
    names = [f"old-{i}.bin" for i in range(2 * WORLD.size + 1)]
    if WORLD.rank == 0:
        os.makedirs(ckpt_dir)
        for name in names + ["kept.bin"]:
            open(os.path.join(ckpt_dir, name), "w").close()
    WORLD.Barrier()
    transaction.remove_stale(WORLD, ckpt_dir, names)
    left = sorted(os.listdir(ckpt_dir))
    assert_all_ranks(left == ["kept.bin"], f"{left}")
