"""distribute_module's input_fn / output_fn in torch's two forms: (module, args, mesh), and the
deprecated (args, mesh) with torch's FutureWarning; any other arity is a ValueError on every rank.
The module's output equals one process."""
import warnings

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Replicate, Shard, distribute_module

WORLD = MPI.COMM_WORLD


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


@pytest.mark.parametrize("form", ["three", "two"])
def test_input_and_output_fn_forms(mesh1d, form):
    x = global_tensor((4 * WORLD.size, 5))
    want = _model()(x)
    if form == "three":
        def input_fn(mod, inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, [Replicate()])

        def output_fn(mod, outputs, mesh):
            return outputs.redistribute(mesh, [Shard(0)]).to_local()
    else:
        def input_fn(inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, [Replicate()])

        def output_fn(outputs, mesh):
            return outputs.redistribute(mesh, [Shard(0)]).to_local()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = distribute_module(_model(), mesh1d, input_fn=input_fn, output_fn=output_fn)
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning) and "Deprecating" in str(w.message)]
    assert_all_ranks(len(deprecated) == (2 if form == "two" else 0), str([str(w.message) for w in caught]))
    got = model(x)
    assert_all_ranks(type(got) is torch.Tensor, type(got).__name__)
    assert_close(got, want.chunk(WORLD.size)[WORLD.rank])


def test_other_arity_is_a_value_error(mesh1d):
    raises_everywhere(ValueError, lambda: distribute_module(_model(), mesh1d, input_fn=lambda inputs: inputs),
                      match="input_fn should take in 3 arguments, but got 1")
