"""Ring attention (context parallelism's kernel) equals plain ``scaled_dot_product_attention``
on the whole sequence: outputs and query/key/value gradients, causal and not, balanced
(head-tail) and contiguous layouts, both rotate methods, grouped heads, bool and additive
masks, the math path, uneven and empty blocks, a 2-D mesh, and errors on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor.experimental._context_parallel import ring_attention
from mpidtensor.experimental._context_parallel.blocks import choose_backend
from mpidtensor.mesh import init_device_mesh

WORLD = MPI.COMM_WORLD
F64 = dict(atol=1e-10, rtol=1e-10)


def _local(tensor: torch.Tensor, comm: MPI.Intracomm, balanced: bool, sizes=None, dim: int = 2) -> torch.Tensor:
    """This rank's block of ``tensor`` along ``dim``: chunks r and 2cp-1-r of 2cp (balanced)
    or the r-th run of ``sizes`` (default: as even as ``tensor_split`` makes them)."""
    cp, rank = comm.size, comm.rank
    if balanced:
        chunks = tensor.chunk(2 * cp, dim)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)
    if sizes is None:
        return tensor.tensor_split(cp, dim)[rank]
    return tensor.split(list(sizes), dim)[rank]


def _check(comm=WORLD, *, seq=None, q_heads=2, kv_heads=2, head_dim=5, value_dim=None, dtype=torch.float64,
           causal=False, balanced=True, rotate="alltoall", mask=None, sizes=None, transposed=False, tol=F64,
           device="cpu"):
    """Compare ring attention on ``comm`` with sdpa on the whole sequence (built on every rank)."""
    seq = seq if seq is not None else 6 * comm.size  # chunks of 3 rows when balanced
    value_dim = value_dim or head_dim
    batch, gqa = 2, q_heads != kv_heads

    def make(heads, dim, seed):
        if transposed:  # [B, S, H, D] memory, as attention projections give it
            return global_tensor((batch, seq, heads, dim), dtype, seed).to(device).transpose(1, 2)
        return global_tensor((batch, heads, seq, dim), dtype, seed).to(device)

    q, k, v = make(q_heads, head_dim, 1), make(kv_heads, head_dim, 2), make(kv_heads, value_dim, 3)
    weight = global_tensor((batch, q_heads, seq, value_dim), dtype, 4).to(device)
    mask = None if mask is None else mask.to(device)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    (expected * weight).sum().backward()

    local = [_local(t, comm, balanced, sizes).detach().requires_grad_() for t in (q, k, v)]
    local_mask = None if mask is None else _local(mask.expand(*mask.shape[:-2], seq, seq), comm, balanced, sizes,
                                                  dim=-2)
    out = ring_attention(*local, comm=comm, attn_mask=local_mask, is_causal=causal, enable_gqa=gqa,
                         load_balanced=balanced, rotate_method=rotate)
    (out * _local(weight, comm, balanced, sizes)).sum().backward()
    assert_close(out.detach(), _local(expected.detach(), comm, balanced, sizes), **tol)
    for mine, theirs in zip(local, full):
        assert_close(mine.grad, _local(theirs.grad, comm, balanced, sizes), **tol)
    return out, local


@pytest.mark.every_case
@pytest.mark.parametrize("rotate", ["alltoall", "allgather"])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa(causal, balanced, rotate):
    _check(causal=causal, balanced=balanced, rotate=rotate)


@pytest.mark.parametrize("rotate", ["alltoall", "allgather"])
def test_grouped_heads(rotate):
    _check(q_heads=4, kv_heads=2, causal=True, rotate=rotate)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("balanced", [True, False])
def test_masks(kind, balanced):
    """Masks index global key positions; some rows see no key in a block, row 0 none at all."""
    seq = 6 * WORLD.size
    gen = torch.Generator().manual_seed(5)
    visible = torch.rand((2, 1, seq, seq), generator=gen) > 0.6
    visible[:, :, 0] = False
    mask = visible if kind == "bool" else torch.randn((1, 4, seq, seq), generator=gen, dtype=torch.float64)
    if kind == "additive":
        mask = mask.masked_fill(~visible, float("-inf"))
    _check(mask=mask, balanced=balanced, q_heads=4, kv_heads=2, rotate="allgather" if balanced else "alltoall")


def test_float32_transposed_layout():
    """float32 within 1e-5; [B, S, H, D] memory in, the strides plain sdpa gives out."""
    out, (q, k, v) = _check(dtype=torch.float32, causal=True, transposed=True, tol=dict(atol=1e-5, rtol=1e-5))
    plain = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    assert_all_ranks(out.stride() == plain.stride(), f"strides {out.stride()} vs sdpa's {plain.stride()}")


def test_bfloat16():
    _check(dtype=torch.bfloat16, causal=True, seq=16 * WORLD.size, head_dim=8, tol=dict(atol=3e-2, rtol=3e-2))


def test_math_path():
    """A value head dim unlike the query's, and the math backend chosen by the user."""
    q, v = torch.randn(1, 2, 4, 5), torch.randn(1, 2, 4, 3)
    assert_all_ranks(choose_backend(q, q, v, None, False, 1.0, False) == "math", "value head dim: not math")
    _check(value_dim=3, balanced=False, mask=global_tensor((6 * WORLD.size,) * 2, torch.float64, 6))
    with sdpa_kernel(SDPBackend.MATH):
        assert_all_ranks(choose_backend(q, q, q, None, True, 1.0, False) == "math", "sdpa_kernel(MATH): not math")
        _check(causal=True, q_heads=4, kv_heads=2)


@pytest.mark.parametrize("causal", [True, False])
def test_uneven_contiguous(causal):
    """Contiguous blocks of different lengths (odd total), and empty ones."""
    cp = WORLD.size
    _check(seq=2 * cp + 1, balanced=False, causal=causal)
    sizes = [2] * (cp - 1) + [0]
    for rotate in ("alltoall", "allgather"):
        _check(seq=sum(sizes), sizes=sizes, balanced=False, causal=causal, rotate=rotate)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda(dtype):
    """The CUDA kernels: flash (float16, causal) and memory-efficient (float32, additive mask)."""
    device = f"cuda:{WORLD.rank % torch.cuda.device_count()}"
    seq = 16 * WORLD.size
    if dtype == torch.float16:
        _check(dtype=dtype, causal=True, seq=seq, head_dim=16, q_heads=4, kv_heads=2, device=device,
               tol=dict(atol=2e-2, rtol=2e-2))
    else:
        hidden = global_tensor((seq, seq), torch.float32, 8) > 0.5
        mask = global_tensor((seq, seq), torch.float32, 7).masked_fill(hidden, float("-inf"))
        _check(dtype=dtype, mask=mask, seq=seq, head_dim=16, device=device, tol=dict(atol=1e-4, rtol=1e-4))


def test_two_dim_mesh():
    """The cp ranks are one dimension of a 2x2 mesh (rank order along it = sequence order)."""
    if WORLD.size != 4:
        pytest.skip("needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    for dim in ("cp", "dp"):
        _check(mesh.get_group(dim), causal=True)
        _check(mesh.get_group(dim), rotate="allgather", q_heads=4, kv_heads=2)


def test_bad_input_everywhere():
    q = torch.randn(1, 2, 4, 8)
    for kwargs, match in [(dict(dropout_p=0.1), "dropout"),
                          (dict(is_causal=True, attn_mask=torch.ones(4, 4 * WORLD.size, dtype=torch.bool)),
                           "cannot be used together"),
                          (dict(rotate_method="ring"), "rotate_method")]:
        raises_everywhere(ValueError, lambda: ring_attention(q, q, q, comm=WORLD, **kwargs), match)
    if WORLD.size == 1:
        return
    odd = torch.randn(1, 2, 3, 8)
    raises_everywhere(ValueError, lambda: ring_attention(odd, odd, odd, comm=WORLD, is_causal=True), "divisible")
    kv = torch.randn(1, 3, 4, 8)
    raises_everywhere(ValueError, lambda: ring_attention(q, kv, kv, comm=WORLD, enable_gqa=True), "multiple")
    raises_everywhere(ValueError, lambda: ring_attention(q, q, q, comm=WORLD, attn_mask=torch.zeros(4, 4)),
                      "broadcast")
    learnt = torch.zeros(4, 4 * WORLD.size, requires_grad=True)
    raises_everywhere(ValueError, lambda: ring_attention(q, q, q, comm=WORLD, attn_mask=learnt), "require grad")
    # one rank's query block differs in length: found by the agreement, raised everywhere
    mine = torch.randn(1, 2, 6 if WORLD.rank == 0 else 4, 8)
    raises_everywhere(ValueError, lambda: ring_attention(mine, mine, mine, comm=WORLD), "same local length")
