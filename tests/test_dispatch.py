"""The dispatcher: plan cache, plain tensors as Replicate, in-place ops, fallback and strict mode."""
import warnings

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.dispatch import key
from mpidtensor.debug import CommDebugMode
from mpidtensor.runtime.settings import settings

WORLD = MPI.COMM_WORLD


def test_cache_hit_does_not_replan(mesh1d, monkeypatch):
    x = distribute_tensor(global_tensor((5, 3)), mesh1d, [Shard(0)])
    y = x * 2.0
    calls = []
    real = key.make_plan
    monkeypatch.setattr(key, "make_plan", lambda *a: calls.append(a[0]) or real(*a))
    for scale in (3.0, 4.0, 5.0):  # a changing float scalar must not re-plan a pointwise op
        y = x * scale
    assert_all_ranks(calls == [], f"re-planned {calls}")
    assert_close(y.full_tensor(), global_tensor((5, 3)) * 5.0)


def test_plain_tensors_are_replicate(mesh1d):
    full = global_tensor((5, 3))
    x = distribute_tensor(full, mesh1d, [Shard(0)])
    bias = global_tensor((3,), seed=2)
    with CommDebugMode() as comm:
        y = x + bias  # a plain tensor broadcast against a row-sharded DTensor: chunk-free, local
        z = x * torch.tensor(2.0)
    assert_all_ranks(comm.get_total_counts() == 0, str(comm.get_comm_counts()))
    assert_all_ranks(y.placements == (Shard(0),))
    assert_close(y.full_tensor(), full + bias)
    assert_close(z.full_tensor(), full * 2)
    same_shape = global_tensor((5, 3), seed=4)
    assert_close((x - same_shape).full_tensor(), full - same_shape)  # the plain tensor is chunked


def test_inplace_keeps_placements(mesh1d):
    full = global_tensor((5, 3))
    x = distribute_tensor(full.clone(), mesh1d, [Shard(0)])
    r = distribute_tensor(global_tensor((5, 3), seed=2), mesh1d, [Replicate()])
    out = x.add_(r)
    assert_all_ranks(out is x and x.placements == (Shard(0),))
    assert_close(x.full_tensor(), full + global_tensor((5, 3), seed=2))


def test_inplace_on_partial_reduces_first(mesh1d):
    """An in-place op that cannot keep a Partial (``exp_``, ``clamp_``) reduces self first
    and writes the value one process gives (torch refuses; its own decompositions, such as
    ``rms_norm``'s ``add_`` of eps to a Partial mean, need it here)."""
    x = DTensor.from_local(torch.ones(4), mesh1d, [Partial()])
    x.exp_()  # not linear: the partial values are summed first, and x changes placement
    assert_all_ranks(not x.placements[0].is_partial())
    assert_close(x.full_tensor(), torch.full((4,), float(WORLD.size)).exp())
    y = DTensor.from_local(torch.ones(4), mesh1d, [Partial()])
    y.clamp_(max=1.5)
    assert_all_ranks(not y.placements[0].is_partial())
    assert_close(y.full_tensor(), torch.full((4,), float(WORLD.size)).clamp(max=1.5))


def test_partial_algebra(mesh1d):
    n = WORLD.size
    a = DTensor.from_local(torch.ones(3), mesh1d, [Partial()])
    b = DTensor.from_local(torch.full((3,), 2.0), mesh1d, [Partial()])
    with CommDebugMode() as comm:
        linear = (a + b) * 3.0 - b
    assert_all_ranks(comm.get_total_counts() == 0 and linear.placements == (Partial(),))
    assert_close(linear.full_tensor(), torch.full((3,), 7.0 * n))
    assert_close((a * a).full_tensor(), torch.full((3,), float(n * n)))  # not linear: reduced first
    assert_close((a + 1.0).full_tensor(), torch.full((3,), n + 1.0))


def test_shape_errors_raise_everywhere(mesh1d):
    x = distribute_tensor(torch.ones(4, 3), mesh1d, [Shard(0)])
    with pytest.raises(RuntimeError):
        x + distribute_tensor(torch.ones(5, 3), mesh1d, [Shard(0)])
    assert_close((x + x).full_tensor(), torch.full((4, 3), 2.0))


def test_unknown_op_falls_back_with_one_warning(mesh1d, monkeypatch):
    monkeypatch.setattr(settings, "strict", False)
    full = global_tensor((6, 6), torch.float64)
    spd = full @ full.T + 6 * torch.eye(6, dtype=torch.float64)
    a = distribute_tensor(spd, mesh1d, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chol = torch.linalg.cholesky(a)
        torch.linalg.cholesky(a)
    named = [w for w in caught if "linalg_cholesky_ex" in str(w.message)]
    assert_all_ranks(len(named) == 1, [str(w.message) for w in caught])
    assert_all_ranks(chol.placements == (Replicate(),))
    assert_close(chol.full_tensor(), torch.linalg.cholesky(spd))


def test_strict_mode_raises(mesh1d, monkeypatch):
    monkeypatch.setattr(settings, "strict", True)
    a = distribute_tensor(global_tensor((5,)), mesh1d, [Shard(0)])
    with pytest.raises(NotImplementedError, match="nanmedian"):  # an op with no rule (histc has one now)
        torch.nanmedian(a)
    assert_close((a * 2).full_tensor(), global_tensor((5,)) * 2)


def test_inplace_foreach_op_writes_back_what_it_moved(mesh1d):
    """A ``_foreach_*_`` op that must move an element of the list it writes (a Partial
    tensor reduced before a nonlinear op) writes into the moved copy: the caller's tensor
    takes it (values and placements), the others stay in place."""
    n = WORLD.size
    p = DTensor.from_local(torch.ones(4), mesh1d, [Partial()])
    s = distribute_tensor(global_tensor((6,)), mesh1d, [Shard(0)])
    torch._foreach_exp_([p, s])
    torch._foreach_addcmul_([p, s], [p, s], [p, s], value=0.5)
    assert_all_ranks(not p.placements[0].is_partial() and s.placements == (Shard(0),), f"{p.placements} {s.placements}")
    whole, full = torch.full((4,), float(n)).exp(), global_tensor((6,)).exp()
    assert_close(p.full_tensor(), whole + 0.5 * whole * whole)
    assert_close(s.full_tensor(), full + 0.5 * full * full)


def test_inplace_view_changes_the_wrapper(mesh1d):
    full = global_tensor((1, 7))
    x = distribute_tensor(full.clone(), mesh1d, [Shard(1)])
    y = x.squeeze_(0)
    assert_all_ranks(y is x and x.shape == (7,) and x.placements == (Shard(0),), f"{x.shape} {x.placements}")
    assert_close(x.full_tensor(), full.squeeze(0))
    vec = distribute_tensor(global_tensor((7,), seed=2), mesh1d, [Shard(0)])
    mat = distribute_tensor(global_tensor((7, 4), seed=3), mesh1d, [Replicate()])
    assert_close(torch.matmul(vec, mat).full_tensor(), global_tensor((7,), seed=2) @ global_tensor((7, 4), seed=3))


def test_copy_into_plain_tensor(mesh1d):
    src = distribute_tensor(global_tensor((5, 3)), mesh1d, [Shard(0)])
    dst = torch.zeros(5, 3)
    out = dst.copy_(src)
    assert_all_ranks(out is dst)
    assert_close(dst, global_tensor((5, 3)))


def test_fallback_inplace_updates_the_dtensor(mesh1d, monkeypatch):
    monkeypatch.setattr(settings, "strict", False)
    full = global_tensor((5, 4), torch.float64)
    index, source = torch.tensor([0, 7, 19]), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = distribute_tensor(full.clone(), mesh1d, [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # fill_diagonal_ writes through an as_strided view; a view computed on a gathered copy
        # cannot carry the write back, so it is refused rather than silently lost
        if WORLD.size > 1:  # on one rank no view needs a copy: the write is in place
            with pytest.raises(RuntimeError, match="would not reach the original tensor"):
                x.fill_diagonal_(3.0)
        out = x.put_(index, source)  # no rule, no decomposition: x becomes replicated
        x.fill_diagonal_(3.0)  # on a replicated tensor the view is a true alias
    assert_all_ranks(out is x and x.placements == (Replicate(),), str(x.placements))
    assert_close(x.full_tensor(), full.clone().put_(index, source).fill_diagonal_(3.0))


def test_untagged_elementwise_ops(mesh1d, monkeypatch):
    monkeypatch.setattr(settings, "strict", True)
    full = global_tensor((5, 3), torch.complex64)
    z = distribute_tensor(full, mesh1d, [Shard(0)])
    assert_close(z.real.full_tensor(), full.real)
    assert_close(z.imag.full_tensor(), full.imag)
    x = distribute_tensor(full.real.contiguous(), mesh1d, [Shard(1)])
    assert_close(torch.where(x > 0, 1.0, x).full_tensor(), torch.where(full.real > 0, 1.0, full.real))
    assert_close(torch.where(x > 0, x, 0.0).full_tensor(), torch.where(full.real > 0, full.real, 0.0))


def test_write_through_a_redistributed_view(mesh1d):
    if WORLD.size == 1:
        pytest.skip("with one rank no view needs a redistribution")
    full = global_tensor((5, 6))
    h = distribute_tensor(full.clone(), mesh1d, [Shard(0)])
    v = h.view(-1)  # 5 rows over the ranks do not line up with chunks of 30: h itself is moved
    v[3:9].mul_(-1)
    expected = full.clone()
    expected.view(-1)[3:9].mul_(-1)
    assert_close(h.full_tensor(), expected)
    assert_all_ranks(h.placements != (Shard(0),), "the viewed tensor kept its placements")
    t = distribute_tensor(full.clone(), mesh1d, [Shard(0)]).t()  # a view: it cannot be moved alone
    with pytest.raises(RuntimeError, match="would not reach the original tensor"):
        t.diagonal().mul_(-1)
    ok = distribute_tensor(full.clone(), mesh1d, [Shard(0)])
    ok[:, 1:3].mul_(-1)  # a slice of unsharded columns is a true view: the write lands
    expected = full.clone()
    expected[:, 1:3].mul_(-1)
    assert_close(ok.full_tensor(), expected)


def test_single_element_strided_shards(mesh1d):
    full = global_tensor((7, 9))
    d = distribute_tensor(full, mesh1d, [Shard(0)])
    assert_close(d[:, 2].full_tensor(), full[:, 2])
    assert_close(d[:0, ::2].full_tensor(), full[:0, ::2])


def test_foreach_ops_over_dtensors_on_several_meshes(mesh2d):
    """FSDP x TP keeps parameters on the (dp, tp) mesh and on mesh["dp"]: a foreach op (and
    AdamW(foreach=True)) runs once per mesh on its positions, results in order."""
    from mpidtensor import distribute_tensor as dist

    fulls = [global_tensor((4, 6), seed=s) for s in range(4)]
    layouts = [(mesh2d, [Shard(0), Shard(1)]), (mesh2d["dp"], [Shard(0)]),
               (mesh2d, [Replicate(), Shard(0)]), (mesh2d["dp"], [Replicate()])]
    ds = [dist(f, m, p) for f, (m, p) in zip(fulls, layouts)]
    scaled = torch._foreach_mul(ds, [2.0, 3.0, 4.0, 5.0])
    norms = torch._foreach_norm(ds)
    torch._foreach_add_(ds, ds, alpha=0.5)
    for out, d, norm, full, c in zip(scaled, ds, norms, fulls, (2, 3, 4, 5)):
        assert_close(out.full_tensor(), full * c)
        assert_close(norm.full_tensor(), full.norm())
        assert_close(d.full_tensor(), full * 1.5)
    params = [torch.nn.Parameter(d) for d in ds]
    refs = [torch.nn.Parameter(f * 1.5) for f in fulls]
    for p, r in zip(params, refs):
        r.grad = torch.linspace(-1, 1, r.numel()).view_as(r)
        p.grad = dist(r.grad, p.device_mesh, p.placements)
    torch.optim.AdamW(params, lr=0.1, foreach=True).step()
    torch.optim.AdamW(refs, lr=0.1, foreach=True).step()
    for p, r in zip(params, refs):
        assert_close(p.full_tensor(), r.detach())
