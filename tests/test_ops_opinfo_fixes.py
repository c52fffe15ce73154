"""Regression tests for the causes the OpInfo sweep found (tests/test_opinfo.py): lazy
conjugation, broadcast operands of copy_, 0-d tensor arguments, decompositions that
decline, writes through views that needed a redistribution, in-place writes into views."""
from __future__ import annotations


import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import Replicate, Shard, distribute_tensor
from mpidtensor.runtime.settings import settings
from op_check import check_op


@pytest.fixture(autouse=True)
def _lenient(monkeypatch):
    """Ops with no rule (``put`` in take's backward...) run through the replicated fallback here."""
    monkeypatch.setattr(settings, "strict", False)


def _polar(r: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """torch.polar as a real tensor, so that check_op can differentiate a real loss."""
    return torch.view_as_real(torch.polar(r, theta))


def test_conj_is_not_lost_when_moved(mesh1d):
    x = global_tensor((5, 3), torch.complex64, 1)
    y = global_tensor((5, 3), torch.complex64, 2)
    xd = distribute_tensor(x, mesh1d, [Replicate()])
    yd = distribute_tensor(y, mesh1d, [Shard(0)])
    assert_close((xd.conj() * yd).full_tensor(), x.conj() * y)  # xd.conj() is chunked to meet yd
    assert_close(torch.view_as_real(xd.conj()).full_tensor(), torch.view_as_real(x.conj().resolve_conj()))
    a, b = global_tensor((5,), seed=3).abs() + 0.5, global_tensor((5,), seed=4)
    check_op(_polar, [a, b], [[Shard(0)], [Shard(0)]], mesh1d, atol=1e-4, rtol=1e-4)


def test_broadcast_operands_are_not_sharded_on_broadcast_dims(mesh1d):
    a, b = global_tensor((5, 1), seed=1), global_tensor((5,), seed=2)
    check_op(torch.complex, [a, b], [[Shard(0)], [Shard(0)]], mesh1d, grad=False)
    check_op(_polar, [a.abs(), b], [[Shard(0)], [Shard(0)]], mesh1d, atol=1e-4, rtol=1e-4)
    inp, mat, vec = global_tensor((1,), seed=3), global_tensor((5, 4), seed=4), global_tensor((4,), seed=5)
    check_op(torch.addmv, [inp, mat, vec], [[Shard(0)], [Shard(0)], [Shard(0)]], mesh1d, atol=1e-4, rtol=1e-4)


def test_zero_dim_tensor_arguments(mesh1d):
    s = torch.tensor(1.5)
    v = global_tensor((6,))
    check_op(lambda x, y: torch.complex(x, y), [v, s], [[Shard(0)], [Replicate()]], mesh1d, grad=False)
    check_op(lambda x: torch.index_select(x, 0, torch.tensor([0])), [s], [[Replicate()]], mesh1d)
    check_op(lambda x: torch.take(x, torch.tensor(4)), [v], [[Shard(0)]], mesh1d)
    boundaries = torch.tensor([-1.0, 0.0, 1.0])
    check_op(lambda x, b: torch.bucketize(x, b), [s, boundaries], [[Replicate()], [Shard(0)]], mesh1d, grad=False)
    check_op(lambda x: torch.cummax(x, 0)[0], [s], [[Replicate()]], mesh1d)
    d = distribute_tensor(v, mesh1d, [Shard(0)])
    assert_all_ranks(d[2].item() == v[2].item(), "item of a DTensor element")


def test_declined_decomposition_falls_back(mesh1d, monkeypatch):
    x = global_tensor((2, 3, 7, 5))
    d = distribute_tensor(x, mesh1d, [Shard(0)])
    monkeypatch.setattr(settings, "strict", True)
    with pytest.raises(NotImplementedError, match=r"adaptive_max_pool2d.*S\(0\)"):
        torch.nn.functional.adaptive_max_pool2d(d, (3, 2))
    monkeypatch.setattr(settings, "strict", False)
    check_op(lambda t: torch.nn.functional.adaptive_max_pool2d(t, (3, 2)), [x], [[Shard(0)]], mesh1d)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_write_through_a_diagonal(mesh1d, placement):
    full = global_tensor((6, 6))
    d = distribute_tensor(full.clone(), mesh1d, [placement])
    d.diagonal().fill_(1.0)
    d.diagonal(1).mul_(-2.0)
    expected = full.clone()
    expected.diagonal().fill_(1.0)
    expected.diagonal(1).mul_(-2.0)
    assert_close(d.full_tensor(), expected)


def test_linalg_through_diagonal_writes(mesh1d):
    a, tau = global_tensor((5, 3), seed=1), global_tensor((3,), seed=2)
    check_op(torch.linalg.householder_product, [a, tau], [[Shard(0)], [Shard(0)]], mesh1d, atol=1e-4, rtol=1e-4)


def test_inplace_write_into_a_view_reaches_its_base(mesh1d):
    full = global_tensor((7, 4))
    base = distribute_tensor(full.clone(), mesh1d, [Shard(0)])
    base[:, 1:3].index_fill_(0, torch.tensor([0, 5]), 7.0)  # no rule: runs on a replicated copy
    expected = full.clone()
    expected[:, 1:3].index_fill_(0, torch.tensor([0, 5]), 7.0)
    assert_close(base.full_tensor(), expected)


@pytest.mark.parametrize("shape", [(0, 3), (1, 3)])
def test_moments_with_nothing_or_one_element_to_reduce(mesh1d, shape):
    x = global_tensor(shape)
    d = distribute_tensor(x, mesh1d, [Shard(0)])
    for fn in (torch.var, torch.std, lambda t: torch.var_mean(t, 0)[0], lambda t: torch.std_mean(t, 0)[1]):
        assert_close(fn(d).full_tensor(), fn(x), equal_nan=True)


def test_hfftn_ortho_over_the_sharded_dim(mesh1d):
    x = global_tensor((5, 4, 3), torch.complex64)
    for placement in (Shard(0), Shard(2)):
        d = distribute_tensor(x, mesh1d, [placement])
        assert_close(torch.fft.hfftn(d, norm="ortho").full_tensor(), torch.fft.hfftn(x, norm="ortho"), atol=1e-4, rtol=1e-4)


def test_out_into_a_plain_tensor_gets_the_reduced_value(mesh1d):
    """``torch.mul(partial, x, out=plain)`` keeps the product Partial; the plain ``out`` must
    still end up holding the whole value (it held one rank's term before)."""
    a, b, w = global_tensor((1, 8), seed=1), global_tensor((8, 8), seed=2), global_tensor((1,), seed=3)
    p = torch.mm(distribute_tensor(a, mesh1d, [Shard(1)]), distribute_tensor(b, mesh1d, [Shard(0)]))
    out = torch.empty(1, 8)
    torch.mul(p, distribute_tensor(w, mesh1d, [Shard(0)]).unsqueeze(1), out=out)
    assert_close(out, (a @ b) * w.unsqueeze(1), atol=1e-5, rtol=1e-5)


def test_chunked_linear_cross_entropy_without_reduction(mesh1d):
    """OpInfo linear_cross_entropy.chunked_none, sample 31: its backward writes out= into plain buffers."""
    x, w, cw = global_tensor((8,), seed=1), global_tensor((8, 8), seed=2), global_tensor((8,), seed=3).abs()
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)

    def loss(inp, weight, class_weight):
        return torch.nn.functional.linear_cross_entropy(
            inp, weight, torch.tensor(5), weight=class_weight, reduction="none", options=options)

    check_op(loss, [x, w, cw], [[Shard(0)], [Shard(0)], [Shard(0)]], mesh1d, atol=1e-4, rtol=1e-4)
