"""context_parallel / context_parallel_unshard / set_rotate_method: a small attention model
and a Hugging Face Llama run inside ``context_parallel`` give the loss and every gradient
of one process (causal and not, GQA, masks, both rotate methods, 1-D and the "cp" dim
of a 2x2 mesh, DTensor heads from TP); buffers are restored after the block; the load
balancing layout and its inverse; every bad input raises on every rank."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.functional import scaled_dot_product_attention  # bound before any block: still intercepted

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor, raises_everywhere

from mpidtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from mpidtensor.experimental import context_parallel, context_parallel_unshard, set_rotate_method
from mpidtensor.experimental._context_parallel import api
from mpidtensor.experimental._context_parallel.load_balance import head_tail_inverse, head_tail_order

WORLD = MPI.COMM_WORLD
SEQ = 6 * WORLD.size  # 2 * cp head-tail chunks of an odd length (3) at every world size
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


@pytest.fixture(scope="module")
def cp_mesh():
    """The 1-D mesh over all ranks."""
    return init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("cp",))


@pytest.fixture(scope="module")
def dp_cp_mesh():
    """A 2x2 (dp, cp) mesh; its tests run at 4 ranks only."""
    if WORLD.size != 4:
        pytest.skip("needs 4 ranks")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


@pytest.fixture(scope="module")
def cp_tp_mesh():
    """A 2x2 (cp, tp) mesh; its tests run at 4 ranks only."""
    if WORLD.size != 4:
        pytest.skip("needs 4 ranks")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))


@pytest.fixture(autouse=True)
def _default_rotate_method():
    yield
    set_rotate_method("allgather")


# --- a small attention model -----------------------------------------------------------------


class TinyAttentionModel(torch.nn.Module):
    """Embedding, a rotary-like position table (a buffer indexed by position, sharded
    with the sequence), one sdpa block (optionally GQA, causal or not; sdpa called by a
    name imported at module load) and a vocab head."""

    def __init__(self, vocab=29, dim=16, heads=4, kv_heads=4, seq=SEQ, causal=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        self.embed = torch.nn.Embedding(vocab, dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab)
        angles = torch.arange(seq)[:, None] / 10000 ** (torch.arange(self.head_dim // 2) / self.head_dim)
        self.register_buffer("angles", angles)  # [seq, head_dim / 2]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        cos, sin = self.angles.cos().to(x.dtype), self.angles.sin().to(x.dtype)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = ids.shape
        x = self.embed(ids)
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(batch, seq, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        out = scaled_dot_product_attention(
            self.rotate(q), self.rotate(k), v, attn_mask=mask, is_causal=self.causal and mask is None,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.head(x + self.wo(out.transpose(1, 2).reshape(batch, seq, -1)))


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels, shifted before sharding (the last position ignored)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Cross entropy summed over the local tokens, divided by the global token count: the
    sum over the cp ranks is the plain mean."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens


def reduce_over(comm: MPI.Comm, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over ``comm`` (float64/float32 contiguous buffers)."""
    out = tensor.detach().contiguous().clone()
    comm.Allreduce(MPI.IN_PLACE, out.numpy())
    return out


def model_case(dtype, causal, kv_heads, mask_kind=None):
    """The model, ids, labels and optional mask, the same on every rank."""
    torch.manual_seed(0)
    model = TinyAttentionModel(kv_heads=kv_heads, causal=causal).to(dtype)
    ids = torch.randint(0, 29, (2, SEQ), generator=torch.Generator().manual_seed(3))
    mask = None
    if mask_kind is not None:
        keep = global_tensor((2, 1, SEQ, SEQ), torch.bool, seed=7) | torch.eye(SEQ, dtype=torch.bool)
        if causal:
            keep &= torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -1e9)
    return model, ids, shifted_labels(ids), mask


def check_model(mesh, dtype=torch.float64, causal=True, kv_heads=4, mask_kind=None, backward_inside=True):
    """Loss and parameter gradients inside context_parallel(mesh) equal one process. With
    ``backward_inside=False`` the backward runs after the block: the buffers it reads
    (the embedding's indices, the labels) are then listed in no_restore_buffers."""
    comm = mesh.get_group()
    model, ids, labels, mask = model_case(dtype, causal, kv_heads, mask_kind)
    n_tokens = int((labels != -100).sum())
    plain = summed_loss(model(ids, mask), labels, n_tokens)
    plain.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    buffers, dims = [ids, labels, model.angles], [1, 1, 0]
    if mask is not None:
        buffers, dims = buffers + [mask], dims + [2]  # rows are queries: columns stay whole
    keep_local = set() if backward_inside else {ids, labels}
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=keep_local):
        assert_all_ranks(ids.shape[1] == SEQ // comm.size, f"local ids shape {tuple(ids.shape)}")
        loss = summed_loss(model(ids, mask), labels, n_tokens)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    restored = model.angles.shape[0] == SEQ and (ids.shape[1] == SEQ) == backward_inside
    assert_all_ranks(restored or comm.size == 1, "buffers not restored as asked")
    assert_close(reduce_over(comm, loss), plain.detach(), **TOL[dtype])
    for name, p in model.named_parameters():
        assert_close(reduce_over(comm, p.grad), expected[name], **TOL[dtype])


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_model_matches_one_process(cp_mesh, causal, kv_heads, rotate):
    set_rotate_method(rotate)
    check_model(cp_mesh, causal=causal, kv_heads=kv_heads)


@pytest.mark.parametrize("rotate, kind", [("allgather", "all_gather"), ("alltoall", "ring_shift")])
def test_rotate_method_reaches_the_ring(cp_mesh, rotate, kind):
    """The method set (also inside the block) is the one the next attention call uses."""
    if WORLD.size == 1:
        pytest.skip("a mesh of size 1 is a no-op")
    q = global_tensor((1, 2, SEQ, 4), torch.float64)
    with context_parallel(cp_mesh, buffers=[q], buffer_seq_dims=[2]):
        set_rotate_method(rotate)
        with CollectiveLog() as log:
            scaled_dot_product_attention(q, q, q, is_causal=True)
    other = {"all_gather": "ring_shift", "ring_shift": "all_gather"}[kind]
    assert_all_ranks(kind in log.calls and other not in log.calls, f"{rotate} ran {log.calls}")


def test_model_float32(cp_mesh):
    check_model(cp_mesh, dtype=torch.float32, kv_heads=2)


def test_backward_after_the_block(cp_mesh):
    check_model(cp_mesh, kv_heads=2, backward_inside=False)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_model_with_mask(cp_mesh, causal, mask_kind):
    check_model(cp_mesh, causal=causal, mask_kind=mask_kind)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_model_on_cp_dim_of_2d_mesh(dp_cp_mesh, causal):
    check_model(dp_cp_mesh["cp"], causal=causal, kv_heads=2)


# --- DTensor heads (TP) inside the cp block ---------------------------------------------------


def test_dtensor_heads_sharded_on_tp(cp_tp_mesh):
    """q/k/v as DTensors with heads sharded on another mesh dim: the output keeps their
    layout, and output and gradients equal plain sdpa."""
    q, k, v = (global_tensor((2, 4, SEQ, 8), torch.float64, seed=s) for s in (1, 2, 3))
    weight = global_tensor((2, 4, SEQ, 8), torch.float64, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    plain = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (plain * weight).sum().backward()
    with context_parallel(cp_tp_mesh["cp"], buffers=[q, k, v, weight], buffer_seq_dims=[2, 2, 2, 2]):
        heads = [distribute_tensor(t, cp_tp_mesh["tp"], [Shard(1)]).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads, is_causal=True)
        assert_all_ranks(isinstance(out, DTensor) and out.placements == (Shard(1),), f"output {type(out)}")
        (out * distribute_tensor(weight, cp_tp_mesh["tp"], [Shard(1)])).sum().backward()
        local = [out.full_tensor()] + [h.grad.full_tensor() for h in heads]
        gathered = context_parallel_unshard(cp_tp_mesh["cp"], local, [2, 2, 2, 2])
    assert_close(gathered[0], plain.detach(), **TOL[torch.float64])
    for got, leaf in zip(gathered[1:], leaves):
        assert_close(got, leaf.grad, **TOL[torch.float64])


def test_dtensor_inputs_with_different_layouts_raise(cp_tp_mesh):
    q = global_tensor((1, 2, 8, 4), torch.float64)
    heads = distribute_tensor(q, cp_tp_mesh["tp"], [Shard(1)])
    batch = distribute_tensor(q, cp_tp_mesh["tp"], [Shard(0)])
    seq = distribute_tensor(q, cp_tp_mesh["tp"], [Shard(2)])

    def call(*qkv):
        with context_parallel(cp_tp_mesh["cp"]):
            F.scaled_dot_product_attention(*qkv)

    raises_everywhere(ValueError, lambda: call(heads, batch, heads), "same placements")
    raises_everywhere(ValueError, lambda: call(heads, q, q), "all DTensors")
    raises_everywhere(ValueError, lambda: call(seq, seq, seq), "before dim 2")


# --- a Hugging Face model ----------------------------------------------------------------------


def test_hf_llama_matches_one_process(cp_mesh):
    """transformers' LlamaForCausalLM (sdpa): input ids, pre-shifted labels and position
    ids as buffers; an all-ones attention mask keeps HF from reading the jump in the
    head-tail position ids as packed sequences (it then calls sdpa with is_causal=True);
    ``num_items_in_batch`` makes each rank's loss its share of the global mean. HF
    computes the loss in float32 (of float64 logits): float32 tolerances."""
    if WORLD.size == 1:
        pytest.skip("a mesh of size 1 is a no-op")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 37, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels = shifted_labels(ids)
    positions = torch.arange(SEQ).expand(2, SEQ).clone()
    ones = torch.ones(2, SEQ, dtype=torch.long)
    n_tokens = int((labels != -100).sum())

    def step():
        out = model(input_ids=ids, attention_mask=ones, position_ids=positions, labels=labels,
                    shift_labels=labels, num_items_in_batch=n_tokens, use_cache=False)
        out.loss.backward()
        return out.loss.detach()

    plain = step()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    comm = cp_mesh.get_group()
    with context_parallel(cp_mesh, buffers=[ids, labels, positions, ones], buffer_seq_dims=[1, 1, 1, 1]):
        loss = step()
    assert_close(reduce_over(comm, loss), plain, **TOL[torch.float32])
    for name, p in model.named_parameters():
        assert_close(reduce_over(comm, p.grad), expected[name], **TOL[torch.float32])


# --- buffers, layout, unshard -------------------------------------------------------------------


def test_head_tail_order_and_inverse():
    assert head_tail_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert head_tail_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    for seq, cp in [(8, 2), (12, 3), (24, 4), (2, 1)]:
        order = head_tail_order(seq, cp)
        assert order[head_tail_inverse(seq, cp)].tolist() == list(range(seq))
    assert head_tail_order(8, 2) is head_tail_order(8, 2)  # cached


def test_buffers_sharded_and_restored(cp_mesh):
    """Inside: each rank holds chunks r and 2cp-1-r along the seq dim (the same Python
    object, so a module's buffer is local); after: the original values and strides, the
    no_restore buffer left local."""
    cp, rank = WORLD.size, WORLD.rank
    ids = torch.arange(3 * SEQ).view(3, SEQ)
    table = torch.arange(SEQ * 5.0).view(5, SEQ).t()  # seq dim 0 of a transposed (strided) view
    kept = torch.arange(SEQ)
    original = [ids.clone(), table.clone(), table.stride()]
    chunk = SEQ // (2 * cp)
    mine = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
    with context_parallel(cp_mesh, buffers=[ids, table, kept], buffer_seq_dims=[-1, 0, 0], no_restore_buffers={kept}):
        inside = [ids.clone(), table.clone(), kept.clone()]
    expected = [original[0][:, mine], original[1][mine], mine]
    if cp == 1:  # a no-op
        expected = [original[0], original[1], torch.arange(SEQ)]
    assert_all_ranks(all(torch.equal(a, b) for a, b in zip(inside, expected)), "wrong local slices")
    assert_all_ranks(torch.equal(ids, original[0]) and torch.equal(table, original[1]), "not restored")
    assert_all_ranks(table.stride() == original[2], f"strides {table.stride()} != {original[2]}")
    assert_all_ranks(torch.equal(kept, expected[2]), "a no_restore buffer was restored")


def ring_mode_on() -> bool:
    return any(isinstance(m, api._RingAttentionMode) for m in torch.overrides._get_current_function_mode_stack())


def test_mode_only_inside_and_restored_after_exception(cp_mesh):
    ids = torch.arange(SEQ)
    with context_parallel(cp_mesh, buffers=[ids], buffer_seq_dims=[0]):
        inside = ring_mode_on()
    assert_all_ranks(inside == (WORLD.size > 1) and not ring_mode_on(), "the mode is not exactly the block's")
    with contextlib.suppress(KeyError), context_parallel(cp_mesh, buffers=[ids], buffer_seq_dims=[0]):
        raise KeyError("inside")
    assert_all_ranks(torch.equal(ids, torch.arange(SEQ)), "not restored after an exception")
    assert_all_ranks(not ring_mode_on(), "the mode stayed on after an exception")
    with context_parallel(cp_mesh, buffers=[ids], buffer_seq_dims=[0]):  # not left "active"
        pass


@pytest.mark.parametrize("balanced, length", [(True, SEQ), (False, SEQ), (False, SEQ + 1)],
                         ids=["head_tail", "contiguous", "contiguous_uneven"])
def test_unshard_round_trip(cp_mesh, balanced, length, monkeypatch):
    monkeypatch.setattr(api._cp_options, "enable_load_balance", balanced)
    full = global_tensor((2, 3, length, 4), torch.float32)
    logits = full.clone()
    with context_parallel(cp_mesh, buffers=[logits], buffer_seq_dims=[2]):
        local = logits * 1.0
    (back,) = context_parallel_unshard(cp_mesh, [local], [2])
    assert_all_ranks(torch.equal(back, full), "unshard did not give the full tensor in natural order")


def test_unshard_is_differentiable(cp_mesh):
    full = global_tensor((SEQ, 3), torch.float64)
    x = full.clone()
    with context_parallel(cp_mesh, buffers=[x], buffer_seq_dims=[0]):
        leaf = x.clone().requires_grad_()
    weight = torch.arange(SEQ * 3.0, dtype=torch.float64).view(SEQ, 3)
    (context_parallel_unshard(cp_mesh, [leaf], [0])[0] * weight).sum().backward()
    # the gathered tensor is replicated: each rank's slice gets its own rows of the weight
    with context_parallel(cp_mesh, buffers=[weight], buffer_seq_dims=[0]):
        assert_close(leaf.grad, weight)


def test_mesh_of_size_one_is_a_no_op():
    mesh = init_device_mesh("cpu", (WORLD.size, 1), mesh_dim_names=("dp", "cp"))
    ids = torch.arange(SEQ)
    pointer = ids.data_ptr()
    q = global_tensor((1, 2, SEQ, 4), torch.float64)
    with context_parallel(mesh["cp"], buffers=[ids], buffer_seq_dims=[0]):
        untouched = ids.data_ptr() == pointer and ids.shape == (SEQ,)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert_all_ranks(untouched, "a size-1 mesh touched the buffers")
    assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=0, rtol=0)


# --- bad input -------------------------------------------------------------------------------


def enter(mesh, **kwargs):
    with context_parallel(mesh, **kwargs):
        pass


def test_bad_buffer_arguments(cp_mesh):
    ids = torch.arange(SEQ)
    param = torch.nn.Parameter(torch.zeros(SEQ))
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids, ids], buffer_seq_dims=[0, 0]), "twice")
    raises_everywhere(TypeError, lambda: enter(cp_mesh, buffers=[param], buffer_seq_dims=[0]), "nn.Parameter")
    dtensor = distribute_tensor(torch.zeros(SEQ), cp_mesh, [Replicate()])
    raises_everywhere(TypeError, lambda: enter(cp_mesh, buffers=[dtensor], buffer_seq_dims=[0]), "plain torch.Tensor")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids], buffer_seq_dims=[0, 1]), "one sequence dim")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids]), "one sequence dim")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids], buffer_seq_dims=[1]), "out of range")
    raises_everywhere(TypeError, lambda: enter(cp_mesh, buffers=[ids], buffer_seq_dims=[0.0]), "must be an int")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids], buffer_seq_dims=[0],
                                                no_restore_buffers={torch.arange(3)}), "subset")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids, torch.arange(SEQ + 2)],
                                                buffer_seq_dims=[0, 0]), "same sequence length")
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[ids.float().requires_grad_()],
                                                buffer_seq_dims=[0]), "requires grad")
    assert_all_ranks(torch.equal(ids, torch.arange(SEQ)), "a failed entry touched a buffer")


def test_bad_unshard_arguments(cp_mesh):
    local = torch.zeros(2, 4)
    raises_everywhere(ValueError, lambda: context_parallel_unshard(cp_mesh, [local], [0, 1]), "one dim per buffer")
    raises_everywhere(ValueError, lambda: context_parallel_unshard(cp_mesh, [local], [2]), "is not a dim")
    raises_everywhere(TypeError, lambda: context_parallel_unshard(cp_mesh, [local.tolist()], [0]), "torch.Tensor")
    if WORLD.size > 1:
        odd = torch.zeros(3, 4)  # a global length of 3 * cp cannot have been load balanced
        raises_everywhere(ValueError, lambda: context_parallel_unshard(cp_mesh, [odd], [0]), "2 * cp")
        uneven = torch.zeros(1 if WORLD.rank == 0 else 3, 4)  # no torch.chunk layout either
        raises_everywhere(ValueError, lambda: context_parallel_unshard(cp_mesh, [uneven], [0]), "")


def test_bad_input_on_one_rank_raises_everywhere(cp_mesh):
    if WORLD.size == 1:
        pytest.skip("needs ranks to disagree")
    ids = torch.arange(SEQ)
    mine = torch.nn.Parameter(torch.zeros(SEQ)) if WORLD.rank == 0 else torch.zeros(SEQ)
    raises_everywhere(TypeError, lambda: enter(cp_mesh, buffers=[mine], buffer_seq_dims=[0]), "nn.Parameter")
    longer = torch.arange(SEQ * (2 if WORLD.rank == WORLD.size - 1 else 1))
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[longer], buffer_seq_dims=[0]), "differ across")
    assert_all_ranks(torch.equal(ids, torch.arange(SEQ)), "")


def test_sequence_not_divisible(cp_mesh, monkeypatch):
    if WORLD.size == 1:
        pytest.skip("a mesh of size 1 is a no-op")
    cp = WORLD.size
    odd = torch.arange(2 * cp + cp)  # divisible by cp, not by 2 * cp
    raises_everywhere(ValueError, lambda: enter(cp_mesh, buffers=[odd], buffer_seq_dims=[0]), "2 * cp")
    monkeypatch.setattr(api._cp_options, "enable_load_balance", False)
    enter(cp_mesh, buffers=[odd], buffer_seq_dims=[0])  # contiguous torch.chunk pieces: any length


def test_nested_contexts_raise(cp_mesh):
    ids = torch.arange(SEQ)

    def nested():
        with context_parallel(cp_mesh, buffers=[ids], buffer_seq_dims=[0]):
            enter(cp_mesh)

    raises_everywhere(ValueError, nested, "nested")
    assert_all_ranks(torch.equal(ids, torch.arange(SEQ)), "outer buffers not restored")


def test_bad_mesh_and_rotate_method():
    mesh = init_device_mesh("cpu", (1, WORLD.size))
    raises_everywhere(ValueError, lambda: enter(mesh), "1-D mesh")
    raises_everywhere(TypeError, lambda: enter(WORLD), "DeviceMesh")
    raises_everywhere(ValueError, lambda: set_rotate_method("ring"), "rotate_method")
    raises_everywhere(ValueError, lambda: context_parallel_unshard(mesh, [], []), "1-D mesh")
