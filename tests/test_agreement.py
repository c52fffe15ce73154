"""runtime.agreement: an error met on some ranks is raised on all of them."""
import threading

from mpi4py import MPI

from helpers import assert_all_ranks, raises_everywhere
from mpidtensor.runtime.agreement import attempt, exchange, outcomes, raise_agreed

WORLD = MPI.COMM_WORLD


class Unpicklable(Exception):
    """An error carrying a lock: pickling it fails."""

    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def _fail_on_last_rank(error: type) -> None:
    if WORLD.rank == WORLD.size - 1:
        raise error()


def test_error_of_one_rank_raised_on_all():
    _, error = attempt(_fail_on_last_rank, ZeroDivisionError)
    raises_everywhere(ZeroDivisionError, lambda: raise_agreed(WORLD, error))


def test_unpicklable_error_raised_on_all_as_its_text():
    """The failing rank cannot send the error itself; every rank raises its type and message."""
    _, error = attempt(_fail_on_last_rank, Unpicklable)
    raises_everywhere(RuntimeError, lambda: raise_agreed(WORLD, error), "Unpicklable: holds a lock")


def test_exchange_gives_every_value_in_rank_order():
    values = exchange(WORLD, {"rank": WORLD.rank})
    assert_all_ranks(values == [{"rank": r} for r in range(WORLD.size)], f"{values}")


def test_exchange_raises_the_first_error_on_every_rank():
    """The last rank's error travels with the others' values in the one collective."""
    value, error = attempt(_fail_on_last_rank, KeyError)
    raises_everywhere(KeyError, lambda: exchange(WORLD, value, error))


def test_outcomes_raise_nothing():
    _, error = attempt(_fail_on_last_rank, Unpicklable)
    table = outcomes(WORLD, WORLD.rank, error)
    kinds = [(v, type(e).__name__) for v, e in table]
    want = [(r, "NoneType") for r in range(WORLD.size - 1)] + [(WORLD.size - 1, "RuntimeError")]
    assert_all_ranks(kinds == want, f"{kinds}")

