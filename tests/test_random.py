"""Layout-invariant random ops: one seed gives one global tensor on every layout;
sane statistics; dropout's mask is shared by forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor

S0, S1, R, P = [Shard(0)], [Shard(1)], [Replicate()], [Partial()]
SHAPE = (7, 9)
EXACT = dict(atol=0, rtol=0)


def _zeros(mesh, placements, shape=SHAPE, dtype=torch.float32) -> DTensor:
    return distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)


OPS = {
    "uniform_": lambda x: x.uniform_(-2.0, 3.0),
    "normal_": lambda x: x.normal_(1.0, 0.5),
    "exponential_": lambda x: x.exponential_(2.0),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "bernoulli_p": lambda x: torch.bernoulli(x, 0.7),
    "bernoulli_probs": lambda x: torch.bernoulli(x.fill_(0.4)),
    "rand_like": lambda x: torch.rand_like(x, dtype=torch.float64),
    "randn_like": torch.randn_like,
    "randint_like": lambda x: torch.randint_like(x, 3, 10),
    "kaiming_uniform_": lambda x: torch.nn.init.kaiming_uniform_(x),
    "dropout": lambda x: F.dropout(x.fill_(1.0), 0.4),
    "native_dropout": lambda x: torch.ops.aten.native_dropout(x.fill_(1.0), 0.4, True)[0],
}


def _draw(op, mesh, placements, seed=1234, shape=SHAPE) -> torch.Tensor:
    torch.manual_seed(seed)
    return OPS[op](_zeros(mesh, placements, shape)).full_tensor()


def _generators_in_step() -> None:
    draws = MPI.COMM_WORLD.allgather(torch.rand(()).item())
    assert_all_ranks(len(set(draws)) == 1, f"generators diverged: {draws}")


@pytest.mark.parametrize("op", OPS)
def test_layout_invariance_1d(mesh1d, op):
    expected = _draw(op, mesh1d, R)
    for placements in (S0, S1, P):
        assert_close(_draw(op, mesh1d, placements), expected, **EXACT)
    _generators_in_step()
    assert_all_ranks(not torch.equal(_draw(op, mesh1d, R, seed=99), expected), "seed ignored")


@pytest.mark.parametrize("op", ["uniform_", "normal_", "bernoulli_", "randn_like", "dropout"])
def test_layout_invariance_2d(mesh1d, mesh2d, op):
    expected = _draw(op, mesh1d, R)
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Partial()]):
        assert_close(_draw(op, mesh2d, placements), expected, **EXACT)
    _generators_in_step()


STRIDED = [_StridedShard(0, split_factor=2), Shard(0)]  # FSDP's layout of a TP Shard(0) weight on (dp, tp)


@pytest.mark.parametrize("op", ["uniform_", "normal_", "kaiming_uniform_", "randn_like", "dropout"])
def test_layout_invariance_strided(mesh1d, mesh2d, op):
    """A ``_StridedShard`` input draws its runs at their global indices: the same global
    tensor as replicated, and an in-place fill keeps its placements and local tensor."""
    expected = _draw(op, mesh1d, R, shape=(10, 3))
    assert_close(_draw(op, mesh2d, STRIDED, shape=(10, 3)), expected, **EXACT)
    w = _zeros(mesh2d, STRIDED, shape=(10, 3))
    local = w._local_tensor
    with torch.no_grad():
        torch.nn.init.trunc_normal_(w, std=0.02)  # uniform_, erfinv_, mul_, add_, clamp_ in place
    assert_all_ranks(w._local_tensor is local and w.placements == tuple(STRIDED), f"{w.placements}")
    _generators_in_step()


def test_first_random_op_syncs_generators():
    """Torch seeds every process differently: the first random op on a mesh makes them agree."""
    from mpidtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (MPI.COMM_WORLD.size,), mesh_dim_names=("fresh",))
    torch.manual_seed(100 + MPI.COMM_WORLD.rank)
    local = _zeros(mesh, R).uniform_().to_local()
    replicas = MPI.COMM_WORLD.allgather(local)
    assert_all_ranks(all(torch.equal(r, replicas[0]) for r in replicas), "replicas differ")
    _generators_in_step()
    mesh.free()


def test_partial_input_becomes_replicate(mesh1d):
    x = _zeros(mesh1d, P)
    x.normal_()
    y = torch.rand_like(_zeros(mesh1d, P))
    assert_all_ranks(x.placements == (Replicate(),) and y.placements == (Replicate(),), f"{x.placements} {y.placements}")


def test_inplace_init_keeps_local_tensor(mesh1d):
    w = distribute_tensor(torch.zeros(SHAPE), mesh1d, S1).requires_grad_()
    local = w._local_tensor
    with torch.no_grad():
        torch.nn.init.uniform_(w, -0.1, 0.1)
    assert_all_ranks(w._local_tensor is local and w.placements == (Shard(1),), "init replaced the local tensor")
    full = w.full_tensor()
    assert_all_ranks(bool((full.abs() <= 0.1).all()) and full.abs().sum() > 0, "values out of range")


def test_explicit_generator(mesh1d):
    results = []
    for placements in (R, S0):
        gen = torch.Generator().manual_seed(7)
        results.append(_zeros(mesh1d, placements).uniform_(generator=gen).full_tensor())
    assert_close(results[1], results[0], **EXACT)


# --- statistics ---------------------------------------------------------------------------------

BIG = (317, 331)  # ~1e5 samples


@pytest.mark.parametrize(
    "op,mean,std",
    [
        (lambda x: x.uniform_(), 0.5, (1 / 12) ** 0.5),
        (lambda x: x.normal_(), 0.0, 1.0),
        (lambda x: x.exponential_(), 1.0, 1.0),
        (lambda x: x.bernoulli_(0.3), 0.3, (0.3 * 0.7) ** 0.5),
        (lambda x: torch.randint_like(x, 10), 4.5, (99 / 12) ** 0.5),
    ],
)
def test_statistics(mesh1d, op, mean, std):
    torch.manual_seed(0)
    x = op(_zeros(mesh1d, S0, BIG, torch.float64)).full_tensor()
    tol = 5 * std / x.numel() ** 0.5 + 1e-3
    assert_all_ranks(abs(x.mean().item() - mean) < tol, f"mean {x.mean().item()} vs {mean}")
    assert_all_ranks(abs(x.std().item() - std) < 0.01 * std + 1e-3, f"std {x.std().item()} vs {std}")
    flat = x.flatten()
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()
    assert_all_ranks(abs(corr) < 0.02, f"neighbours correlate: {corr}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_uniform_range_per_dtype(mesh1d, dtype):
    torch.manual_seed(0)
    x = _zeros(mesh1d, S1, BIG, dtype).uniform_().full_tensor()
    ok = bool((x >= 0).all() and (x < 1).all()) and x.unique().numel() > 100
    assert_all_ranks(ok and x.dtype == dtype, f"{dtype}: min {x.min()}, max {x.max()}")
    normals = torch.randn_like(_zeros(mesh1d, S0, BIG, dtype)).full_tensor()
    assert_all_ranks(bool(normals.isfinite().all()) and abs(normals.double().std().item() - 1) < 0.02, f"{dtype}")


# --- dropout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("placements", [S0, S1, R])
@pytest.mark.parametrize("fused", [False, True])
def test_dropout_mask_shared_by_forward_and_backward(mesh1d, placements, fused):
    p = 0.4
    x_full = global_tensor(SHAPE)
    x = distribute_tensor(x_full, mesh1d, placements).requires_grad_()
    torch.manual_seed(3)
    if fused:
        y, mask = torch.ops.aten.native_dropout(x, p, True)
        mask = mask.full_tensor()
    else:
        y = F.dropout(x, p)
    y_full = y.full_tensor()
    if not fused:
        mask = y_full != 0
    assert_close(y_full, x_full * mask / (1 - p))
    grad = global_tensor(SHAPE, seed=5)
    (y_full * grad).sum().backward()
    assert_close(x.grad.full_tensor(), grad * mask / (1 - p))
    keep = mask.float().mean().item()
    assert_all_ranks(0.3 < keep < 0.9 and y.placements == tuple(placements), f"kept {keep}, {y.placements}")


def test_native_dropout_same_mask_as_eager_path(mesh1d):
    x = distribute_tensor(torch.ones(SHAPE), mesh1d, S0)
    torch.manual_seed(8)
    fused_out, _ = torch.ops.aten.native_dropout(x, 0.25, True)
    torch.manual_seed(8)
    eager_out = F.dropout(x, 0.25)
    assert_close(fused_out.full_tensor(), eager_out.full_tensor())


def test_native_dropout_eval_and_partial(mesh1d):
    x_full = global_tensor(SHAPE)
    out, mask = torch.ops.aten.native_dropout(distribute_tensor(x_full, mesh1d, S1), 0.5, False)
    assert_close(out.full_tensor(), x_full)
    assert_all_ranks(bool(mask.full_tensor().all()), "eval mask drops")
    torch.manual_seed(4)
    out, mask = torch.ops.aten.native_dropout(distribute_tensor(x_full, mesh1d, P), 0.5, True)
    assert_all_ranks(out.placements == (Partial(),) and mask.placements == (Replicate(),), f"{out.placements}")
    assert_close(out.full_tensor(), x_full * mask.full_tensor() * 2.0)
