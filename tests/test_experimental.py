"""mpidtensor.experimental: register_sharding on torch.library custom ops (the cheapest
strategy chosen, forward and backward equal to a single-process reference, 1-D and 2x2
meshes), the bad-input ValueError naming the op, local_map and implicit_replication."""
import pytest
import torch
from mpi4py import MPI

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.experimental import implicit_replication, local_map, register_sharding

WORLD = MPI.COMM_WORLD
TOL = dict(atol=1e-5, rtol=1e-5)


# --- custom ops ---------------------------------------------------------------------------------


@torch.library.custom_op("mpidtensor_test::rownorm", mutates_args=())
def rownorm(x: torch.Tensor) -> torch.Tensor:
    """Each row scaled to unit length: rows are independent, columns are not."""
    return x / x.norm(dim=1, keepdim=True)


@rownorm.register_fake
def _(x):
    return torch.empty_like(x)


def _rownorm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _rownorm_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    n = x.norm(dim=1, keepdim=True)
    return grad / n - x * (grad * x).sum(dim=1, keepdim=True) / n**3


rownorm.register_autograd(_rownorm_backward, setup_context=_rownorm_setup)


@register_sharding(torch.ops.mpidtensor_test.rownorm.default)
def rownorm_strategy(x):
    return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]


@torch.library.custom_op("mpidtensor_test::scale_cols", mutates_args=())
def scale_cols(x: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * x * w``: column j of ``x`` scaled by ``w[j]``."""
    return alpha * x * w


@scale_cols.register_fake
def _(x, w, alpha):
    return torch.empty_like(x)


def _scale_cols_setup(ctx, inputs, output):
    x, w, alpha = inputs
    ctx.save_for_backward(x, w)
    ctx.alpha = alpha


def _scale_cols_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return ctx.alpha * grad * w, ctx.alpha * (grad * x).sum(dim=0), None


scale_cols.register_autograd(_scale_cols_backward, setup_context=_scale_cols_setup)


@register_sharding(scale_cols)  # the CustomOpDef itself is accepted too
def scale_cols_strategy(x, w, alpha):
    return [
        ([Shard(0)], [Shard(0), Replicate(), None]),
        ([Shard(1)], [Shard(1), Shard(0), None]),
        ([Replicate()], [Replicate(), Replicate(), None]),
    ]


@torch.library.custom_op("mpidtensor_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@twice.register_fake
def _(x):
    return torch.empty_like(x)


# --- register_sharding --------------------------------------------------------------------------

# input placements -> the placement the cheapest strategy gives the output
ROWNORM_CHOICES = [
    ([Shard(0)], (Shard(0),)),  # no communication
    ([Shard(1)], (Shard(0),)),  # an all-to-all is cheaper than an all-gather
    ([Replicate()], (Replicate(),)),  # staying replicated moves nothing
    ([Partial()], (Shard(0),)),  # a reduce-scatter is cheaper than an all-reduce
]


@pytest.mark.parametrize("placements,chosen", ROWNORM_CHOICES, ids=str)
def test_register_sharding_cheapest_forward_backward(mesh1d, placements, chosen):
    full = global_tensor((7, 5))  # 7 rows: uneven at 2-4 ranks
    weight = global_tensor((7, 5), seed=9)
    x = distribute_tensor(full, mesh1d, placements).requires_grad_()
    ref = full.clone().requires_grad_()
    y = rownorm(x)
    assert_all_ranks(y.placements == chosen, f"chose {y.placements}, expected {chosen}")
    assert_close(y.full_tensor(), rownorm(ref), **TOL)
    (y.full_tensor() * weight).sum().backward()
    (rownorm(ref) * weight).sum().backward()
    assert_close(x.grad.full_tensor(), ref.grad, **TOL)


def test_register_sharding_no_communication_when_placements_fit(mesh1d):
    x = distribute_tensor(global_tensor((6, 4)), mesh1d, [Shard(0)])
    with CollectiveLog() as log:
        rownorm(x)
    assert_all_ranks(log.calls == [], f"collectives: {log.calls}")


SCALE_COLS_CHOICES = [
    ([Shard(1)], [Shard(0)], (Shard(1),)),  # fits the second strategy as is
    ([Shard(0)], [Replicate()], (Shard(0),)),  # fits the first as is
    ([Shard(0)], [Shard(0)], (Shard(0),)),  # gathering w (7 elements) beats an all-to-all of x (35)
    ([Shard(1)], [Replicate()], (Shard(1),)),  # chunking w locally beats an all-to-all of x
    ([Replicate()], [Replicate()], (Replicate(),)),
]


@pytest.mark.parametrize("px,pw,chosen", SCALE_COLS_CHOICES, ids=str)
def test_register_sharding_two_inputs_and_a_scalar(mesh1d, px, pw, chosen):
    xf, wf = global_tensor((5, 7), seed=1), global_tensor((7,), seed=2)
    weight = global_tensor((5, 7), seed=3)
    x = distribute_tensor(xf, mesh1d, px).requires_grad_()
    w = distribute_tensor(wf, mesh1d, pw).requires_grad_()
    xr, wr = xf.clone().requires_grad_(), wf.clone().requires_grad_()
    y = scale_cols(x, w, 0.5)
    if WORLD.size > 1:  # on one rank every strategy costs nothing and the first wins
        assert_all_ranks(y.placements == chosen, f"chose {y.placements}, expected {chosen}")
    assert_close(y.full_tensor(), scale_cols(xr, wr, 0.5), **TOL)
    (y.full_tensor() * weight).sum().backward()
    (scale_cols(xr, wr, 0.5) * weight).sum().backward()
    assert_close(x.grad.full_tensor(), xr.grad, **TOL)
    assert_close(w.grad.full_tensor(), wr.grad, **TOL)


def test_register_sharding_2d_mesh(mesh2d):
    full = global_tensor((6, 5))
    x = distribute_tensor(full, mesh2d, [Shard(0), Shard(1)]).requires_grad_()
    ref = full.clone().requires_grad_()
    y = rownorm(x)
    # per mesh dim: keep S(0) on dp; on tp an all-to-all to S(0) beats an all-gather to R
    assert_all_ranks(y.placements == (Shard(0), Shard(0)), f"chose {y.placements}")
    assert_close(y.full_tensor(), rownorm(ref), **TOL)
    y.full_tensor().sum().backward()
    rownorm(ref).sum().backward()
    assert_close(x.grad.full_tensor(), ref.grad, **TOL)


BAD_STRATEGIES = {
    "input placements": [([Shard(0)], [Shard(0), None])],  # one argument, two entries
    "output placements": [([Shard(0), Shard(0)], [Shard(0)])],  # one output, two entries
    "pair": [[Shard(0)]],  # not an (outputs, inputs) pair
    "needs a Placement": [([Shard(0)], [None])],  # the tensor argument without a placement
    "no shardings": [],
}


@pytest.mark.parametrize("what", sorted(BAD_STRATEGIES))
def test_register_sharding_bad_strategy_raises_value_error_naming_the_op(mesh1d, what):
    register_sharding(torch.ops.mpidtensor_test.twice.default)(lambda x: BAD_STRATEGIES[what])
    x = distribute_tensor(global_tensor((4, 3)), mesh1d, [Shard(0)])
    raises_everywhere(ValueError, lambda: twice(x), "mpidtensor_test.twice.default")
    raises_everywhere(ValueError, lambda: twice(x), what)


def test_register_sharding_reregistering_replaces_the_strategy(mesh1d):
    x = distribute_tensor(global_tensor((4, 3)), mesh1d, [Shard(0)])
    register_sharding(torch.ops.mpidtensor_test.twice.default)(lambda x: [([Replicate()], [Replicate()])])
    assert_all_ranks(twice(x).placements == (Replicate(),), "first strategy not used")
    register_sharding(torch.ops.mpidtensor_test.twice)(lambda x: [([Shard(0)], [Shard(0)])])  # the packet
    y = twice(x)
    assert_all_ranks(y.placements == (Shard(0),), "cached plan of the old strategy was used")
    assert_close(y.full_tensor(), 2 * global_tensor((4, 3)))


def test_register_sharding_rejects_a_non_op():
    with pytest.raises(TypeError, match="OpOverload"):
        register_sharding(lambda x: x)


# --- local_map ----------------------------------------------------------------------------------


def test_local_map_partial_product_and_gradients(mesh1d):
    """torch's example: W column-sharded, X row-sharded, the local mm is a partial sum."""
    wf, xf = global_tensor((6, 9), seed=1), global_tensor((9, 4), seed=2)
    w = distribute_tensor(wf, mesh1d, [Shard(1)]).requires_grad_()
    x = distribute_tensor(xf, mesh1d, [Shard(0)]).requires_grad_()
    local_mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]),
                         device_mesh=mesh1d)
    y = local_mm(w, x)
    assert_all_ranks(isinstance(y, DTensor) and y.placements == (Partial(),), f"got {type(y)}")
    wr, xr = wf.clone().requires_grad_(), xf.clone().requires_grad_()
    assert_close(y.full_tensor(), wr @ xr, **TOL)
    y.full_tensor().sum().backward()
    (wr @ xr).sum().backward()
    assert_close(w.grad.full_tensor(), wr.grad, **TOL)
    assert_close(x.grad.full_tensor(), xr.grad, **TOL)


def test_local_map_redistributes_inputs_only_when_asked(mesh1d):
    full = global_tensor((5, 3))
    x = distribute_tensor(full, mesh1d, [Replicate()])

    def scale(t, factor):
        return t * factor, t.shape[0]

    strict = local_map(scale, out_placements=([Shard(0)], None), in_placements=([Shard(0)], None))
    raises_everywhere(ValueError, lambda: strict(x, 3.0), "redistribute_inputs=True")
    loose = local_map(scale, out_placements=([Shard(0)], None), in_placements=([Shard(0)], None),
                      redistribute_inputs=True)
    y, rows = loose(x, 3.0)
    assert_close(y.full_tensor(), full * 3.0)
    expected_rows = distribute_tensor(full, mesh1d, [Shard(0)]).to_local().shape[0]
    assert_all_ranks(rows == expected_rows, f"local rows {rows}, expected {expected_rows}")


def test_local_map_decorator_grad_placements_and_plain_inputs(mesh1d):
    @local_map(out_placements=[Replicate()], in_placements=([Replicate()],), in_grad_placements=([Replicate()],))
    def double(t):
        return 2 * t

    full = global_tensor((4, 3))
    x = distribute_tensor(full, mesh1d, [Replicate()]).requires_grad_()
    y = double(x)
    assert_close(y.to_local(), 2 * full)
    y.sum().backward()
    assert_close(x.grad.full_tensor(), torch.full_like(full, 2.0))
    plain = double(full)  # no DTensor argument: the function runs on what it is given
    assert_all_ranks(type(plain) is torch.Tensor, f"got {type(plain)}")


def test_local_map_bad_input(mesh1d):
    x = distribute_tensor(global_tensor((4, 3)), mesh1d, [Shard(0)])
    ident = local_map(lambda t: t, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))
    raises_everywhere(ValueError, lambda: ident(x), "in_placements has 2 entries")
    two_out = local_map(lambda t: (t, t), out_placements=[Shard(0)])
    raises_everywhere(ValueError, lambda: two_out(x), "out_placements has 1 entries")
    none_in = local_map(lambda t: t, out_placements=[Shard(0)], in_placements=(None,))
    raises_everywhere(ValueError, lambda: none_in(x), "in_placements entry is None")
    dtensor_out = local_map(lambda t: x, out_placements=[Shard(0)])
    raises_everywhere(TypeError, lambda: dtensor_out(x), "must return local tensors")


# --- implicit_replication -----------------------------------------------------------------------


def test_implicit_replication(mesh1d):
    full, bias = global_tensor((5, 3)), global_tensor((3,), seed=5)
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    with implicit_replication():
        y = x + bias
    assert_all_ranks(y.placements == (Shard(0),), f"placements {y.placements}")
    assert_close(y.full_tensor(), full + bias)
