"""torch 2.13's functional context-parallel entry points (what torchtitan imports):
the load balancers give torch's own orders; ``_context_parallel_shard`` gives each rank
its slice of tensors (lists, dicts, any seq dim, per-batch orders) and of flex-attention
``BlockMask``s; ``flex_cp_allgather`` gathers and its backward reduce-scatters;
``_enable_context_parallel_dispatcher`` makes SDPA on sequence-sharded DTensors ring
attention, output and gradients equal to one process (causal or not, head-tail or
contiguous, torchtitan's [B, L, N, H] layout transposed); bad input raises everywhere."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere

from mpidtensor import DTensor, Shard, init_device_mesh
from mpidtensor.experimental._attention import (
    _context_parallel_shard,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from mpidtensor.experimental._context_parallel._attention import flex_cp_allgather
from torch.distributed.tensor.experimental._context_parallel import _load_balancer as torch_balancers
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

WORLD = MPI.COMM_WORLD
TOL = dict(atol=1e-10, rtol=1e-10)


@pytest.fixture(scope="module")
def cp_mesh():
    return init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("cp",))


@pytest.fixture
def dispatcher():
    _enable_context_parallel_dispatcher()
    yield
    _disable_context_parallel_dispatcher()
    _cp_options.enable_load_balance = True


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _documents(b, h, q_idx, kv_idx):
    """Causal within documents of 96 tokens: uneven work per 128-token block."""
    return (q_idx >= kv_idx) & (q_idx // 96 == kv_idx // 96)


def _local_chunk(full: torch.Tensor, dim: int, indices: torch.Tensor | None) -> torch.Tensor:
    """What rank WORLD.rank should hold: ``full`` reordered by ``indices`` (one row), its chunk."""
    if indices is not None:
        full = full.index_select(dim, indices[0])
    return full.chunk(WORLD.size, dim)[WORLD.rank]


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_head_tail_balancer_is_torchs(chunk):
    ws = WORLD.size
    seq = 2 * ws * chunk
    ours, theirs = _HeadTailLoadBalancer(seq, ws, "cpu"), torch_balancers._HeadTailLoadBalancer(seq, ws, "cpu")
    same = all(torch.equal(ours._generate_indices(restore=r).long(), theirs._generate_indices(restore=r).long())
               for r in (False, True))
    assert_all_ranks(same, "head-tail indices differ from torch's")


@pytest.mark.parametrize("mask_mod", [_causal, _documents], ids=["causal", "documents"])
def test_ptrr_balancer_is_torchs(mask_mod):
    seq = 128 * 2 * WORLD.size
    block_mask = create_block_mask(mask_mod, 1, 1, seq, seq, device="cpu")
    ours, theirs = _PTRRLoadBalancer(block_mask, WORLD.size), torch_balancers._PTRRLoadBalancer(block_mask, WORLD.size)
    same = all(torch.equal(ours._generate_indices(restore=r), theirs._generate_indices(restore=r)) for r in (False, True))
    work = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    same &= torch.equal(_PTRRLoadBalancer.ptrr_scheduling(work, 4), torch_balancers._PTRRLoadBalancer.ptrr_scheduling(work, 4))
    assert_all_ranks(same, "PTRR indices differ from torch's")


@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "none"])
def test_shard_tensors(cp_mesh, balanced):
    """A list (seq dims 1, 0 and 2) and a dict, each tensor this rank's slice; uneven
    lengths shard as torch.chunk when no balancer is given."""
    ws = WORLD.size
    seq = 4 * ws if balanced else 4 * ws + 1
    balancer = _HeadTailLoadBalancer(seq, ws, "cpu") if balanced else None
    indices = balancer._generate_indices() if balanced else None
    tokens = global_tensor((3, seq), torch.int64)
    table = global_tensor((seq, 5))
    states = global_tensor((2, 3, seq, 4))
    got = _context_parallel_shard(cp_mesh, [tokens, table, states], [1, 0, 2], balancer)
    want = [_local_chunk(tokens, 1, indices), _local_chunk(table, 0, indices), _local_chunk(states, 2, indices)]
    as_dict = _context_parallel_shard(cp_mesh, {"ids": tokens, "table": table}, {"ids": 1, "table": 0}, balancer)
    ok = all(torch.equal(g, w) for g, w in zip(got, want))
    ok &= isinstance(as_dict, dict) and torch.equal(as_dict["ids"], want[0]) and torch.equal(as_dict["table"], want[1])
    ok &= _cp_options.enable_load_balance == balanced
    assert_all_ranks(ok, "a shard differs from the reordered chunk")
    _cp_options.enable_load_balance = True


def test_shard_per_batch_order(cp_mesh):
    """A balancer whose order differs per batch row (PTRR of a per-row mask) reorders each row."""
    seq = 128 * WORLD.size

    def shifted(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx >= b * 64)

    balancer = _PTRRLoadBalancer(create_block_mask(shifted, 2, 1, seq, seq, device="cpu"), WORLD.size)
    indices = balancer._generate_indices()
    tokens = global_tensor((2, seq), torch.int64)
    (got,) = _context_parallel_shard(cp_mesh, [tokens], [1], balancer)
    want = torch.gather(tokens, 1, indices).chunk(WORLD.size, 1)[WORLD.rank]
    assert_all_ranks(torch.equal(got, want), "per-row reordering differs")
    _cp_options.enable_load_balance = True


@pytest.mark.parametrize("balancer_kind", ["head_tail", "ptrr", "none"])
def test_block_mask_and_flex_allgather_forward(cp_mesh, balancer_kind):
    """Flex attention of this rank's queries on the gathered keys with the sharded mask
    equals one process's causal attention at this rank's (reordered) rows."""
    ws, seq = WORLD.size, 256 * WORLD.size
    q, k, v = (global_tensor((1, 2, seq, 8), torch.float64, seed=s) for s in (1, 2, 3))
    block_mask = create_block_mask(_documents, 1, 1, seq, seq, device="cpu")
    balancer = {"head_tail": _HeadTailLoadBalancer(seq, ws, "cpu"), "ptrr": _PTRRLoadBalancer(block_mask, ws),
                "none": None}[balancer_kind]
    q_local, k_local, v_local, mask_local = _context_parallel_shard(cp_mesh, [q, k, v, block_mask], [2, 2, 2, 2],
                                                                    balancer)
    k_all, v_all = flex_cp_allgather(k_local, v_local, 2, cp_mesh)
    got = flex_attention(q_local, k_all, v_all, block_mask=mask_local)
    positions = torch.arange(seq)
    dense = _documents(0, 0, positions[:, None], positions[None, :])
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    indices = None if balancer is None else balancer._generate_indices()
    assert_close(got, _local_chunk(full, 2, indices), **TOL)
    _cp_options.enable_load_balance = True


def test_flex_allgather_backward(cp_mesh):
    """The gathered blocks' gradients are summed over the ranks back onto each block."""
    k_local = global_tensor((2, 3, 4, 5), torch.float64, seed=10 + WORLD.rank).requires_grad_()
    v_local = global_tensor((2, 3, 4, 5), torch.float64, seed=20 + WORLD.rank).requires_grad_()
    k_all, v_all = flex_cp_allgather(k_local, v_local, 2, cp_mesh)
    weights = global_tensor(k_all.shape, torch.float64, seed=99) * (WORLD.rank + 1)
    (k_all * weights + 2 * v_all * weights).sum().backward()
    scale = sum(range(1, WORLD.size + 1))  # the weights of every rank, summed
    base = global_tensor(k_all.shape, torch.float64, seed=99).chunk(WORLD.size, 2)[WORLD.rank]
    gathered = torch.cat([global_tensor((2, 3, 4, 5), torch.float64, seed=10 + r) for r in range(WORLD.size)], 2)
    assert_close(k_all.detach(), gathered, **TOL)
    assert_close(k_local.grad, base * scale, **TOL)
    assert_close(v_local.grad, 2 * base * scale, **TOL)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dispatcher_sdpa_equals_one_process(cp_mesh, dispatcher, causal, balanced, dtype):
    """torchtitan's call: local [B, L, N, H] blocks wrapped as Shard(1) DTensors,
    transposed to [B, N, L, H], plain SDPA; output and q/k/v gradients against one process."""
    ws, seq = WORLD.size, 6 * WORLD.size
    tol = TOL if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    q, k, v, grad = (global_tensor((2, seq, 4, 8), dtype, seed=s) for s in (1, 2, 3, 4))
    full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=causal).transpose(1, 2)
    out.backward(grad)
    balancer = _HeadTailLoadBalancer(seq, ws, "cpu") if balanced else None
    indices = balancer._generate_indices() if balanced else None
    local = [t.requires_grad_() for t in _context_parallel_shard(cp_mesh, [q, k, v], [1, 1, 1], balancer)]
    (grad_local,) = _context_parallel_shard(cp_mesh, [grad], [1], balancer)
    wrapped = [DTensor.from_local(t, cp_mesh, [Shard(1)], run_check=False).transpose(1, 2) for t in local]
    got = F.scaled_dot_product_attention(*wrapped, is_causal=causal).transpose(1, 2)
    layout_ok = isinstance(got, DTensor) and (WORLD.size == 1 or got.placements == (Shard(1),))  # 1 rank: no CP
    assert_all_ranks(layout_ok, f"output layout {getattr(got, 'placements', type(got))}")
    got.to_local().backward(grad_local)
    assert_close(got.to_local(), _local_chunk(out.detach(), 1, indices), **tol)
    for mine, theirs in zip(local, full):
        assert_close(mine.grad, _local_chunk(theirs.grad, 1, indices), **tol)


def test_dispatcher_off_and_other_layouts(cp_mesh):
    """Disabled: a sequence-sharded SDPA is gathered (natural order, torch's non-CP result);
    enabled: heads-sharded SDPA keeps its rule."""
    seq = 4 * WORLD.size
    q = global_tensor((1, 2 * WORLD.size, seq, 8), torch.float64)
    full = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    by_seq = DTensor.from_local(q.chunk(WORLD.size, 2)[WORLD.rank], cp_mesh, [Shard(2)], run_check=False)
    off = F.scaled_dot_product_attention(by_seq, by_seq, by_seq, is_causal=True).full_tensor()
    _enable_context_parallel_dispatcher()
    try:
        by_heads = DTensor.from_local(q.chunk(WORLD.size, 1)[WORLD.rank], cp_mesh, [Shard(1)], run_check=False)
        heads = F.scaled_dot_product_attention(by_heads, by_heads, by_heads, is_causal=True)
        _cp_options.enable_load_balance = False
        on = F.scaled_dot_product_attention(by_seq, by_seq, by_seq, is_causal=True).full_tensor()
    finally:
        _disable_context_parallel_dispatcher()
        _cp_options.enable_load_balance = True
    assert_close(off, full, **TOL)
    assert_close(on, full, **TOL)
    assert_close(heads.full_tensor(), full, **TOL)
    assert_all_ranks(heads.placements == (Shard(1),), f"heads layout {heads.placements}")


def test_bad_input(cp_mesh, dispatcher):
    ws = WORLD.size
    x = torch.zeros(2, 4 * ws)
    raises_everywhere(ValueError, lambda: _context_parallel_shard(cp_mesh, [x, x], [1]), "seq_dims")
    raises_everywhere(ValueError, lambda: _context_parallel_shard(cp_mesh, [x], [2]), "not a dim")
    raises_everywhere(ValueError, lambda: _HeadTailLoadBalancer(2 * ws + 1, ws, "cpu")._generate_indices(),
                      "not divisible")
    raises_everywhere(ValueError, lambda: _context_parallel_shard(
        cp_mesh, [torch.zeros(2, 2 * ws)], [1], _HeadTailLoadBalancer(4 * ws, ws, "cpu")), "load balancer orders")
    raises_everywhere(ValueError, lambda: _context_parallel_shard(cp_mesh, ["ids"], [0]), "BlockMask")
    q = DTensor.from_local(torch.zeros(1, 2, 4, 8, dtype=torch.float64), cp_mesh, [Shard(2)], run_check=False)
    mask = torch.ones(4 * ws, 4 * ws, dtype=torch.bool)
    if ws > 1:
        raises_everywhere(NotImplementedError, lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                          "attn_mask")
    raises_everywhere(TypeError, lambda: flex_cp_allgather(torch.zeros(2), torch.zeros(2), 0, object()),
                      "MPI-backed group")
