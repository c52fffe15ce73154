"""nn ops on DTensors against plain torch: softmax family, layer/rms norm, embedding,
cross_entropy/nll_loss, mse_loss, gelu/silu and attention, forward and gradients.

Odd sizes (5, 7, 9, 11) give uneven and empty shards at 2-4 ranks; losses must equal
plain torch on them. Tests run with ``MPIDTENSOR_STRICT=1``: a missing rule fails.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_all_ranks, assert_close, global_tensor
from helpers import CollectiveLog as Collectives
from op_check import check_op
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.dispatch import dispatch

aten = torch.ops.aten
R = Replicate()


def ids_tensor(shape, high: int, seed: int = 7) -> torch.Tensor:
    """Integer ids in [0, high), the same on every rank."""
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# --- softmax family ----------------------------------------------------------------------------

SOFTMAXES = {"softmax": F.softmax, "log_softmax": F.log_softmax}
P1 = [[Shard(0)], [Shard(1)], [R], [Partial()]]
P2 = [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [R, Shard(1)], [Shard(1), Partial()]]


@pytest.mark.parametrize("name", SOFTMAXES)
@pytest.mark.parametrize("dim", [0, -2])
@pytest.mark.parametrize("placements", P1)
def test_softmax_1d(mesh1d, name, dim, placements):
    x = global_tensor((5, 9, 3))
    check_op(lambda t: SOFTMAXES[name](t, dim), [x], [placements], mesh1d)


@pytest.mark.parametrize("name", SOFTMAXES)
@pytest.mark.parametrize("placements", P2)
def test_softmax_2d(mesh2d, name, placements):
    x = global_tensor((7, 9))
    check_op(lambda t: SOFTMAXES[name](t, 1), [x], [placements], mesh2d)


def test_softmax_sharded_dim_stays_sharded(mesh1d):
    """The split dim stays split: two all-reduces of row statistics, nothing gathered."""
    x = distribute_tensor(global_tensor((5, 11)), mesh1d, [Shard(1)])
    with Collectives() as seen:
        y = F.softmax(x, 1)
    assert_all_ranks(y.placements == (Shard(1),), f"placements {y.placements}")
    expected = ["all_reduce", "all_reduce"] if mesh1d.size() > 1 else []
    assert_all_ranks(seen.calls == expected, f"collectives {seen.calls}")


def test_safe_softmax_masked_rows(mesh1d):
    """_safe_softmax (attention with a mask) gives 0 on fully masked rows, split or not."""
    x = global_tensor((5, 9))
    x[2] = float("-inf")
    x[4, ::2] = float("-inf")
    for placements in ([Shard(1)], [Shard(0)], [R]):
        check_op(lambda t: aten._safe_softmax(t, 1), [x], [placements], mesh1d)


def test_softmax_bfloat16_split_dim(mesh1d):
    x = global_tensor((5, 11), torch.bfloat16)
    check_op(lambda t: F.softmax(t, 1), [x], [[Shard(1)]], mesh1d, atol=1e-2, rtol=1e-2)


# --- layer_norm, rms_norm ----------------------------------------------------------------------

LN1 = [([Shard(0)], [R]), ([Shard(1)], [R]), ([Shard(2)], [R]), ([R], [Shard(0)]), ([Partial()], [R])]
LN2 = [
    ([Shard(0), Shard(1)], [R, R]), ([Shard(0), Shard(2)], [R, R]), ([Shard(0), Shard(0)], [R, Shard(0)]),
    ([Partial(), Shard(0)], [R, R]), ([Shard(2), Shard(2)], [Shard(0), R]),
]


@pytest.mark.parametrize("normalized", [(9,), (3, 9)])
@pytest.mark.parametrize("px, pw", LN1)
def test_layer_norm_1d(mesh1d, normalized, px, pw):
    x = global_tensor((5, 3, 9))
    w = global_tensor(normalized, seed=2)
    b = global_tensor(normalized, seed=3)
    check_op(lambda t, w, b: F.layer_norm(t, normalized, w, b), [x, w, b], [px, pw, pw], mesh1d)


def test_layer_norm_no_affine(mesh1d):
    x = global_tensor((7, 9))
    for px in ([Shard(0)], [Shard(1)]):
        check_op(lambda t: F.layer_norm(t, (9,)), [x], [px], mesh1d)


@pytest.mark.parametrize("px, pw", LN2)
def test_layer_norm_2d(mesh2d, px, pw):
    x = global_tensor((5, 3, 9))
    check_op(lambda t, w, b: F.layer_norm(t, (9,), w, b), [x, global_tensor((9,), seed=2),
             global_tensor((9,), seed=3)], [px, pw, pw], mesh2d)


def test_layer_norm_batch_sharded_no_communication(mesh1d):
    """Batch-sharded forward and input gradient move nothing; weight/bias grads are Partial(sum)."""
    x = distribute_tensor(global_tensor((7, 9)).requires_grad_(), mesh1d, [Shard(0)])
    w = distribute_tensor(global_tensor((9,), seed=2).requires_grad_(), mesh1d, [R])
    b = distribute_tensor(global_tensor((9,), seed=3).requires_grad_(), mesh1d, [R])
    grad = distribute_tensor(global_tensor((7, 9), seed=4), mesh1d, [Shard(0)])
    with Collectives() as seen:
        y = F.layer_norm(x, (9,), w, b)
        y.backward(grad)
    assert_all_ranks(seen.calls == [], f"collectives {seen.calls}")
    assert_all_ranks(y.placements == (Shard(0),), f"output placements {y.placements}")
    assert_all_ranks(w.grad.placements == (Partial(),), f"weight grad placements {w.grad.placements}")
    assert_all_ranks(b.grad.placements == (Partial(),), f"bias grad placements {b.grad.placements}")


@pytest.mark.parametrize("px", [[Shard(0)], [Shard(2)], [R]])
def test_rms_norm(mesh1d, px):
    """On CPU rms_norm decomposes into pointwise ops and a mean (reductions family)."""
    x = global_tensor((5, 3, 9))
    check_op(lambda t, w: F.rms_norm(t, (9,), w, 1e-6), [x, global_tensor((9,), seed=2)], [px, [R]], mesh1d)


@pytest.mark.parametrize("px, pw", [([Shard(0)], [R]), ([Shard(1)], [R]), ([Shard(2)], [Shard(0)]), ([Partial()], [R])])
def test_fused_rms_norm(mesh1d, px, pw):
    """_fused_rms_norm is what rms_norm reaches on CUDA: its rules, called directly here."""
    x, w, g = global_tensor((5, 3, 9)), global_tensor((9,), seed=2), global_tensor((5, 3, 9), seed=3)
    out, rstd = aten._fused_rms_norm(x, [9], w, 1e-6)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad_x, grad_w = torch.autograd.grad(F.rms_norm(xr, (9,), wr, 1e-6), (xr, wr), g)
    dx, dw = distribute_tensor(x, mesh1d, px), distribute_tensor(w, mesh1d, pw)
    d_out, d_rstd = dispatch(aten._fused_rms_norm.default, (dx, [9], dw, 1e-6), {})
    dg = distribute_tensor(g, mesh1d, px)
    d_grad_x, d_grad_w = dispatch(aten._fused_rms_norm_backward.default, (dg, dx, [9], d_rstd, dw, [True, True]), {})
    for d, r in ((d_out, out), (d_rstd, rstd), (d_grad_x, grad_x), (d_grad_w, grad_w)):
        assert_close(d.full_tensor(), r, atol=1e-5, rtol=1e-5)


# --- gelu, silu (pointwise rules) --------------------------------------------------------------

ACTIVATIONS = {
    "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations(mesh1d, name):
    x = global_tensor((7, 5))
    for placements in ([Shard(0)], [Shard(1)], [R]):
        check_op(ACTIVATIONS[name], [x], [placements], mesh1d)


def test_activations_2d(mesh2d):
    x = global_tensor((7, 5))
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [R, Shard(1)]):
        for fn in ACTIVATIONS.values():
            check_op(fn, [x], [placements], mesh2d)


# --- embedding ---------------------------------------------------------------------------------

EMB1 = [([Shard(0)], [R]), ([Shard(1)], [R]), ([R], [Shard(0)]), ([R], [Shard(1)]), ([Shard(0)], [Shard(0)]),
        ([Shard(1)], [Shard(1)]), ([Partial()], [R])]
EMB2 = [([R, Shard(0)], [Shard(0), R]), ([Shard(0), Shard(1)], [R, R]), ([Shard(0), Shard(0)], [R, R]),
        ([Shard(1), R], [R, Shard(1)]), ([Shard(0), R], [R, Shard(0)])]


@pytest.mark.parametrize("pw, pi", EMB1)
@pytest.mark.parametrize("options", [{}, {"padding_idx": 3}, {"scale_grad_by_freq": True}])
def test_embedding_1d(mesh1d, pw, pi, options):
    w, ids = global_tensor((11, 6)), ids_tensor((5, 3), 11)
    check_op(lambda w, i: F.embedding(i, w, **options), [w, ids], [pw, pi], mesh1d)


@pytest.mark.parametrize("pw, pi", EMB2)
def test_embedding_2d(mesh2d, pw, pi):
    w, ids = global_tensor((11, 6)), ids_tensor((5, 3), 11)
    check_op(lambda w, i: F.embedding(i, w), [w, ids], [pw, pi], mesh2d)


def test_embedding_both_sharded_large_vocab(mesh1d):
    """Vocab-sharded weight and sharded ids: a large table stays put, the ids are gathered."""
    w, ids = global_tensor((41, 3)), ids_tensor((7,), 41)
    (out,) = check_op(lambda w, i: F.embedding(i, w), [w, ids], [[Shard(0)], [Shard(0)]], mesh1d)
    assert_all_ranks(out.placements == (Partial(),), f"placements {out.placements}")


@pytest.mark.parametrize("mesh_name, pw", [
    ("mesh1d", [Shard(0)]), ("mesh1d", [Shard(1)]), ("mesh1d", [R]), ("mesh1d", [Partial()]),
    ("mesh2d", [Shard(0), Shard(1)]), ("mesh2d", [Partial(), Shard(1)]), ("mesh2d", [Shard(1), Partial("max")]),
])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_embedding_max_norm(request, mesh_name, pw, norm_type):
    """max_norm renorms the used rows of the weight in place; its placements stay."""
    mesh = request.getfixturevalue(mesh_name)
    w, ids = global_tensor((11, 6)), ids_tensor((5, 3), 11)
    ref_w = w.clone()
    expected = F.embedding(ids, ref_w, max_norm=2.0, norm_type=norm_type)
    dist_w = distribute_tensor(w, mesh, pw)
    out = F.embedding(distribute_tensor(ids, mesh, [Shard(0)] + [R] * (mesh.ndim - 1)), dist_w, max_norm=2.0,
                      norm_type=norm_type)
    assert_close(out.full_tensor(), expected, atol=1e-5, rtol=1e-5)
    assert_close(dist_w.full_tensor(), ref_w, atol=1e-5, rtol=1e-5)
    assert_all_ranks(dist_w.placements == tuple(pw), f"weight placements {dist_w.placements}")


def test_embedding_vocab_parallel_no_communication(mesh1d):
    """Vocab-sharded weight, replicated ids: masked local lookups, output Partial(sum)."""
    w = distribute_tensor(global_tensor((11, 6)), mesh1d, [Shard(0)])
    ids = distribute_tensor(ids_tensor((5, 3), 11), mesh1d, [R])
    with Collectives() as seen:
        out = F.embedding(ids, w)
    assert_all_ranks(seen.calls == [], f"collectives {seen.calls}")
    assert_all_ranks(out.placements == (Partial(),), f"placements {out.placements}")
    assert_close(out.full_tensor(), F.embedding(ids_tensor((5, 3), 11), global_tensor((11, 6))))


# --- cross_entropy, nll_loss -------------------------------------------------------------------

REDUCTIONS = ["mean", "sum", "none"]
CE1 = [([Shard(0)], [Shard(0)]), ([Shard(0)], [R]), ([R], [Shard(0)]), ([Shard(1)], [R]), ([Shard(1)], [Shard(0)]),
       ([Partial()], [R]), ([R], [R])]
CE2 = [([Shard(0), Shard(1)], [Shard(0), R]), ([Shard(0), Shard(0)], [Shard(0), Shard(0)]),
       ([Shard(1), Shard(0)], [R, Shard(0)]), ([Partial(), Shard(0)], [R, Shard(0)])]


def _targets(shape, classes: int, ignore_index: int) -> torch.Tensor:
    """Class ids with ignore_index at several places, including a whole leading block
    (a rank whose shard is entirely ignored)."""
    t = ids_tensor(shape, classes)
    t.view(-1)[:3] = ignore_index
    t.view(-1)[5::4] = ignore_index
    return t


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("px, pt", CE1)
def test_cross_entropy_1d(mesh1d, reduction, px, pt):
    """Class weights and ignore_index (unweighted: the spatial and unbatched tests)."""
    x, t = global_tensor((7, 9)), _targets((7,), 9, ignore_index=2)
    weight = global_tensor((9,), seed=5).abs() + 0.1

    def fn(logits, target):
        return F.cross_entropy(logits, target, weight=weight, ignore_index=2, reduction=reduction)

    check_op(fn, [x, t], [px, pt], mesh1d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("px, pt", CE2)
def test_cross_entropy_2d(mesh2d, reduction, px, pt):
    x, t = global_tensor((7, 9)), _targets((7,), 9, ignore_index=4)
    weight = global_tensor((9,), seed=5).abs() + 0.1
    dist_weight = distribute_tensor(weight, mesh2d, [R, Shard(0)])

    def fn(logits, target):
        w = dist_weight if isinstance(logits, DTensor) else weight
        return F.cross_entropy(logits, target, weight=w, ignore_index=4, reduction=reduction)

    check_op(fn, [x, t], [px, pt], mesh2d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("px, pt", [([Shard(0)], [Shard(0)]), ([Shard(2)], [Shard(1)]), ([Shard(1)], [R]), ([R], [R])])
def test_cross_entropy_spatial(mesh1d, reduction, px, pt):
    """4-D logits reach nll_loss2d."""
    x, t = global_tensor((5, 7, 3, 2)), _targets((5, 3, 2), 7, ignore_index=1)
    check_op(lambda a, b: F.cross_entropy(a, b, ignore_index=1, reduction=reduction), [x, t], [px, pt], mesh1d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nll_loss_unbatched(mesh1d, reduction):
    """A single sample (1-D input, 0-d target): only the class dim can be sharded."""
    x = global_tensor((11,))
    for target in (torch.tensor(9), torch.tensor(2)):
        for px in ([Shard(0)], [R]):
            check_op(lambda a, b: F.nll_loss(F.log_softmax(a, 0), b, reduction=reduction), [x, target], [px, [R]],
                     mesh1d)


def test_cross_entropy_all_ignored(mesh1d):
    """A mean over zero weight is nan, as in torch."""
    x, t = global_tensor((5, 9)), torch.full((5,), 3)
    out = F.cross_entropy(distribute_tensor(x, mesh1d, [Shard(0)]), distribute_tensor(t, mesh1d, [Shard(0)]),
                          ignore_index=3)
    assert_all_ranks(bool(out.full_tensor().isnan()), "expected nan")


def test_cross_entropy_mean_one_all_reduce(mesh1d):
    """Batch-sharded mean: one scalar all-reduce of the total weight; the loss is Partial(sum)."""
    x = distribute_tensor(global_tensor((7, 9)), mesh1d, [Shard(0)])
    t = distribute_tensor(_targets((7,), 9, ignore_index=2), mesh1d, [Shard(0)])
    logp = F.log_softmax(x, 1)
    with Collectives() as seen:
        loss = F.nll_loss(logp, t, ignore_index=2)
    expected = ["all_reduce"] if mesh1d.size() > 1 else []
    assert_all_ranks(seen.calls == expected, f"collectives {seen.calls}")
    assert_all_ranks(loss.placements == (Partial(),), f"placements {loss.placements}")


def test_cross_entropy_label_smoothing(mesh1d):
    """Label smoothing adds a sum over classes (reductions family)."""
    x, t = global_tensor((7, 9)), _targets((7,), 9, ignore_index=2)
    check_op(lambda a, b: F.cross_entropy(a, b, ignore_index=2, label_smoothing=0.1), [x, t], [[Shard(0)], [Shard(0)]],
             mesh1d)


# --- mse_loss ----------------------------------------------------------------------------------

MSE1 = [([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(0)]), ([R], [Shard(1)]), ([Partial()], [Shard(0)]),
        ([Partial()], [R]), ([R], [R]), ([Shard(0)], None)]
MSE2 = [([Shard(0), Shard(1)], [Shard(0), Shard(1)]), ([Shard(0), Shard(0)], [R, R]), ([R, Shard(1)], [Shard(1), R])]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("px, py", MSE1)
def test_mse_loss_1d(mesh1d, reduction, px, py):
    x, y = global_tensor((7, 5)), global_tensor((7, 5), seed=2)
    check_op(lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, y], [px, py], mesh1d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("px, py", MSE2)
def test_mse_loss_2d(mesh2d, reduction, px, py):
    x, y = global_tensor((7, 5)), global_tensor((7, 5), seed=2)
    check_op(lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, y], [px, py], mesh2d)


# --- scaled_dot_product_attention --------------------------------------------------------------


def qkv(batch=5, heads=3, kv_heads=None, length=4, embed=6):
    """Query, key, value of shapes [batch, heads, length, embed] (kv_heads for key and value)."""
    kv_shape = (batch, kv_heads or heads, length, embed)
    return [global_tensor((batch, heads, length, embed), seed=11), global_tensor(kv_shape, seed=12),
            global_tensor(kv_shape, seed=13)]


def check_attention(mesh, tensors, placements, mask=None, mask_placements=None, **kwargs):
    """check_op on attention; ``mask_placements=None``: the mask is a plain tensor."""
    dist_mask = mask if mask is None or mask_placements is None else distribute_tensor(mask, mesh, mask_placements)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dist_mask if isinstance(q, DTensor) else mask,
                                              **kwargs)

    check_op(fn, tensors, placements, mesh, atol=1e-5, rtol=1e-5)


ATT1 = [[Shard(0)], [Shard(1)], [R]]


@pytest.mark.parametrize("placements", ATT1)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_1d(mesh1d, placements, causal):
    check_attention(mesh1d, qkv(), [placements] * 3, is_causal=causal)


@pytest.mark.parametrize("placements", ATT1)
def test_attention_mask(mesh1d, placements):
    """Masks per batch (sharded with it where long enough) or per head (boolean, broadcast)."""
    batch_mask = global_tensor((5, 1, 4, 4), seed=14)
    head_mask = global_tensor((3, 4, 4), seed=15) > 0
    head_mask[..., 0] = True  # no fully masked row
    for mask, pm in ((batch_mask, [Shard(0)]), (batch_mask, [R]), (head_mask, [Shard(0)]), (head_mask, None)):
        check_attention(mesh1d, qkv(), [placements] * 3, mask, pm)


def test_attention_gqa(mesh1d):
    """Grouped-query attention: head sharding where query and key heads line up, else replicated."""
    for heads, kv_heads in ((6, 3), (4, 2)):
        for placements in ([Shard(1)], [Shard(0)]):
            check_attention(mesh1d, qkv(heads=heads, kv_heads=kv_heads), [placements] * 3, enable_gqa=True)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)]])
def test_attention_no_communication(mesh1d, placements):
    q, k, v = (distribute_tensor(t.requires_grad_(), mesh1d, placements) for t in qkv())
    grad = distribute_tensor(global_tensor((5, 3, 4, 6)), mesh1d, placements)
    with Collectives() as seen:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    assert_all_ranks(seen.calls == [], f"collectives {seen.calls}")
    assert_all_ranks(all(t.placements == tuple(placements) for t in (out, *grads)), "placements changed")


@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [R, Shard(1)], [Shard(1), R]])
def test_attention_2d(mesh2d, placements):
    check_attention(mesh2d, qkv(), [placements] * 3, is_causal=True)


# --- linearity: Partial operands kept without communication ------------------------------------


def _linear_cases():
    """(op, partial operand, other operands): the op is linear in the partial operand."""
    x, g = global_tensor((5, 9)), global_tensor((5, 9), seed=2)
    w, b = global_tensor((9,), seed=3), global_tensor((9,), seed=4)
    y = torch.softmax(x, 1)
    _, mean, rstd = aten.native_layer_norm(x, [9], w, b, 1e-5)
    t = _targets((5,), 9, ignore_index=2)
    q, k, v = qkv()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return {
        "softmax_backward": (lambda g, y: aten._softmax_backward_data(g, y, 1, torch.float32), g, [y]),
        "log_softmax_backward": (lambda g, y: aten._log_softmax_backward_data(g, y, 1, torch.float32), g, [y.log()]),
        "layer_norm_backward": (lambda g, *a: aten.native_layer_norm_backward(g, a[0], [9], *a[1:], [True] * 3),
                                g, [x, mean, rstd, w, b]),
        "nll_loss_forward": (lambda x, t: aten.nll_loss_forward(x, t, None, 1, 2)[0], x, [t]),  # loss only
        "nll_loss_backward": (lambda g, x, t, tw: aten.nll_loss_backward(g, x, t, None, 1, 2, tw),
                              torch.tensor(1.5), [x, t, torch.tensor(4.0)]),
        "mse_loss_backward": (lambda g, x, y: aten.mse_loss_backward(g, x, y, 0), g, [x, y]),
        "embedding_backward": (lambda g, i: aten.embedding_dense_backward(g, i, 11, -1, False),
                               global_tensor((5, 3, 6)), [ids_tensor((5, 3), 11)]),
        "attention_backward": (
            lambda g, *a: aten._scaled_dot_product_flash_attention_for_cpu_backward(g, *a, 0.0, True),
            global_tensor(out.shape), [q, k, v, out, lse],
        ),
    }


@pytest.mark.parametrize("name", _linear_cases())
def test_partial_operand_stays_partial(mesh1d, name):
    """Each rank holds an equal part of the partial operand; the rest is replicated."""
    fn, part, others = _linear_cases()[name]
    expected = fn(part, *others)
    dist_part = DTensor.from_local(part / mesh1d.size(), mesh1d, [Partial()], shape=part.shape,
                                   stride=part.stride())
    dist_others = [distribute_tensor(o, mesh1d, [R]) for o in others]
    with Collectives() as seen:
        got = fn(dist_part, *dist_others)
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    assert_all_ranks(seen.calls == [], f"collectives {seen.calls}")
    for d, r in zip(got, expected):
        assert_all_ranks(d.placements == (Partial(),), f"placements {d.placements}")
        assert_close(d.full_tensor(), r, atol=1e-5, rtol=1e-5)


def test_backward_follows_sharded_grad(mesh1d):
    """Replicated forward operands and a sharded gradient: the operands are chunked locally,
    the gradient is not gathered (softmax over the split dim: one all-reduce of row sums)."""
    x, g = global_tensor((5, 9)), global_tensor((5, 9), seed=2)
    w, b = global_tensor((9,), seed=3), global_tensor((9,), seed=4)
    y = torch.softmax(x, 1)
    _, mean, rstd = aten.native_layer_norm(x, [9], w, b, 1e-5)
    cases = [
        (lambda g, y: aten._softmax_backward_data(g, y, 1, torch.float32), [y], Shard(1), ["all_reduce"]),
        (lambda g, *a: aten.native_layer_norm_backward(g, a[0], [9], *a[1:], [True] * 3)[0], [x, mean, rstd, w, b],
         Shard(0), []),
    ]
    for fn, others, shard, calls in cases:
        dist_g = distribute_tensor(g, mesh1d, [shard])
        dist_others = [distribute_tensor(o, mesh1d, [R]) for o in others]
        with Collectives() as seen:
            got = fn(dist_g, *dist_others)
        assert_all_ranks(seen.calls == (calls if mesh1d.size() > 1 else []), f"collectives {seen.calls}")
        assert_all_ranks(got.placements == (shard,), f"placements {got.placements}")
        assert_close(got.full_tensor(), fn(g, *others), atol=1e-5, rtol=1e-5)
