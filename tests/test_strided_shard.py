"""``_StridedShard``: torch's placement for a dim sharded in the opposite order (FSDP over a
TP-sharded dim, packed TP weights), against torch's definition and one process; and
transformers' packed plan styles (``packed_colwise``, ``moe_tp_experts``) on real models.
The redistribution sweep is in test_redistribute.py."""
import copy
import itertools
import pickle

import pytest
import torch
import transformers
from mpi4py import MPI

from helpers import assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor import DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor
from mpidtensor.parallel import ExpertTensorParallel, PackedColwiseParallel, from_hf_plan, parallelize_module
from mpidtensor.tensor.layout import dim_runs, local_shape_and_offset
from mpidtensor.tensor.placements import normalize_placements
from zoo_models import HEADS, SEQ, VOCAB, _tokens, check_trains_like_one_process

WORLD = MPI.COMM_WORLD
SS = _StridedShard


def test_construction_equality_repr():
    import mpidtensor.placements
    import mpidtensor.tensor.placements

    assert mpidtensor.placements._StridedShard is SS is mpidtensor.tensor.placements._StridedShard
    p = SS(0, split_factor=2)
    assert p == SS(0, sf=2) and hash(p) == hash(SS(0, split_factor=2))
    assert p != SS(0, split_factor=3) and p != SS(1, split_factor=2) and p != Shard(0) and Shard(0) != p
    assert not isinstance(p, Shard) and not p.is_shard() and not p.is_shard(0)  # as torch's
    assert not p.is_replicate() and not p.is_partial()
    assert repr(p) == "_StridedShard(dim=0, sf=2)" and str(p) == "_S(0, 2)"
    assert SS(1).split_factor == 1 and pickle.loads(pickle.dumps(p)) == p
    assert normalize_placements([SS(-1, split_factor=3), Replicate()], 2, 3) == (SS(2, split_factor=3), Replicate())
    with pytest.raises(TypeError):
        SS(0, split_factor=2, sf=2)
    with pytest.raises(ValueError, match="positive"):
        SS(0, split_factor=0)
    with pytest.raises(TypeError):
        SS(0, 2)  # split_factor is keyword-only, as in torch
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([SS(2, split_factor=2)], 1, 2)


@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 2), (2, 3), (3, 2, 2)])
def test_layout_is_torchs(mesh_shape):
    """Local shapes, first offsets and the indices held, for every coordinate, equal torch's
    (``_compute_local_shape_and_global_offset`` and its placements' ``_split_tensor``)."""
    import torch.distributed.tensor.placement_types as tp
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    kinds = [Shard(0), Replicate(), SS(0, split_factor=2), SS(0, split_factor=3)]
    problems = []
    for placements in itertools.product(kinds, repeat=len(mesh_shape)):
        theirs = [tp.Shard(0) if isinstance(p, Shard) else tp.Replicate() if isinstance(p, Replicate)
                  else tp._StridedShard(0, split_factor=p.split_factor) for p in placements]
        for length in (1, 5, 11, 12):
            for coord in itertools.product(*map(range, mesh_shape)):
                shape, offset = local_shape_and_offset((length,), placements, mesh_shape, coord)
                t_shape, t_offset = _compute_local_shape_and_global_offset((length,), mesh_shape, list(coord), theirs)
                held = torch.arange(length)
                for m, p in enumerate(theirs):
                    if not isinstance(p, tp.Replicate):
                        held = p._split_tensor(held, mesh_shape[m], with_padding=False)[0][coord[m]]
                mine = [i for o, n in dim_runs(length, 0, placements, mesh_shape, coord) for i in range(o, o + n)]
                if shape != t_shape or (shape[0] and offset != t_offset) or mine != held.tolist():
                    problems.append((placements, length, coord))
    assert not problems, problems[:5]


@pytest.mark.parametrize("shape", [(7, 5), (13, 2), (2, 3)])
@pytest.mark.parametrize("src_data_rank", [0, None])
def test_distribute_full_tensor_from_local(mesh1d, shape, src_data_rank):
    full = global_tensor(shape)
    for placements in ([SS(0, split_factor=2)], [SS(1, split_factor=2)], [SS(0, split_factor=3)]):
        d = distribute_tensor(full, mesh1d, placements, src_data_rank=src_data_rank)
        assert_close(d.full_tensor(), full)
        for check in (True, False):
            back = DTensor.from_local(d.to_local(), mesh1d, placements, run_check=check)  # shape implied
            assert_all_ranks(back.shape == full.shape and back.placements == tuple(placements), str(back.shape))
            assert_close(back.full_tensor(), full)


def test_2d_fsdp_tp_layout(mesh2d):
    """torch's docstring example: [_StridedShard(0, 2), Shard(0)] on a (dp, tp) mesh holds
    rows 2 * (2 * tp + dp) ... of an 8-row tensor: what sharding tp first, then dp, gives."""
    full = torch.arange(8.0).unsqueeze(1)
    d = distribute_tensor(full, mesh2d, [SS(0, split_factor=2), Shard(0)])
    dp, tp = mesh2d.get_coordinate()
    first = 2 * (2 * tp + dp)
    assert_close(d.to_local(), full[first:first + 2])
    right_to_left = full.chunk(2)[tp].chunk(2)[dp]
    assert_close(d.to_local(), right_to_left)


def _strided(mesh):
    return [SS(0, split_factor=2), Shard(0)] if mesh.ndim == 2 else [SS(0, split_factor=2)]


@pytest.fixture(params=["1d", "2d"])
def mesh(request, mesh1d):
    return request.getfixturevalue("mesh2d") if request.param == "2d" else mesh1d


def test_ops_against_one_process(mesh):
    """Pointwise ops and foreach keep the placement; other ops (matmul, reductions, views,
    softmax) give the right values, whatever placement they choose."""
    a, b, w = global_tensor((7, 5)), global_tensor((7, 5), seed=2), global_tensor((5, 3), seed=3)
    rep = [Replicate()] * mesh.ndim
    place = _strided(mesh)

    def fresh(x):
        return distribute_tensor(x, mesh, place)

    checks = {
        "add": (fresh(a) + fresh(b), a + b, True),
        "relu": (torch.relu(fresh(a)), torch.relu(a), True),
        "broadcast": (fresh(a) * distribute_tensor(b[:1], mesh, rep), a * b[:1], False),
        "plain": (fresh(a) + b, a + b, False),
        "mixed": (fresh(a) + distribute_tensor(b, mesh, [Shard(1)] * mesh.ndim), a + b, False),
        "mm": (fresh(a) @ distribute_tensor(w, mesh, rep), a @ w, False),
        "sum": (fresh(a).sum(), a.sum(), False),
        "sum0": (fresh(a).sum(0), a.sum(0), False),
        "softmax": (torch.softmax(fresh(a), 0), torch.softmax(a, 0), False),
        "view": (fresh(a).view(35), a.view(35), False),
        "t": (fresh(a).t(), a.t(), False),
        "clone": (fresh(a).clone(), a, True),
        "zeros_like": (torch.zeros_like(fresh(a)), torch.zeros_like(a), True),
    }
    x = fresh(a)
    x.add_(fresh(b))
    checks["add_"] = (x, a + b, True)
    x = fresh(a)
    x.copy_(fresh(b))
    checks["copy_"] = (x, b, True)
    xs = [fresh(a), fresh(b)]
    torch._foreach_mul_(xs, 2.0)
    checks["foreach"] = (xs[1], 2 * b, True)
    bad = []
    for name, (got, want, keeps) in checks.items():
        if not torch.allclose(got.full_tensor(), want, atol=1e-5):
            bad.append(f"{name}: values")
        if keeps and got.placements != tuple(place):
            bad.append(f"{name}: placements {got.placements}")
    assert_all_ranks(not bad, str(bad))


def test_inplace_ops_keep_strided_layout(mesh):
    """An in-place op whose rule does not place ``_StridedShard`` (it computes on Replicate)
    writes its result back into the strided DTensor's own local tensor: the placements and
    the storage stay (FSDP's sharded parameters are views of a flat buffer), the values
    equal one process."""
    a, w, v = global_tensor((7, 5)), global_tensor((5, 5), seed=3), global_tensor((7, 5), seed=4)
    rep = [Replicate()] * mesh.ndim
    ops = {
        "index_fill_": lambda t, r: t.index_fill_(1, torch.tensor([1, 3]), 2.5),
        "index_put_": lambda t, r: t.index_put_((torch.tensor([0, 4, 6]),), torch.tensor(-1.0)),
        "scatter_": lambda t, r: t.scatter_(1, torch.tensor([[0], [2], [4], [1], [3], [0], [2]]), 9.0),
        "addmm_": lambda t, r: t.addmm_(r(v), r(w)),
        "tril_": lambda t, r: t.tril_(),
    }
    bad = []
    for name, op in ops.items():
        x = distribute_tensor(a, mesh, _strided(mesh))
        local = x._local_tensor
        op(x, lambda t: distribute_tensor(t, mesh, rep))
        want = op(a.clone(), lambda t: t)
        if not torch.allclose(x.full_tensor(), want, atol=1e-5):
            bad.append(f"{name}: values")
        if x.placements != tuple(_strided(mesh)) or x._local_tensor is not local:
            bad.append(f"{name}: layout {x.placements}, same local {x._local_tensor is local}")
    assert_all_ranks(not bad, str(bad))


def test_gradients_and_optimizer(mesh):
    a = global_tensor((9, 4))
    param = torch.nn.Parameter(distribute_tensor(a, mesh, _strided(mesh)))
    ref = torch.nn.Parameter(a.clone())
    opts = [torch.optim.AdamW([p], lr=0.1) for p in (param, ref)]
    target = global_tensor((9, 4), seed=5)
    for _ in range(2):
        for p, opt in zip((param, ref), opts):
            ((p * p).sum() + (p.full_tensor() if isinstance(p, DTensor) else p).mul(target).sum()).backward()
            opt.step()
            opt.zero_grad()
    assert_all_ranks(param.placements == tuple(_strided(mesh)), str(param.placements))
    assert_close(param.full_tensor(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_from_local_wrong_shapes_raise_everywhere(mesh1d):
    if WORLD.size == 1:
        pytest.skip("one rank holds every shape")
    local = torch.ones(3 if WORLD.rank == 0 else 1, 2)
    raises_everywhere(ValueError, lambda: DTensor.from_local(local, mesh1d, [SS(0, split_factor=2)],
                                                             shape=(7, 2), stride=(2, 1), run_check=True))


# --- transformers' packed styles ----------------------------------------------------------------


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2 * HEADS, num_key_value_heads=HEADS, head_dim=4,
                max_position_embeddings=4 * SEQ, tie_word_embeddings=False)


def _model(config) -> torch.nn.Module:
    config._attn_implementation = "eager"
    # the experts one by one: torch's CPU grouped_mm wants 16-byte strides, which an uneven
    # rank's slice (11 of 32 features at 3 ranks) does not have
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _batches():
    gen = torch.Generator().manual_seed(7)
    return [_tokens(gen) for _ in range(3)]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_tp_experts_plan_trains_like_one_process(name, mesh1d):
    """The model's own tp_plan, moe_tp_experts and packed_colwise included, unchanged."""
    config = (transformers.MixtralConfig(num_local_experts=6, num_experts_per_tok=2, **_common()) if name == "mixtral"
              else transformers.Qwen2MoeConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20,
                                               shared_expert_intermediate_size=24, pad_token_id=0, **_common()))
    ref = _model(config)
    assert "moe_tp_experts" in ref.tp_plan.values() and "packed_colwise" in ref.tp_plan.values()
    model = copy.deepcopy(ref)
    plan = from_hf_plan(model.tp_plan, model=model)
    parallelize_module(model, mesh1d, plan)
    experts = model.model.layers[0].mlp.experts
    placements = {n: p.placements for n, p in experts.named_parameters()}
    assert_all_ranks(placements == {"gate_up_proj": (SS(1, split_factor=2),), "down_proj": (Shard(2),)},
                     str(placements))
    check_trains_like_one_process(model, ref, _batches())


def test_packed_colwise_module_trains_like_one_process(mesh1d):
    """Phi-3's fused gate_up_proj Linear as packed_colwise (its own plan gathers it instead)."""
    ref = _model(transformers.Phi3Config(pad_token_id=0, **_common()))
    model = copy.deepcopy(ref)
    plan = {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    parallelize_module(model, mesh1d, from_hf_plan(plan, model=model))
    weight = model.model.layers[0].mlp.gate_up_proj.weight
    assert_all_ranks(weight.placements == (SS(0, split_factor=2),), str(weight.placements))
    check_trains_like_one_process(model, ref, _batches())


def test_plan_errors():
    with pytest.raises(ValueError, match="moe_tp_experts weights"):
        from_hf_plan({"experts": "moe_tp_experts", "experts.gate_up_proj": "embedding_rowwise"})
    with pytest.raises(ValueError, match="no parameter placement"):
        ExpertTensorParallel({"w": "sequence_parallel"})
    plan = from_hf_plan({"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise",
                         "mlp.gate_up_proj": "packed_colwise"})
    assert set(plan) == {"experts", "mlp.gate_up_proj"} and isinstance(plan["mlp.gate_up_proj"], PackedColwiseParallel)
    assert plan["experts"].params == {"gate_up_proj": "packed_colwise"}


def test_partial_input_to_strided_is_a_reduce_scatter(mesh1d):
    from mpidtensor.debug import CommDebugMode

    d = DTensor.from_local(torch.ones(7, 3), mesh1d, [Partial()])
    with CommDebugMode() as comm:
        out = d.redistribute(mesh1d, [SS(0, split_factor=2)])
    expected = {} if WORLD.size == 1 else {"reduce_scatter": 1}
    assert_all_ranks(dict(comm.get_comm_counts()) == expected, str(comm.get_comm_counts()))
    assert_close(out.full_tensor(), torch.full((7, 3), float(WORLD.size)))


@pytest.mark.parametrize("even", [True, False])
def test_flatten_of_sequence_shard_is_strided_as_torchs(mesh, even):
    """A sequence-sharded ``(B, S, D)`` flattened to ``(B * S, D)``: torch's
    ``_StridedShard(0, split_factor=B)`` with no communication (S even over the mesh), kept by
    the matrix product and its backward, ``Shard(1)`` again when split back (torchtitan's
    MoE router under TP checks that it is); uneven S moves the shard first, as before. On a
    (dp, tp) mesh the batch is sharded over dp too (torchtitan's ``full_dtensor``): the
    split factor is a rank's rows, B / dp. Values and gradients against one process."""
    n = mesh.size(mesh.ndim - 1)
    dp = mesh.size(0) if mesh.ndim == 2 else 1
    b, s, d, o = 2 * dp, 2 * n + (0 if even else 1), 6, 3
    x, w = global_tensor((b, s, d)), global_tensor((o, d), seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    batch = [Shard(0)] if mesh.ndim == 2 else []
    dx = distribute_tensor(x.detach(), mesh, batch + [Shard(1)]).requires_grad_(True)
    dw = distribute_tensor(w.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_(True)
    flat = dx.view(b * s, d)
    out = torch.nn.functional.linear(flat, dw)
    y = out.view(b, s, o)
    want = torch.nn.functional.linear(x.view(b * s, d), w).view(b, s, o)
    bad = []
    if even:
        local = dx.to_local().reshape(-1, d)
        strided = tuple(batch + [SS(0, split_factor=b // dp)])
        if flat.placements != strided or not torch.equal(flat.to_local(), local):
            bad.append(f"flatten: {flat.placements}")
        if out.placements != strided or y.placements != tuple(batch + [Shard(1)]):
            bad.append(f"product / split back: {out.placements} / {y.placements}")
    if not torch.allclose(y.full_tensor(), want, atol=1e-5):
        bad.append("values")
    grad = global_tensor((b, s, o), seed=9)
    want.backward(grad)
    y.backward(distribute_tensor(grad, mesh, batch + [Shard(1)]))
    if not torch.allclose(dx.grad.full_tensor(), x.grad, atol=1e-5):
        bad.append("input gradient")
    if not torch.allclose(dw.grad.full_tensor(), w.grad, atol=1e-5):
        bad.append("weight gradient")
    assert_all_ranks(not bad, str(bad))


def test_strided_view_renumbers_and_splits(mesh1d):
    """``_StridedShard`` through a transpose and through an unflatten whose leading dims
    are its pieces (``Shard`` of the next dim), against one process."""
    n = mesh1d.size()
    x = global_tensor((3, 2 * n, 4))
    flat = distribute_tensor(x, mesh1d, [Shard(1)]).view(3 * 2 * n, 4)
    t = flat.t()
    back = flat.view(3, 2 * n, 4)
    other = flat.view(3, n, 8)  # pieces are not this split's leading dims alone: moved, right values
    checks = [(t, x.view(-1, 4).t(), (SS(1, split_factor=3),)), (back, x, (Shard(1),)), (other, x.view(3, n, 8), None)]
    bad = [i for i, (got, want, place) in enumerate(checks)
           if not torch.equal(got.full_tensor(), want) or (place is not None and got.placements != place)]
    assert_all_ranks(not bad, f"{bad}: {[c[0].placements for c in checks]}")
