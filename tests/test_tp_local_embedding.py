"""The local path of a vocabulary-parallel ``RowwiseParallel`` ``nn.Embedding``
(fast/embedding.py): a step does Megatron's work only (no aten op through DTensor
dispatch; the weight's first gradient goes on ``.grad`` without AccumulateGrad's ``detach``,
``fast.grads``); one reduction forward, one all-gather backward
for a sharded output), equals one process (13 rows and 7 tokens: uneven shards at 2-4
ranks), takes any gradient layout, and hands over to the general path where it does not
apply (``max_norm``, tokens read as sharded); ``padding_idx`` stays local (its row gets no
gradient, on whichever rank holds it)."""
import copy

import pytest
import torch
from torch import nn

from helpers import CollectiveLog, assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard
from mpidtensor.parallel import RowwiseParallel, parallelize_module
from mpidtensor.fast.embedding import LocalEmbeddingForward
from test_parallel import full_of, tp_mesh  # noqa: F401 (a fixture)
from test_tp_local_linear import DispatchLog

TOL = dict(atol=1e-6, rtol=1e-6)


def embedding(vocab: int = 13, **kwargs) -> nn.Embedding:
    torch.manual_seed(11)
    return nn.Embedding(vocab, 5, **kwargs)


def tokens(vocab: int = 13, length: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(12))


def compare(ref: nn.Embedding, model: nn.Embedding, out, layout, downstream: str = "weighted",
            local_path: bool = True, ids: torch.Tensor | None = None) -> None:
    """Output and weight gradient against one process, for a fixed weighting of the output
    (its gradient in the output's layout) or a plain sum (a replicated gradient). The local
    path gives the gradient of this rank's rows only: the weight's own ``Shard(0)``. ``ids``:
    the tokens ``out`` was computed from (default :func:`tokens`)."""
    ids = tokens() if ids is None else ids
    want = ref(ids)
    got = full_of(out, model.weight.device_mesh, layout)
    assert_close(got, want, **TOL)
    if downstream == "sum" and isinstance(out, DTensor):
        out.sum().backward()
        want.sum().backward()
    else:
        weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(13))
        (got * weight).sum().backward()
        (want * weight).sum().backward()
    grad = model.weight.grad
    assert_all_ranks(isinstance(grad, DTensor) and (grad.placements == (Shard(0),) or not local_path), repr(grad))
    assert_close(grad.full_tensor(), ref.weight.grad, **TOL)


@pytest.mark.parametrize("output, local", [(Shard(1), False), (Shard(1), True), (Replicate(), True),
                                           (Replicate(), False), (Shard(0), False)])
def test_step_is_megatrons_work(tp_mesh, monkeypatch, output, local):
    ref = embedding()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=output, use_local_output=local))
    assert_all_ranks(isinstance(model._parallel_forward, LocalEmbeddingForward))
    log = DispatchLog(monkeypatch)
    with CollectiveLog() as comms:
        out = model(tokens())
        forward_comms = list(comms.calls)
    sharded = isinstance(output, Shard)
    if tp_mesh.size() > 1:
        assert_all_ranks(forward_comms == ["reduce_scatter" if sharded else "all_reduce"], str(forward_comms))
    assert_all_ranks(isinstance(out, DTensor) != local, type(out).__name__)
    assert_all_ranks(log.ops == [], str(log.ops))
    with CollectiveLog() as comms:
        compare(ref, model, out, output if local else None)
    if tp_mesh.size() > 1 and sharded and not local:  # the gradient's all-gather comes first
        assert_all_ranks(comms.calls[-2:] == ["all_gather", "all_gather"], str(comms.calls))


@pytest.mark.parametrize("case", ["plain", "accumulate", "hook"])
def test_param_grad_on_and_off(tp_mesh, case):
    """``fast.grads`` from the embedding's backward: the weight's gradient equals the one
    autograd's AccumulateGrad leaves (fast paths off); a second backward and a tensor hook
    take autograd's way."""
    from mpidtensor.fast.grads import PARAM_GRAD
    from mpidtensor.runtime.settings import settings
    results, hooked = [], []
    for fast in (True, False):
        model = parallelize_module(embedding(), tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                         output_layouts=Shard(1)))
        if case == "hook":
            model.weight.register_hook(lambda g: hooked.append(fast) or g * 2)
        before = PARAM_GRAD.hits
        with settings.override(fast_paths=fast):
            for _ in range(2 if case == "accumulate" else 1):
                (model(tokens()) ** 2).sum().backward()
        results.append((model.weight.grad.full_tensor(), PARAM_GRAD.hits - before))
    (on, hits_on), (off, hits_off) = results
    assert_close(on, off, **TOL)
    assert_all_ranks(hits_on == (0 if case == "hook" else 1) and hits_off == 0, f"hits on {hits_on}, off {hits_off}")
    assert_all_ranks(hooked == ([True, False] if case == "hook" else []), str(hooked))


def test_gradient_in_another_layout(tp_mesh):
    """A sequence-sharded output whose gradient comes replicated (``sum``'s backward)."""
    ref = embedding()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False))
    compare(ref, model, model(tokens()), None, downstream="sum")


@pytest.mark.parametrize("padding", [None, 2])
@pytest.mark.parametrize("output", [Shard(1), Replicate()])
def test_vocabulary_and_sequence_smaller_than_the_mesh(tp_mesh, output, padding):
    """3 rows and 1 position over up to 4 ranks: a rank may hold no row (its lookup is all
    zeros, its gradient block empty) and no position of a sequence-sharded output; with the
    last row as padding, the ranks without it (one of them empty) pass none."""
    ref = embedding(vocab=3, padding_idx=padding)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=output, use_local_output=False))
    assert_all_ranks(isinstance(model._parallel_forward, LocalEmbeddingForward))
    ids = tokens(vocab=3, length=1)
    if padding is not None:
        ids[0] = padding  # one sequence on the padding row, the other as drawn
    compare(ref, model, model(ids), None, ids=ids)


@pytest.mark.parametrize("padding", [0, 3, 6, 12, -1])
@pytest.mark.parametrize("output", [Shard(1), Replicate()])
def test_padding_idx_stays_local(tp_mesh, monkeypatch, padding, output):
    """13 rows over 2-4 ranks (uneven shards): the padding row first in a shard (0; 12 at 4
    ranks, a one-row shard), inside one (3, 6) or last (12, and -1, which ``nn.Embedding``
    makes 12). The tokens hit it several times; its gradient row is zero on the rank that
    holds it."""
    ref = embedding(padding_idx=padding)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=output, use_local_output=False))
    ids = tokens()
    ids[:, ::3] = ref.padding_idx
    log = DispatchLog(monkeypatch)
    out = model(ids)
    assert_all_ranks(log.ops == [], str(log.ops))
    compare(ref, model, out, None, ids=ids)
    assert_all_ranks(not ref.weight.grad[ref.padding_idx].any(), "the reference's padding row has a gradient")


@pytest.mark.parametrize("case", ["max_norm", "sharded tokens"])
def test_general_path_where_local_does_not_apply(tp_mesh, monkeypatch, case):
    ref = embedding(max_norm=1.0) if case == "max_norm" else embedding()
    given = Replicate() if case == "max_norm" else Shard(-1)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=given, output_layouts=Replicate(), use_local_output=False))
    log = DispatchLog(monkeypatch)
    ids = tokens()
    local_ids = ids
    if case == "sharded tokens":  # torch.chunk's layout: 7 tokens in chunks of ceil(7 / n)
        chunks, rank = ids.chunk(tp_mesh.size(), -1), tp_mesh.get_local_rank()
        local_ids = chunks[rank] if rank < len(chunks) else ids[:, :0]
    out = model(local_ids)
    assert_all_ranks("aten.embedding.default" in log.ops, str(log.ops))
    compare(ref, model, out, None, local_path=False)


def test_deepcopy_rebinds_forward(tp_mesh):
    ref = embedding()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False))
    twin = copy.deepcopy(model)
    assert_all_ranks(type(twin) is type(model) and twin._parallel_forward is not model._parallel_forward)
    compare(ref, twin, twin(tokens()), None)
    assert_all_ranks(model.weight.grad is None, "the original got a gradient")
