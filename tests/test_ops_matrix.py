"""Matrix products (mm, bmm, mv, dot, vdot, addmm, addmv, addbmm, baddbmm, addr) and
what reaches them (linear, matmul, einsum), against plain torch.

Sizes are odd (m=5, k=7, n=9, batch 3) so that 2, 3 and 4 ranks give uneven and
empty shards. Direct aten calls run forward-only under ``MPIDTENSOR_STRICT=1``, so a
missing rule fails instead of falling back; backward passes and the composite ops
also go through view ops (``t``, ``transpose``, ``view``, ``permute``...) and the
reductions of bias gradients, which belong to other families, so they run without it.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_all_ranks, global_tensor
from helpers import CollectiveLog as _Traffic
from mpidtensor import Partial, Replicate, Shard, distribute_tensor
from mpidtensor.runtime.settings import settings
from op_check import check_op

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
PAVG = Partial("avg")
M, K, N, B = 5, 7, 9, 3

pytestmark = pytest.mark.filterwarnings("ignore:mpidtensor. no sharding rule")


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setattr(settings, "strict", True)


def _t(*shape, seed=0):
    return global_tensor(shape, seed=seed)


def _id(value) -> str:
    """Readable test ids: op names for functions, reprs for placements and shapes."""
    return getattr(value, "__name__", None) or str(value)


def _check_layout(fn, inputs, placements, mesh, expected):
    """Run ``fn`` on distributed inputs: output placements must be ``expected`` and no collective may run."""
    dist = [distribute_tensor(t, mesh, p) for t, p in zip(inputs, placements)]
    with _Traffic() as traffic:
        out = fn(*dist)
    assert_all_ranks(out.placements == tuple(expected), f"placements {out.placements}, expected {expected}")
    assert_all_ranks(not traffic.calls, f"collectives ran: {traffic.calls}")
    return out


# --- mm -----------------------------------------------------------------------------------------

MM_1D = [((a,), None if b is None else (b,)) for a in (S0, S1, R, P) for b in (S0, S1, R, P, None)]


@pytest.mark.parametrize("pa,pb", MM_1D, ids=_id)
def test_mm_forward(strict, mesh1d, pa, pb):
    check_op(torch.mm, [_t(M, K), _t(K, N, seed=1)], [pa, pb], mesh1d, grad=False)


# The classic strategies: S(0)@R, R@S(1), S(1)@S(0), R@R, P@R, R@P.
STRATEGIES = [((S0,), (R,), (S0,)), ((R,), (S1,), (S1,)), ((S1,), (S0,), (P,)),
              ((R,), (R,), (R,)), ((P,), (R,), (P,)), ((R,), (P,), (P,)), ((PAVG,), (R,), (PAVG,))]


@pytest.mark.parametrize("pa,pb,out", STRATEGIES, ids=_id)
def test_mm_strategy_moves_nothing(strict, mesh1d, pa, pb, out):
    a, b = _t(M, K), _t(K, N, seed=1)
    _check_layout(torch.mm, [a, b], [pa, pb], mesh1d, out)
    check_op(torch.mm, [a, b], [pa, pb], mesh1d, grad=False)


@pytest.mark.parametrize("pa,pb,out", STRATEGIES[:6], ids=_id)
def test_mm_backward(mesh1d, pa, pb, out):
    check_op(torch.mm, [_t(M, K), _t(K, N, seed=1)], [pa, pb], mesh1d)


# --- addmm --------------------------------------------------------------------------------------

ADDMM_CASES = [
    ((N,), (R,), (S0,), (R,)),
    ((N,), (R,), (R,), (S1,)),
    ((N,), (S0,), (R,), (S1,)),
    ((N,), (R,), (S1,), (S0,)),
    ((N,), (P,), (S1,), (S0,)),
    ((N,), (P,), (R,), (R,)),
    ((N,), (R,), (P,), (R,)),
    ((M, N), (S0,), (S0,), (R,)),
    ((M, N), (S1,), (S0,), (R,)),
    ((M, N), (R,), (S1,), (S0,)),
    ((1, N), (R,), (S0,), (R,)),
    ((M, 1), (S0,), (S0,), (R,)),
    ((M, 1), (R,), (R,), (S1,)),
]


@pytest.mark.parametrize("bias_shape,pbias,pa,pb", ADDMM_CASES, ids=_id)
def test_addmm_forward(strict, mesh1d, bias_shape, pbias, pa, pb):
    fn = lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0)  # noqa: E731
    check_op(fn, [_t(*bias_shape, seed=2), _t(M, K), _t(K, N, seed=1)], [pbias, pa, pb], mesh1d, grad=False)


@pytest.mark.parametrize("bias_shape,pbias,pa,pb", ADDMM_CASES[:5], ids=_id)
def test_addmm_backward(mesh1d, bias_shape, pbias, pa, pb):
    check_op(torch.addmm, [_t(*bias_shape, seed=2), _t(M, K), _t(K, N, seed=1)], [pbias, pa, pb], mesh1d)


def test_addmm_partial_output_adds_bias_once(strict, mesh1d):
    bias, a, b = _t(N, seed=2), _t(M, K), _t(K, N, seed=1)
    got = _check_layout(torch.addmm, [bias, a, b], [(R,), (S1,), (S0,)], mesh1d, (P,))
    assert_all_ranks(torch.allclose(got.full_tensor(), torch.addmm(bias, a, b), atol=1e-5), "bias added more than once")


def test_addmm_inplace_keeps_self_layout(strict, mesh1d):
    fn = lambda c, a, b: c.clone().addmm_(a, b)  # noqa: E731
    out = check_op(fn, [_t(M, N, seed=2), _t(M, K), _t(K, N, seed=1)], [(S0,), (S0,), (R,)], mesh1d, grad=False)
    assert_all_ranks(out[0].placements == (S0,), f"self became {out[0].placements}")
    check_op(fn, [_t(M, N, seed=2), _t(M, K), _t(K, N, seed=1)], [(R,), (S1,), (S0,)], mesh1d, grad=False)


# --- bmm / baddbmm ------------------------------------------------------------------------------

BMM_STRATEGIES = [((S0,), (S0,), (S0,)), ((S1,), (R,), (S1,)), ((R,), (S2,), (S2,)), ((S2,), (S1,), (P,)),
                  ((R,), (R,), (R,)), ((P,), (R,), (P,)), ((R,), (P,), (P,))]
BMM_OTHER = [((S0,), (R,)), ((S1,), (S2,)), ((S2,), (S0,)), ((R,), None), ((S1,), (S1,))]


@pytest.mark.parametrize("pa,pb,out", BMM_STRATEGIES, ids=_id)
def test_bmm_strategy_moves_nothing(strict, mesh1d, pa, pb, out):
    a, b = _t(B, M, K), _t(B, K, N, seed=1)
    _check_layout(torch.bmm, [a, b], [pa, pb], mesh1d, out)
    check_op(torch.bmm, [a, b], [pa, pb], mesh1d, grad=False)


@pytest.mark.parametrize("pa,pb", BMM_OTHER, ids=_id)
def test_bmm_forward(strict, mesh1d, pa, pb):
    check_op(torch.bmm, [_t(B, M, K), _t(B, K, N, seed=1)], [pa, pb], mesh1d, grad=False)


@pytest.mark.parametrize("pa,pb,out", BMM_STRATEGIES[:4], ids=_id)
def test_bmm_backward(mesh1d, pa, pb, out):
    check_op(torch.bmm, [_t(B, M, K), _t(B, K, N, seed=1)], [pa, pb], mesh1d)


BADDBMM_CASES = [
    ((B, M, N), (S0,), (S0,), (S0,)),
    ((B, M, N), (R,), (S2,), (S1,)),
    ((B, M, N), (S1,), (S1,), (R,)),
    ((M, N), (R,), (S0,), (S0,)),
    ((N,), (R,), (R,), (S2,)),
    ((1, M, 1), (R,), (S1,), (R,)),
    ((B, M, N), (P,), (R,), (P,)),
]


@pytest.mark.parametrize("bias_shape,pbias,pa,pb", BADDBMM_CASES, ids=_id)
def test_baddbmm_forward(strict, mesh1d, bias_shape, pbias, pa, pb):
    fn = lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0)  # noqa: E731
    check_op(fn, [_t(*bias_shape, seed=2), _t(B, M, K), _t(B, K, N, seed=1)], [pbias, pa, pb], mesh1d, grad=False)


@pytest.mark.parametrize("bias_shape,pbias,pa,pb", BADDBMM_CASES[:4], ids=_id)
def test_baddbmm_backward(mesh1d, bias_shape, pbias, pa, pb):
    check_op(torch.baddbmm, [_t(*bias_shape, seed=2), _t(B, M, K), _t(B, K, N, seed=1)], [pbias, pa, pb], mesh1d)


def test_baddbmm_inplace(strict, mesh1d):
    fn = lambda c, a, b: c.clone().baddbmm_(a, b)  # noqa: E731
    out = check_op(fn, [_t(B, M, N, seed=2), _t(B, M, K), _t(B, K, N, seed=1)], [(S0,), (S0,), (S0,)], mesh1d,
                   grad=False)
    assert_all_ranks(out[0].placements == (S0,), f"self became {out[0].placements}")


# --- vector products and the other add* forms ---------------------------------------------------

def _addmv(c, a, b):
    return torch.addmv(c, a, b, beta=0.5)


def _addbmm(c, a, b):
    return torch.addbmm(c, a, b, alpha=2.0)


def _addmv_(c, a, b):
    return c.clone().addmv_(a, b)


def _addr_(c, a, b):
    return c.clone().addr_(a, b)


def _addbmm_(c, a, b):
    return c.clone().addbmm_(a, b)


OTHER_OPS = [
    (torch.mv, [(M, K), (K,)], [[(S0,), (R,)], [(S1,), (S0,)], [(R,), (P,)], [(R,), (S0,)]]),
    (torch.dot, [(K,), (K,)], [[(S0,), (S0,)], [(R,), (S0,)], [(P,), (R,)], [(R,), (R,)]]),
    (torch.vdot, [(K,), (K,)], [[(S0,), (S0,)], [(R,), (P,)]]),
    (_addmv, [(M,), (M, K), (K,)],
     [[(S0,), (S0,), (R,)], [(R,), (S1,), (S0,)], [(R,), (R,), (P,)]]),
    (_addbmm, [(M, N), (B, M, K), (B, K, N)],
     [[(R,), (S0,), (S0,)], [(S0,), (S1,), (R,)], [(R,), (S2,), (S1,)], [(S1,), (R,), (S2,)]]),
    (torch.addr, [(M, N), (M,), (N,)], [[(S0,), (S0,), (R,)], [(S1,), (R,), (S0,)], [(R,), (P,), (R,)]]),
    (_addmv_, [(M,), (M, K), (K,)], [[(S0,), (S0,), (R,)], [(R,), (S1,), (S0,)]]),
    (_addr_, [(M, N), (M,), (N,)], [[(S1,), (R,), (S0,)]]),
    (_addbmm_, [(M, N), (B, M, K), (B, K, N)], [[(S0,), (S1,), (R,)]]),
]


@pytest.mark.parametrize("fn,shapes,placements", [(f, s, p) for f, s, ps in OTHER_OPS for p in ps], ids=_id)
def test_other_products_forward(strict, mesh1d, fn, shapes, placements):
    inputs = [_t(*s, seed=i) for i, s in enumerate(shapes)]
    check_op(fn, inputs, placements, mesh1d, grad=False)


def test_dot_contracted_gives_partial(strict, mesh1d):
    a, b = _t(3), _t(3, seed=1)  # empty shards at 4 ranks
    _check_layout(torch.dot, [a, b], [(S0,), (S0,)], mesh1d, (P,))
    check_op(torch.dot, [a, b], [(S0,), (S0,)], mesh1d, grad=False)


def test_vdot_complex_conjugates_left(strict, mesh1d):
    a, b = global_tensor((K,), torch.complex64), global_tensor((K,), torch.complex64, seed=1)
    _check_layout(torch.vdot, [a, b], [(S0,), (S0,)], mesh1d, (P,))
    check_op(torch.vdot, [a, b], [(S0,), (S0,)], mesh1d, grad=False)


@pytest.mark.parametrize("fn,shapes,placements", [
    (torch.mv, [(M, K), (K,)], [(S0,), (R,)]),
    (torch.dot, [(K,), (K,)], [(S0,), (S0,)]),
    (torch.addmv, [(M,), (M, K), (K,)], [(R,), (S1,), (S0,)]),
], ids=_id)
def test_vector_products_backward(mesh1d, fn, shapes, placements):
    check_op(fn, [_t(*s, seed=i) for i, s in enumerate(shapes)], placements, mesh1d)


# --- 2-D mesh -----------------------------------------------------------------------------------

MM_2D = [
    ((S0, S1), (R, S0), (S0, P)),
    ((S0, S0), (R, R), (S0, S0)),
    ((R, S1), (R, S0), (R, P)),
    ((S1, S1), (S0, S0), (P, P)),
    ((S0, R), (R, S1), (S0, S1)),
    ((P, S0), (R, R), (P, S0)),
    ((R, R), (S1, S1), (S1, S1)),
]


@pytest.mark.parametrize("pa,pb,out", MM_2D, ids=_id)
def test_mm_2d_strategy_moves_nothing(strict, mesh2d, pa, pb, out):
    a, b = _t(M, K), _t(K, N, seed=1)
    _check_layout(torch.mm, [a, b], [pa, pb], mesh2d, out)
    check_op(torch.mm, [a, b], [pa, pb], mesh2d, grad=False)


@pytest.mark.parametrize("pa,pb", [((S0, S1), (S1, S0)), ((S1, S0), (S0, S1)), ((P, S1), (S0, R)), ((R, S0), None)],
                         ids=_id)
def test_mm_2d_forward(strict, mesh2d, pa, pb):
    check_op(torch.mm, [_t(M, K), _t(K, N, seed=1)], [pa, pb], mesh2d, grad=False)


@pytest.mark.parametrize("pa,pb,out", [
    ((S0, S1), (S0, R), (S0, S1)),
    ((S0, S2), (S0, S1), (S0, P)),
    ((S2, S2), (S1, S1), (P, P)),
], ids=_id)
def test_bmm_2d_strategy_moves_nothing(strict, mesh2d, pa, pb, out):
    a, b = _t(B, M, K), _t(B, K, N, seed=1)
    _check_layout(torch.bmm, [a, b], [pa, pb], mesh2d, out)
    check_op(torch.bmm, [a, b], [pa, pb], mesh2d, grad=False)


@pytest.mark.parametrize("bias_shape,pbias,pa,pb", [
    ((N,), (R, R), (S0, S1), (R, S0)),
    ((M, N), (S0, S1), (S0, R), (R, S1)),
    ((N,), (R, S0), (S1, R), (S0, S1)),
    ((M, N), (P, R), (P, S0), (R, R)),
], ids=_id)
def test_addmm_2d_forward(strict, mesh2d, bias_shape, pbias, pa, pb):
    check_op(torch.addmm, [_t(*bias_shape, seed=2), _t(M, K), _t(K, N, seed=1)], [pbias, pa, pb], mesh2d, grad=False)


@pytest.mark.parametrize("fn,shapes,placements", [
    (torch.mm, [(M, K), (K, N)], [(S0, S1), (R, S0)]),
    (torch.mm, [(M, K), (K, N)], [(S1, S1), (S0, S0)]),
    (torch.addmm, [(N,), (M, K), (K, N)], [(R, S0), (S0, S1), (R, S0)]),
    (torch.bmm, [(B, M, K), (B, K, N)], [(S0, S2), (S0, S1)]),
], ids=_id)
def test_2d_backward(mesh2d, fn, shapes, placements):
    check_op(fn, [_t(*s, seed=i) for i, s in enumerate(shapes)], placements, mesh2d)


# --- composite ops: linear, matmul, einsum ------------------------------------------------------

LINEAR = [
    ((M, K), (S0,), (S0,), (S0,)),  # column-wise weight
    ((M, K), (S1,), (S1,), (R,)),  # row-wise weight: Partial before the bias
    ((B, M, K), (S0,), (R,), (R,)),
    ((B, M, K), (S2,), (S1,), None),
    ((B, M, K), (R,), (S0,), (S0,)),
]


@pytest.mark.parametrize("x_shape,px,pw,pbias", LINEAR, ids=_id)
def test_linear(mesh1d, x_shape, px, pw, pbias):
    x, w, bias = _t(*x_shape), _t(N, K, seed=1), _t(N, seed=2)
    check_op(torch.nn.functional.linear, [x, w, bias], [px, pw, pbias], mesh1d)
    check_op(torch.nn.functional.linear, [x, w], [px, pw], mesh1d)


@pytest.mark.parametrize("shapes,placements", [
    ([(M, K), (K, N)], [(S0,), (R,)]),
    ([(B, M, K), (K, N)], [(S1,), (R,)]),
    ([(B, M, K), (B, K, N)], [(S0,), (S0,)]),
    ([(2, B, M, K), (1, B, K, N)], [(S1,), (R,)]),
    ([(K,), (K, N)], [(S0,), (S0,)]),  # ends in the in-place view squeeze_
    ([(M, K), (K,)], [(S0,), (R,)]),
], ids=_id)
def test_matmul(mesh1d, shapes, placements):
    check_op(torch.matmul, [_t(*s, seed=i) for i, s in enumerate(shapes)], placements, mesh1d)


@pytest.mark.parametrize("equation,shapes,placements", [
    ("ij,jk->ik", [(M, K), (K, N)], [(S1,), (S0,)]),
    ("bij,bjk->bik", [(B, M, K), (B, K, N)], [(S0,), (S0,)]),
    ("bhqd,bhkd->bhqk", [(2, B, M, K), (2, B, N, K)], [(S1,), (S1,)]),
    ("bhqd,bhkd->bhqk", [(2, B, M, K), (2, B, N, K)], [(S0,), (R,)]),
], ids=_id)
def test_einsum_forward(mesh1d, equation, shapes, placements):
    fn = lambda a, b: torch.einsum(equation, a, b)  # noqa: E731
    check_op(fn, [_t(*s, seed=i) for i, s in enumerate(shapes)], placements, mesh1d, grad=False)


@pytest.mark.parametrize("equation,shapes,placements", [
    ("ij,jk->ik", [(M, K), (K, N)], [(S1,), (S0,)]),
    ("bij,bjk->bik", [(B, M, K), (B, K, N)], [(S0,), (S0,)]),
    ("bhqd,bhkd->bhqk", [(2, B, M, K), (2, B, N, K)], [(S1,), (S1,)]),
], ids=_id)
def test_einsum_backward(mesh1d, equation, shapes, placements):
    fn = lambda a, b: torch.einsum(equation, a, b)  # noqa: E731
    check_op(fn, [_t(*s, seed=i) for i, s in enumerate(shapes)], placements, mesh1d)
