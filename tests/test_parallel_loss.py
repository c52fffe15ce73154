"""loss_parallel: cross entropy on class-sharded logits equals F.cross_entropy on the whole
logits, forward and backward (reductions, ignore_index, class weights, label smoothing,
2-D and 3-D logits, uneven class splits, 2x2 meshes), and never all-gathers the logits."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
from test_parallel import tp_mesh  # noqa: F401 (a fixture)

TOL = dict(atol=1e-5, rtol=1e-5)
CLASSES = 11  # uneven over 2-4 ranks


def _targets(shape, seed=2, ignore_index=-100):
    t = torch.randint(0, CLASSES, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::4] = ignore_index  # some ignored positions
    return t


def _reference(logits, target, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x, target, **kw)
    grad_out = global_tensor(tuple(loss.shape), seed=5)
    (loss * grad_out).sum().backward()
    return loss.detach(), x.grad, grad_out


def _check(mesh, placements, logits, target, **kw):
    """Loss and logit gradient under loss_parallel vs F.cross_entropy; returns the comm counts."""
    loss_ref, grad_ref, grad_out = _reference(logits, target, **kw)
    x = distribute_tensor(logits, mesh, placements).requires_grad_()
    with CommDebugMode() as comm:
        with loss_parallel():
            loss = F.cross_entropy(x, target, **kw)
            (loss * grad_out).sum().backward()
    assert_all_ranks(isinstance(loss, DTensor), type(loss).__name__)
    assert_close(loss.full_tensor(), loss_ref, **TOL)
    assert_close(x.grad.full_tensor(), grad_ref, **TOL)
    return loss, comm


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_cross_entropy(tp_mesh, reduction, ignore_index, weighted):
    logits = global_tensor((6, CLASSES))
    target = _targets((6,), ignore_index=ignore_index)
    weight = global_tensor((CLASSES,), seed=8).abs() + 0.1 if weighted else None
    loss, comm = _check(tp_mesh, [Shard(1)], logits, target, reduction=reduction,
                        ignore_index=ignore_index, weight=weight)
    assert_all_ranks(loss.placements == (Replicate(),), repr(loss.placements))
    # forward: the row max, then the stacked row sums (exp, target logit); the mean's
    # divisor comes from the whole targets; backward: softmax - one_hot, local
    expected = {"all_reduce": 2} if tp_mesh.size() > 1 else {}
    counts = comm.get_comm_counts()
    assert_all_ranks(dict(counts) == expected, f"two all-reduces of row statistics: {counts}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_label_smoothing(tp_mesh, reduction, weighted):
    logits = global_tensor((6, CLASSES))
    target = _targets((6,))
    weight = global_tensor((CLASSES,), seed=8).abs() + 0.1 if weighted else None
    _, comm = _check(tp_mesh, [Shard(1)], logits, target, reduction=reduction, label_smoothing=0.2, weight=weight)
    # the smoothing term's row sum rides in the second all-reduce: still two, of row statistics
    expected = {"all_reduce": 2} if tp_mesh.size() > 1 else {}
    counts = comm.get_comm_counts()
    assert_all_ranks(dict(counts) == expected, f"two all-reduces of row statistics: {counts}")
    moved = comm.get_comm_bytes()["all_reduce"]
    assert_all_ranks(moved <= 4 * 6 * 4, f"all-reduced {moved} bytes: more than 4 floats per sample")


def test_spatial_logits_and_module_api(tp_mesh):
    """(batch, class, seq) logits through nn.CrossEntropyLoss."""
    logits = global_tensor((3, CLASSES, 4))
    target = _targets((3, 4))
    loss_ref, grad_ref, grad_out = _reference(logits, target)
    x = distribute_tensor(logits, tp_mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = nn.CrossEntropyLoss()(x, target)
    (loss * grad_out).backward()  # backward may run outside the context
    assert_close(loss.full_tensor(), loss_ref, **TOL)
    assert_close(x.grad.full_tensor(), grad_ref, **TOL)


def test_one_sample(tp_mesh):
    logits = global_tensor((CLASSES,))
    _check(tp_mesh, [Shard(0)], logits, torch.tensor(4), reduction="sum")


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Replicate(), Shard(1)), (Shard(1), Shard(0))])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_2d_mesh(mesh2d, placements, reduction):
    """Batch sharded over "dp" (or replicated), classes over "tp", either way round; means
    over the global count. A sum over the batch-sharding mesh dim stays Partial."""
    logits = global_tensor((5, CLASSES))
    target = _targets((5,))
    loss, comm = _check(mesh2d, list(placements), logits, target, reduction=reduction)
    class_dim = placements.index(Shard(1))
    assert_all_ranks(loss.placements[class_dim] == Replicate(), repr(loss.placements))
    if reduction == "sum" and Shard(0) in placements:
        assert_all_ranks(loss.placements[1 - class_dim] == Partial(), repr(loss.placements))
    assert_all_ranks("all_gather" not in comm.get_comm_counts(), str(comm.get_comm_counts()))


def test_model_output_to_loss(tp_mesh):
    """The output projection column-parallel (vocab-sharded DTensor out) into loss_parallel,
    gradients into the sharded weight."""
    torch.manual_seed(1)
    ref = nn.Linear(6, CLASSES)
    model = parallelize_module(nn.Linear(6, CLASSES), tp_mesh, ColwiseParallel(use_local_output=False))
    with torch.no_grad():
        model.weight.copy_(distribute_tensor(ref.weight.detach(), tp_mesh, [Shard(0)]))
        model.bias.copy_(distribute_tensor(ref.bias.detach(), tp_mesh, [Shard(0)]))
    x, target = global_tensor((2, 6)), _targets((2,), seed=3)
    F.cross_entropy(ref(x), target).backward()
    with CommDebugMode() as comm:
        with loss_parallel():
            loss = F.cross_entropy(model(x), target)
            loss.backward()
    assert_close(loss.full_tensor(), F.cross_entropy(ref(x), target).detach(), **TOL)
    assert_close(model.weight.grad.full_tensor(), ref.weight.grad, **TOL)
    assert_all_ranks("all_gather" not in comm.get_comm_counts(), str(comm.get_comm_counts()))


@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_mean_divisor(tp_mesh, weighted):
    """F.nll_loss (mean) on class-sharded log-probabilities with whole targets: unweighted,
    the divisor (the count of non-ignored targets) is local; weighted, it sums the
    class-sharded weights of the targets: one all-reduce."""
    logits = global_tensor((6, CLASSES))
    target = _targets((6,))
    weight = global_tensor((CLASSES,), seed=8).abs() + 0.1 if weighted else None
    ref = F.nll_loss(F.log_softmax(logits, 1), target, weight=weight)
    logp = F.log_softmax(distribute_tensor(logits, tp_mesh, [Shard(1)]), 1)
    with CommDebugMode() as comm:
        loss = F.nll_loss(logp, target, weight=weight)
    assert_close(loss.full_tensor(), ref, **TOL)
    expected = {"all_reduce": 1} if weighted and tp_mesh.size() > 1 else {}
    assert_all_ranks(dict(comm.get_comm_counts()) == expected, str(comm.get_comm_counts()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_dtensor_target_on_2d_mesh(mesh2d, reduction):
    """A batch-sharded DTensor target: its rows pair with the logits' rows; the mean's
    divisor sums the local counts over the batch shards."""
    logits = global_tensor((5, CLASSES))
    target = _targets((5,))
    loss_ref, grad_ref, grad_out = _reference(logits, target, reduction=reduction)
    x = distribute_tensor(logits, mesh2d, [Shard(0), Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(x, distribute_tensor(target, mesh2d, [Shard(0), Replicate()]), reduction=reduction)
    (loss.full_tensor() * grad_out).sum().backward()
    assert_all_ranks(loss.placements[1] == Replicate(), repr(loss.placements))
    assert_close(loss.full_tensor(), loss_ref, **TOL)
    assert_close(x.grad.full_tensor(), grad_ref, **TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reduced_loss_is_one_node(tp_mesh, monkeypatch, reduction, smoothing):
    """A whole plain target and a reduced loss: one autograd node from the logits to the loss
    (no to_local / from_local, no dispatched sum or division), the logits' gradient in their
    spec; values and gradient as F.cross_entropy's."""
    from test_tp_local_linear import DispatchLog

    logits, target = global_tensor((6, CLASSES)), _targets((6,))
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, target, reduction=reduction, label_smoothing=smoothing).backward()
    x = distribute_tensor(logits, tp_mesh, [Shard(1)]).requires_grad_()
    log = DispatchLog(monkeypatch)
    with loss_parallel():
        loss = F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)
        loss.backward()
    assert_all_ranks(type(loss.grad_fn.next_functions[0][0]).__name__ == "AccumulateGrad",
                     str(loss.grad_fn.next_functions))
    # dispatch sees backward's seed (ones_like) and AccumulateGrad's detach only
    assert_all_ranks(sorted(log.ops) == ["aten.detach.default", "aten.ones_like.default"], str(log.ops))
    assert_all_ranks(x.grad._spec is x._spec and loss.placements == (Replicate(),), repr(x.grad._spec))
    assert_close(loss.full_tensor(),
                 F.cross_entropy(logits, target, reduction=reduction, label_smoothing=smoothing), **TOL)
    assert_close(x.grad.full_tensor(), ref.grad, **TOL)
