"""Every module fast path against the general path it stands in for (``mpidtensor.fast``).

Each case builds one model twice from the same seed, parallelizes both alike, and trains
them STEPS AdamW steps on the same batches: once with fast paths on, once under
``settings.override(fast_paths=False)`` (the style's input conversion, the module's own
forward on DTensors through dispatch, the output conversion). Losses, first gradients and
final parameters must agree, and every fast path the case exercises must have run with
them on (``hits > 0``) and never with them off: a comparison is never vacuous.

Tolerances: the bias-free Linear, embedding and gather paths run the kernels dispatch
runs on the same blocks, so the zoo Llama's first loss and gradients are bit-equal. A
biased Linear adds its bias after the product (Rowwise: after the all-reduce) where the
general path adds it inside ``addmm`` (Rowwise: as a Partial term before the all-reduce),
and the RMSNorm path runs the fused kernel (``_fused_rms_norm``) where the general path on
CPU runs ``rms_norm``'s decomposition (pow, mean, rsqrt, mul): BERT and the Llama block
agree to float32 rounding (ATOL). After an AdamW step results may part by rounding even from
bit-equal gradients: the optimizer steps parameters whose gradients and states lie back
to back in memory as one flat tensor (``mpidtensor.flat_runs``), and where the two paths
allocate gradients decides that; so later losses agree to ATOL and the parameters to
PARAM_ATOL (AdamW's update of a near-zero gradient amplifies rounding, see
``zoo_models.ADAM_EPS``).
"""
import sys
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor import DTensor, init_device_mesh
from mpidtensor.fast import registry
from mpidtensor.parallel import loss_parallel, parallelize_module
from mpidtensor.runtime.settings import settings
from zoo_models import ADAM_EPS, LR, PARAM_ATOL, ZOO, fully_shard_zoo, loss_of, shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, build_model, cross_entropy, parallelize_llama  # noqa: E402

WORLD = MPI.COMM_WORLD
STEPS = 2
ATOL = 1e-6
# every module path registered in mpidtensor.fast (and loss_parallel's); the cases together cover them
MODULE_PATHS = {"tp.linear", "tp.embedding", "tp.gather", "sp.norm", "loss.cross_entropy", "autograd.param_grad"}


def hits() -> dict[str, int]:
    return {p.name: p.hits for p in registry.paths()}


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with seeded noise on every parameter: the zero biases and unit norm weights
    of a fresh model would hide, in the first step, a path that mishandles them."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return model


def run(build, parallelize, step, batches, fast: bool):
    """(losses, first gradients, final parameters, the paths' hits) of STEPS AdamW steps."""
    model = parallelize(perturbed(build()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    before = hits()
    losses, grads = [], None
    with settings.override(fast_paths=fast):
        for batch in batches:
            loss = step(model, batch)
            grads = grads or {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            losses.append(loss)
    taken = {name: count - before.get(name, 0) for name, count in hits().items()}
    return torch.tensor(losses), grads, {n: full(p.detach()) for n, p in model.named_parameters()}, taken


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(build, parallelize, step, batches, paths: set[str], exact: bool = True) -> None:
    """Fast paths on and off train alike; each of ``paths`` ran on, none ran off. The first
    step's loss and gradients (the module paths alone) are bit-equal if ``exact``; the
    later losses and the parameters, after AdamW, agree to ATOL / PARAM_ATOL."""
    on = run(build, parallelize, step, batches, True)
    off = run(build, parallelize, step, batches, False)
    ran, ran_off = {n for n, c in on[3].items() if c}, {n for n, c in off[3].items() if c}
    assert_all_ranks(paths <= ran and not ran_off, f"on: {on[3]}, off: {off[3]}, expected {paths}")
    assert_all_ranks(on[1].keys() == off[1].keys(), "different parameters got gradients")
    if exact:
        same = torch.equal(on[0][0], off[0][0]) and all(torch.equal(g, off[1][n]) for n, g in on[1].items())
        assert_all_ranks(same, "the first step's loss or gradients differ with fast paths on and off")
    bad = {n: (g - off[1][n]).abs().max().item() for n, g in on[1].items()
           if not torch.allclose(g, off[1][n], atol=ATOL, rtol=1e-4)}
    assert_all_ranks(not bad, f"first gradients differ: {bad}")
    assert_all_ranks(torch.allclose(on[0], off[0], atol=ATOL, rtol=ATOL), f"losses {on[0]} vs {off[0]}")
    bad = {n: (p - off[2][n]).abs().max().item() for n, p in on[2].items()
           if not torch.allclose(p, off[2][n], atol=PARAM_ATOL)}
    assert_all_ranks(not bad, f"parameters differ: {bad}")


def zoo_step(dp_rank: int = 0, dp_size: int = 1):
    def step(model, batch):
        loss = loss_of(model, *shard(batch, dp_rank, dp_size))
        loss.backward()
        return loss.item()
    return step


ZOO_CASES = {  # (model, plan): the paths it takes, and whether the first step is bit-equal
    ("llama", "tp"): ({"tp.linear", "tp.embedding", "autograd.param_grad"}, True),
    ("llama", "tp+sp"): ({"tp.linear", "tp.embedding", "tp.gather", "autograd.param_grad"}, True),
    ("qwen2", "tp"): ({"tp.linear", "tp.embedding", "autograd.param_grad"}, False),  # q/k/v biases; padding_idx
    ("bert", "tp+sp"): ({"tp.linear", "tp.gather", "sp.norm", "autograd.param_grad"}, False),
}


@pytest.mark.parametrize("name, plan", list(ZOO_CASES))
def test_zoo(name, plan, mesh1d):
    """Hugging Face Llama with its own TP plan (vocabulary-parallel embedding, bias-free
    Linears) and with sequence parallelism (the sequence all-gather, reduce-scattering
    Linears); Qwen2's plan (biased q/k/v, an embedding with a padding row); BERT with SP:
    biased Colwise and Rowwise Linears, nn.LayerNorm on sequence shards."""
    zoo = ZOO[name]
    parallelize = zoo.tensor_parallel if plan == "tp" else zoo.sequence_parallel

    def build_parallel(model):
        parallelize(model, mesh1d)
        return model

    paths, exact = ZOO_CASES[name, plan]
    compare(zoo.build, build_parallel, zoo_step(), zoo.batches(STEPS), paths, exact)


def test_zoo_fsdp_tp():
    """FSDP over "dp" of the TP + SP Llama over "tp" (a 2x2 mesh at 4 ranks, 1 x n below)."""
    zoo = ZOO["llama"]
    mesh = init_device_mesh("cpu", (2, 2) if WORLD.size == 4 else (1, WORLD.size), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_group("dp")

    def build_parallel(model):
        zoo.sequence_parallel(model, mesh["tp"])
        return fully_shard_zoo(model, zoo, mesh["dp"])

    compare(zoo.build, build_parallel, zoo_step(dp.rank, dp.size), zoo.batches(STEPS),
            {"tp.linear", "tp.embedding", "autograd.param_grad"})


def test_zoo_moe_expert_parallel(mesh1d):
    """Mixtral: the dense TP plan plus ExpertParallel (all-reduce dispatch) on its experts."""
    from test_zoo_moe import batches, moe_model, tensor_parallel_plan

    def build_parallel(model):
        parallelize_module(model, mesh1d, tensor_parallel_plan(model))
        return model

    compare(lambda: moe_model("mixtral"), build_parallel, zoo_step(), batches(STEPS), {"tp.linear", "tp.embedding"})


def test_llama_tp_sp_block(mesh1d):
    """examples/llama.py's TP + SP plan (nn.RMSNorm on sequence shards) with loss_parallel."""
    kv = max(mesh1d.size(), 2)
    cfg = LlamaConfig(vocab_size=53, dim=16 * kv, n_layers=1, n_heads=2 * kv, n_kv_heads=kv, hidden_dim=96,
                      max_seq_len=12)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, cfg.vocab_size, (2, 13), generator=gen) for _ in range(STEPS)]

    def step(model, batch):
        with loss_parallel():
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
        return loss.full_tensor().item()

    paths = {"tp.linear", "tp.gather", "sp.norm", "loss.cross_entropy", "autograd.param_grad"}
    compare(lambda: build_model(cfg, seed=3), lambda m: parallelize_llama(m, mesh1d), step, batches, paths,
            exact=False)


# the paths tests/test_fast_paths_optim.py compares on and off
DISPATCH_AND_OPTIMIZER_PATHS = {"dispatch.local_plan", "dispatch.local_view", "dispatch.per_mesh", "dispatch.detach",
                                "optim.foreach", "optim.local_step", "optim.flat_runs"}


def test_paths_are_covered():
    """Every registered fast path has a differential case, here, in test_fast_paths_optim.py
    or (FSDP's) in test_fsdp_fastpath.py: a new one fails this test until it has one."""
    from test_fsdp_fastpath import FSDP_PATHS

    registered = {p.name for p in registry.paths()}
    covered = MODULE_PATHS | DISPATCH_AND_OPTIMIZER_PATHS | FSDP_PATHS
    assert_all_ranks(registered == covered, f"registered {sorted(registered)}, covered {sorted(covered)}")
