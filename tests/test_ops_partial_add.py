"""A Partial(sum/avg) DTensor added to (or subtracted from) a replicated one stays Partial with
no collective, as torch's rule (the replica becomes a Partial term where it lies); values and
gradients equal one process."""
import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, distribute_tensor
from mpidtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("form", ["add", "radd", "sub", "rsub", "alpha"])
def test_partial_plus_replicate(mesh1d, reduce_op, form):
    a, b = global_tensor((5, 3)), global_tensor((5, 3), seed=9)
    term = a / WORLD.size if reduce_op == "sum" else a
    p = DTensor.from_local(term, mesh1d, [Partial(reduce_op)])
    r = distribute_tensor(b, mesh1d, [Replicate()])
    fn = {"add": lambda x, y: x + y, "radd": lambda x, y: y + x, "sub": lambda x, y: x - y,
          "rsub": lambda x, y: y - x, "alpha": lambda x, y: torch.add(y, x, alpha=-3)}[form]
    with CommDebugMode() as comm:
        out = fn(p, r)
    assert_all_ranks(out.placements == (Partial(reduce_op),) and comm.get_total_counts() == 0,
                     f"{out.placements} {comm.get_comm_counts()}")
    assert_close(out.full_tensor(), fn(a, b))


def test_partial_plus_replicate_gradient(mesh1d):
    a, b, w = global_tensor((4, 3)), global_tensor((4, 3), seed=2), global_tensor((4, 3), seed=5)
    p = DTensor.from_local(a / WORLD.size, mesh1d, [Partial()])
    r = distribute_tensor(b, mesh1d, [Replicate()]).requires_grad_()
    ((p + r) * distribute_tensor(w, mesh1d, [Replicate()])).sum().backward()
    assert_close(r.grad.full_tensor(), w)
