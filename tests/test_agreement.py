"""mesh.agreement: an error met on some ranks is raised on all of them."""
import threading

from mpi4py import MPI

from helpers import raises_everywhere
from mpidtensor.runtime.agreement import attempt, raise_agreed

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
