"""The Llama-style model of examples/llama.py with TP + SP + loss_parallel trains like one
process (losses and parameters over several AdamW steps) and runs exactly the collectives
of Megatron-style sequence parallelism, on the 1-D world mesh and on the "tp" sub-mesh of
a 2x2 mesh."""
import contextlib
import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Shard
from mpidtensor.tensor import validate
from mpidtensor.debug import CommDebugMode
from mpidtensor.parallel import loss_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, Transformer, build_model, cross_entropy, parallelize_llama  # noqa: E402

STEPS = 4
# AdamW moves a weight by about lr * m / sqrt(v): for a gradient entry near zero, the
# rounding of a sharded matmul's sums shifts that ratio, so parameters after STEPS steps
# agree to a small fraction of lr (1e-2) rather than to 1e-5; losses agree to 1e-5.
PARAM_ATOL = 5e-5
N_LAYERS = 2


def config(tp: int) -> LlamaConfig:
    """Both head counts divide by the TP size; the vocabulary (53) is uneven at 2-4 ranks.
    The sequence (12) and the SwiGLU width (96) divide by 1-4, as torch's plan needs (its
    ``from_local`` reads local tensors as even shards); mpidtensor's plan keeps the residual
    stream a DTensor and gives wo/w2 their inputs' global shape (``in_features``)."""
    kv = max(tp, 2)
    return LlamaConfig(vocab_size=53, dim=16 * kv, n_layers=N_LAYERS, n_heads=2 * kv, n_kv_heads=kv,
                       hidden_dim=96, max_seq_len=12)


def tokens(cfg: LlamaConfig) -> torch.Tensor:
    """A batch of 2 sequences of 12 inputs (+1 for the shifted labels), the same on every rank."""
    return torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))


def train(model: Transformer, batch: torch.Tensor, parallel: bool) -> torch.Tensor:
    """STEPS AdamW steps on one batch; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        logits = model(batch[:, :-1])
        if parallel:
            with loss_parallel():
                loss = cross_entropy(logits, batch[:, 1:])
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = cross_entropy(logits, batch[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def tp_mesh(request, name: str):
    if name == "1d":
        return request.getfixturevalue("mesh1d")
    return request.getfixturevalue("mesh2d")["tp"]  # each dp row trains the same data


@pytest.mark.parametrize("mesh_name", ["1d", "2d tp"])
def test_training_matches_one_process(request, mesh_name):
    mesh = tp_mesh(request, mesh_name)
    cfg = config(mesh.size())
    ref = build_model(cfg, seed=3)
    model = parallelize_llama(copy.deepcopy(ref), mesh)
    batch = tokens(cfg)
    ref_losses = train(ref, batch, parallel=False)
    losses = train(model, batch, parallel=True)
    assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert_all_ranks(ref_losses[-1] < ref_losses[0] - 0.5, f"the model does not learn: {ref_losses}")
    differ = {}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert_all_ranks(isinstance(p, DTensor), f"{name} is not a DTensor")
        full = p.full_tensor()
        if not torch.allclose(full, p_ref.detach(), atol=PARAM_ATOL, rtol=1e-5):
            differ[name] = (full - p_ref.detach()).abs().max().item()
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


def test_bad_tp_size_raises(mesh1d):
    """Head counts that do not divide by the TP size: ValueError on every rank."""
    if mesh1d.size() < 3:
        pytest.skip("needs a TP size that does not divide 2 KV heads")
    with pytest.raises(ValueError, match="multiples of the TP size"):
        parallelize_llama(build_model(config(2)), mesh1d)


def step_counts(model: Transformer, batch: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter]:
    """The collectives of one training step by phase: the model's forward, the loss, the
    backward (model and loss), the optimizer step. Besides CommDebugMode's counts, the
    all-gathers of local shapes that ``DTensor.from_local`` runs without ``shape=`` (an
    mpi4py object collective that CommDebugMode does not see) count as "shape_all_gather"."""
    shape_gathers = Counter()
    gather_shapes = validate.global_shape_from_locals

    def counted(local, mesh, placements):
        if any(isinstance(p, Shard) for p in placements):  # the only case that communicates
            shape_gathers["shape_all_gather"] += 1
        return gather_shapes(local, mesh, placements)

    monkeypatch.setattr(validate, "global_shape_from_locals", counted)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = {}

    @contextlib.contextmanager
    def phase(name):
        shape_gathers.clear()
        with CommDebugMode() as comm:
            yield
        counts[name] = comm.get_comm_counts() + shape_gathers

    with phase("forward"):
        logits = model(batch[:, :-1])
    with loss_parallel():
        with phase("loss"):
            loss = cross_entropy(logits, batch[:, 1:])
        with phase("backward"):
            loss.backward()
    with phase("optimizer"):
        opt.step()
        opt.zero_grad()
    return counts


# Megatron-style sequence parallelism, per step (the minimum; the shape all-gathers of
# from_local must be 0: the plan passes DTensors or global shapes). The residual stream is sequence-sharded;
# a TP region (embedding, attention, feed-forward, output projection) enters through one
# all-gather of its sequence-sharded input and leaves through one reduce-scatter of its
# partial output, and the backward mirrors each: a reduce-scatter for every forward
# all-gather, an all-gather for every forward reduce-scatter.
#   all-gathers:     before attention and before the feed-forward in each layer, and before
#                    the output projection                               -> 2 * N_LAYERS + 1
#   reduce-scatters: after the embedding (vocab-sharded rows -> sequence shards), after wo
#                    and after w2 in each layer                          -> 2 * N_LAYERS + 1
# The norms (SequenceParallel) and attention itself (local heads) need nothing.
REGIONS = 2 * N_LAYERS + 1
NORMS = 2 * N_LAYERS + 1
MEGATRON_SP = {
    "forward": Counter(all_gather=REGIONS, reduce_scatter=REGIONS),
    # vocab-parallel cross entropy: all-reduces of the row max, then of the row sum of exp
    # and of the target logit (Megatron runs these two as separate all-reduces; here they
    # are one stacked all-reduce); the mean's divisor, the token count, is known on every
    # rank from the whole targets
    "loss": Counter(all_reduce=2),
    # the backward mirrors the forward; the cross entropy's gradient, softmax - one_hot,
    # is local to each vocab shard; each replicated norm weight (two per layer and the
    # final norm) gets partial gradients from the sequence shards: one all-reduce each
    # (Megatron all-reduces them once after the backward; here SequenceParallel's
    # gradient hook does it in the backward)
    "backward": Counter(all_gather=REGIONS, reduce_scatter=REGIONS, all_reduce=NORMS),
    # every gradient is settled (Shard or Replicate): AdamW runs locally
    "optimizer": Counter(),
}


@pytest.mark.parametrize("mesh_name", ["1d", "2d tp"])
def test_tp_regions_communicate_like_megatron_sp(request, mesh_name, monkeypatch):
    """Forward and backward: exactly one all-gather and one reduce-scatter per TP region each
    (the all-reduces and the shape all-gathers are checked by the next test)."""
    mesh = tp_mesh(request, mesh_name)
    if mesh.size() == 1:
        pytest.skip("one rank needs no collectives (the next test checks that)")
    cfg = config(mesh.size())
    counts = step_counts(parallelize_llama(build_model(cfg), mesh), tokens(cfg), monkeypatch)
    for phase in ("forward", "backward"):
        gathers = Counter({k: v for k, v in counts[phase].items() if k in ("all_gather", "reduce_scatter")})
        expected = Counter(all_gather=REGIONS, reduce_scatter=REGIONS)
        assert_all_ranks(gathers == expected, f"{phase}: {dict(gathers)} != {dict(expected)}")
    assert_all_ranks(counts["forward"]["all_reduce"] == 0, f"forward all-reduces: {counts['forward']}")


@pytest.mark.parametrize("mesh_name", ["1d", "2d tp"])
def test_step_communicates_like_megatron_sp(request, mesh_name, monkeypatch):
    """The whole step, loss and optimizer included: exactly Megatron-SP's collectives."""
    mesh = tp_mesh(request, mesh_name)
    cfg = config(mesh.size())
    counts = step_counts(parallelize_llama(build_model(cfg), mesh), tokens(cfg), monkeypatch)
    expected = MEGATRON_SP if mesh.size() > 1 else {phase: Counter() for phase in MEGATRON_SP}
    diff = {phase: (dict(counts[phase]), dict(expected[phase]))
            for phase in expected if counts[phase] != expected[phase]}
    assert_all_ranks(not diff, f"(measured, Megatron-SP) per phase: {diff}")
