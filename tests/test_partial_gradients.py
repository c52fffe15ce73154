"""Partial gradients leaving DTensor through ``from_local`` (issue 38): the local term of
a ``Partial`` output gets the whole gradient, even when the gradient arrives as that same
``Partial`` (as torch 2.13's ``from_local`` guarantees: Partial forward, Replicate
gradient). Handing each rank its own term of the gradient instead made a vocab-parallel
embedding written with ``local_map`` (torchtitan's) take the wrong gradient once a
redistribute's backward kept its gradient Partial (torch's rule). Each case against one
process, on 1-D and 2-D meshes with uneven shards.
"""
import pytest
import torch

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.experimental import local_map


def _rank_terms(grad: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's term of a gradient that is Partial on the Partial mesh dims: differs
    along those dims, equal along the others (a seed from the coordinates there)."""
    seed = sum(mesh.get_local_rank(m) * 10 ** m for m, p in enumerate(placements) if p.is_partial())
    return grad * (1 + seed) + global_tensor(grad.shape, seed=seed)


# (mesh, weight placements): the Partial dims of the output are those where the weight's
# rows are sharded
CASES = [("1d", [Shard(0)]), ("2d", [Shard(0), Shard(0)]), ("2d", [Replicate(), Shard(0)]),
         ("2d", [Shard(0), Replicate()])]


@pytest.mark.parametrize("via", ["direct", "redistribute"])
@pytest.mark.parametrize("mesh_kind,placements", CASES)
def test_from_local_partial_gradient(request, mesh_kind, placements, via):
    """``out_r = a_r @ W_r`` over a row-sharded ``W`` (uneven rows), wrapped as Partial with
    ``from_local``; its gradient arrives Partial, directly or through a Partial-to-Replicate
    redistribute (whose backward keeps it Partial): W's gradient is one process's
    ``outer(a, G)``, G the gradient's full value."""
    mesh = request.getfixturevalue("mesh1d" if mesh_kind == "1d" else "mesh2d")
    rows = 3 * mesh.size() + 1
    a, w = global_tensor((rows,)), global_tensor((rows, 5), seed=3)
    out_placements = [Partial() if isinstance(p, Shard) else Replicate() for p in placements]
    wd = distribute_tensor(w, mesh, placements).requires_grad_()
    a_local = distribute_tensor(a, mesh, placements).to_local()
    y = DTensor.from_local(a_local @ wd.to_local(), mesh, out_placements)
    grad = DTensor.from_local(_rank_terms(global_tensor((5,), seed=7), mesh, out_placements), mesh, out_placements)
    if via == "redistribute":
        y.redistribute(mesh, out_placements).redistribute(mesh, [Replicate()] * mesh.ndim).backward(grad)
    else:
        y.backward(grad)
    assert_all_ranks(wd.grad.placements == tuple(placements), f"{wd.grad.placements}")
    assert_close(wd.grad.full_tensor(), torch.outer(a, grad.full_tensor()))


def _vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab: int, mesh) -> torch.Tensor:
    """torchtitan's vocab-parallel embedding on this rank's rows (``torch.chunk``'s layout):
    the rows of the tokens outside them masked to zero, the sum over ranks the lookup."""
    chunk = -(-vocab // mesh.size())
    offset = mesh.get_local_rank() * chunk
    mask = (tokens >= offset) & (tokens < offset + weight.shape[0])
    out = torch.nn.functional.embedding((tokens - offset).clamp(0, weight.shape[0] - 1), weight)
    return out * mask.unsqueeze(-1).to(out.dtype)


def test_vocab_parallel_embedding_block(mesh1d):
    """The torchtitan pattern that found it: a ``local_map`` vocab-parallel embedding
    (Partial out, redistributed to Replicate), then a column- and a row-parallel matmul
    with a residual; the column-parallel matmul's input gradient is Partial, so the
    embedding's output gradient arrives Partial. Every parameter's gradient is one process's."""
    n = mesh1d.size()
    vocab, dim, hidden = 3 * n + 1, 5, 2 * n + 1
    tokens = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(5))
    weights = [global_tensor(s, seed=k) for k, s in enumerate([(vocab, dim), (dim, hidden), (hidden, dim)])]
    scale = global_tensor((2, 7, dim), seed=9)

    def block(emb, w1, w2, lookup):
        x = lookup(tokens, emb)
        return ((x + torch.relu(x @ w1) @ w2) * scale).sum()

    ref = [w.clone().requires_grad_() for w in weights]
    loss_ref = block(*ref, lambda t, e: torch.nn.functional.embedding(t, e))
    loss_ref.backward()

    params = [distribute_tensor(w, mesh1d, [p]).requires_grad_()
              for w, p in zip(weights, [Shard(0), Shard(1), Shard(0)])]
    lookup = local_map(lambda t, e: _vocab_parallel_embedding(t, e, vocab, mesh1d), out_placements=[Partial()],
                       in_placements=(None, [Shard(0)]), device_mesh=mesh1d)
    seen = []

    def replicated_lookup(t, e):
        x = lookup(t, e).redistribute(mesh1d, [Replicate()])
        x.register_hook(lambda g: seen.append(g.placements))
        return x

    loss = block(*params, replicated_lookup)
    loss.backward()
    assert_close(loss.full_tensor(), loss_ref.detach())
    if n > 1:  # the case of the bug: the embedding's gradient arrives Partial
        assert_all_ranks(seen == [(Partial(),)], f"embedding output gradient {seen}")
    for name, p, r in zip(["embedding", "w1", "w2"], params, ref):
        assert_close(p.grad.full_tensor(), r.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("grad_kind", ["partial", "replicate"])
@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_partial_local_round_trip_gradient(request, mesh_kind, grad_kind):
    """A Partial DTensor through ``to_local`` and back through ``from_local`` is the same
    tensor: its gradient is the output's, whether that arrives Partial or Replicate
    (``to_local``'s backward takes a Partial's gradient as Replicate, as torch 2.13's)."""
    mesh = request.getfixturevalue("mesh1d" if mesh_kind == "1d" else "mesh2d")
    partial = [Partial()] * mesh.ndim
    x = DTensor.from_local(global_tensor((2 * mesh.size() + 1, 3)), mesh, partial).detach().requires_grad_()
    y = DTensor.from_local(x.to_local() * 2, mesh, partial)
    grad_placements = partial if grad_kind == "partial" else [Replicate()] * mesh.ndim
    terms = _rank_terms(global_tensor((2 * mesh.size() + 1, 3), seed=4), mesh, grad_placements)
    grad = DTensor.from_local(terms, mesh, grad_placements)
    y.backward(grad)
    assert_close(x.grad.full_tensor(), 2 * grad.full_tensor())


def test_partial_to_replicate_backward_settles_partial_gradient(mesh1d):
    """A Partial -> Replicate redistribute whose gradient arrives Partial settles it (one
    all-reduce, shared by everything behind it); only a Partial -> same Partial keeps it
    (torch keeps it in both: torchtitan's TP step then reduced it once per matrix product
    behind, 25 collectives a step where this takes 19)."""
    from mpidtensor.debug import CommDebugMode

    full = global_tensor((5, 3))
    pt = DTensor.from_local(full / mesh1d.size(), mesh1d, [Partial()]).detach().requires_grad_()
    terms = _rank_terms(global_tensor((5, 3), seed=2), mesh1d, [Partial()])
    grad = DTensor.from_local(terms, mesh1d, [Partial()])
    with CommDebugMode() as comm:
        pt.redistribute(mesh1d, [Replicate()]).backward(grad)
    expected = 2 if mesh1d.size() > 1 else 0  # the forward's all-reduce and the gradient's
    assert_all_ranks(pt.grad.placements == (Replicate(),) and comm.get_total_counts() == expected,
                     f"{pt.grad.placements} {comm.get_comm_counts()}")
    assert_close(pt.grad.full_tensor(), grad.full_tensor())


@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_gradient_specs_looked_up_equal_computed(request, mesh_kind):
    """``from_local``, ``to_local`` and ``redistribute`` look their gradient's spec up once per
    (forward spec, gradient spec): the gradients of a second backward (cache hits) and of one
    after ``clear_cache()`` (computed afresh) equal the first's bit for bit, with the same
    placements, global and local strides. Cases: to_local's gradient contiguous, transposed,
    with grad_placements; redistribute's Shard -> Replicate, Partial -> Replicate, Partial ->
    same Partial; from_local's Partial and Shard inputs; uneven shards."""
    import mpidtensor
    mesh = request.getfixturevalue("mesh1d" if mesh_kind == "1d" else "mesh2d")
    n = 2 * mesh.size() + 1
    partial, shard, rep = [Partial()] * mesh.ndim, [Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim

    def step():
        la, lc = global_tensor((n, 3)).requires_grad_(), global_tensor((3, 5), seed=3).requires_grad_()
        a, c = DTensor.from_local(la, mesh, partial), DTensor.from_local(lc, mesh, rep)
        b = distribute_tensor(global_tensor((n, 3), seed=2), mesh, shard).requires_grad_()
        a.retain_grad()
        c.retain_grad()
        out = (a.redistribute(mesh, rep) * 2).to_local().sum()
        out = out + (b.redistribute(mesh, rep).to_local() ** 2).sum()
        out = out + (a * 3).redistribute(mesh, partial).to_local(grad_placements=partial).sum()
        out = out + (c.to_local().t() * global_tensor((5, 3), seed=4)).sum()  # a transposed gradient
        out.backward()
        grads = [(g.placements, g.shape, g.stride(), g._local_tensor.stride(), g._local_tensor)
                 for g in (a.grad, b.grad, c.grad)]
        return grads + [(None, g.shape, g.stride(), None, g) for g in (la.grad, lc.grad)]

    first, second = step(), step()
    mpidtensor.clear_cache()
    fresh = step()
    same = all(x[:4] == y[:4] == z[:4] and torch.equal(x[4], y[4]) and torch.equal(x[4], z[4])
               for x, y, z in zip(first, second, fresh))
    assert_all_ranks(same, f"{[x[:4] for x in first]} {[x[:4] for x in second]} {[x[:4] for x in fresh]}")


@pytest.mark.parametrize("w_placement", [Shard(0), Shard(1), Replicate()])
@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_local_tensor_mixed_into_dtensor_op_gradient(request, mesh_kind, w_placement):
    """A replicated DTensor's local tensor multiplied by a DTensor (the plain tensor taken as
    Replicate): the gradient ``to_local``'s backward receives is then a DTensor (Partial when
    ``w`` is row-sharded). It is reduced to the local tensor's whole gradient; it used to be
    wrapped as the local tensor of another DTensor (a DTensor nested in a DTensor)."""
    mesh = request.getfixturevalue("mesh1d" if mesh_kind == "1d" else "mesh2d")
    rows, inner, cols = 2 * mesh.size() + 1, 2 * mesh.size() + 3, 3
    a_full, w_full = global_tensor((rows, inner)), global_tensor((inner, cols), seed=5)
    a = distribute_tensor(a_full, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    w = distribute_tensor(w_full, mesh, [w_placement] * mesh.ndim).requires_grad_()
    y = torch.mm(a.to_local(), w) * 3
    g = global_tensor((rows, cols), seed=6)
    (y.full_tensor() * g).sum().backward()
    a_ref, w_ref = a_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (torch.mm(a_ref, w_ref) * 3 * g).sum().backward()
    assert_all_ranks(type(a.grad._local_tensor) is torch.Tensor, f"nested: {type(a.grad._local_tensor)}")
    assert_close(a.grad.full_tensor(), a_ref.grad)
    assert_close(w.grad.full_tensor(), w_ref.grad)
