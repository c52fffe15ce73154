"""Every module fast path against the general path it stands in for (``mpidtensor.fast``).

Each case builds one model twice from the same seed, parallelizes both alike, and trains
them STEPS AdamW steps on the same batches: once with fast paths on, once under
``settings.override(fast_paths=False)`` (the style's input conversion, the module's own
forward on DTensors through dispatch, the output conversion). Losses, first gradients and
final parameters must agree, and every fast path the case exercises must have run with
them on (``hits > 0``) and never with them off: a comparison is never vacuous.

Tolerances: the Linear, embedding, gather and loss paths run the kernels dispatch runs on
the same blocks, so the zoo cases are bit-equal. The norm path runs the fused kernel
(``_fused_rms_norm``) where the general path on CPU runs ``rms_norm``'s decomposition
(pow, mean, rsqrt, mul), so the Llama block (its RMSNorms) agrees to float32 rounding:
1e-6 on losses and gradients, and PARAM_ATOL on the parameters after AdamW (whose update
of a near-zero gradient amplifies rounding, see ``zoo_models.ADAM_EPS``).
"""
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from helpers import assert_all_ranks
from mpidtensor import DTensor, init_device_mesh
from mpidtensor.fast import registry
from mpidtensor.parallel import from_hf_plan, loss_parallel, parallelize_module
from mpidtensor.runtime.settings import settings
from zoo_models import ADAM_EPS, LR, PARAM_ATOL, ZOO, fully_shard_zoo, loss_of, shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import LlamaConfig, build_model, cross_entropy, parallelize_llama  # noqa: E402

WORLD = MPI.COMM_WORLD
STEPS = 2
ATOL = 1e-6
# every module path registered in mpidtensor.fast (and loss_parallel's); the cases together cover them
MODULE_PATHS = {"tp.linear", "tp.embedding", "tp.gather", "sp.norm", "loss.cross_entropy"}


def hits() -> dict[str, int]:
    return {p.name: p.hits for p in registry.paths()}


def run(build, parallelize, step, batches, fast: bool):
    """(losses, first gradients, final parameters, the paths' hits) of STEPS AdamW steps."""
    model = parallelize(build())
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
    """Fast paths on and off train alike (bit-equal if ``exact``); each of ``paths`` ran on,
    none ran off."""
    on = run(build, parallelize, step, batches, True)
    off = run(build, parallelize, step, batches, False)
    ran, ran_off = {n for n, c in on[3].items() if c}, {n for n, c in off[3].items() if c}
    assert_all_ranks(paths <= ran and not ran_off, f"on: {on[3]}, off: {off[3]}, expected {paths}")
    if exact:
        same = (torch.equal(on[0], off[0]) and on[1].keys() == off[1].keys()
                and all(torch.equal(g, off[1][n]) for n, g in on[1].items())
                and all(torch.equal(p, off[2][n]) for n, p in on[2].items()))
        assert_all_ranks(same, "fast paths on and off are not bit-equal")
        return
    assert_all_ranks(torch.allclose(on[0], off[0], atol=ATOL, rtol=ATOL), f"losses {on[0]} vs {off[0]}")
    bad = {n: (g - off[1][n]).abs().max().item() for n, g in on[1].items()
           if not torch.allclose(g, off[1][n], atol=ATOL, rtol=1e-4)}
    assert_all_ranks(on[1].keys() == off[1].keys() and not bad, f"first gradients differ: {bad}")
    bad = {n: (p - off[2][n]).abs().max().item() for n, p in on[2].items()
           if not torch.allclose(p, off[2][n], atol=PARAM_ATOL)}
    assert_all_ranks(not bad, f"parameters differ: {bad}")


def zoo_step(dp_rank: int = 0, dp_size: int = 1):
    def step(model, batch):
        loss = loss_of(model, *shard(batch, dp_rank, dp_size))
        loss.backward()
        return loss.item()
    return step


@pytest.mark.parametrize("plan", ["tp", "tp+sp"])
def test_zoo_llama(plan, mesh1d):
    """Hugging Face Llama with its own TP plan (vocabulary-parallel embedding, Linears), and
    with sequence parallelism (the sequence all-gather, reduce-scattering Linears)."""
    zoo = ZOO["llama"]
    parallelize = zoo.tensor_parallel if plan == "tp" else zoo.sequence_parallel
    paths = {"tp.linear", "tp.embedding"} | ({"tp.gather"} if plan == "tp+sp" else set())

    def build_parallel(model):
        parallelize(model, mesh1d)
        return model

    compare(zoo.build, build_parallel, zoo_step(), zoo.batches(STEPS), paths)


def test_zoo_fsdp_tp():
    """FSDP over "dp" of the TP + SP Llama over "tp" (a 2x2 mesh at 4 ranks, 1 x n below)."""
    zoo = ZOO["llama"]
    mesh = init_device_mesh("cpu", (2, 2) if WORLD.size == 4 else (1, WORLD.size), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_group("dp")

    def build_parallel(model):
        zoo.sequence_parallel(model, mesh["tp"])
        return fully_shard_zoo(model, zoo, mesh["dp"])

    compare(zoo.build, build_parallel, zoo_step(dp.rank, dp.size), zoo.batches(STEPS), {"tp.linear", "tp.embedding"})


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

    paths = {"tp.linear", "tp.gather", "sp.norm", "loss.cross_entropy"}
    compare(lambda: build_model(cfg, seed=3), lambda m: parallelize_llama(m, mesh1d), step, batches, paths,
            exact=False)


def test_paths_are_covered():
    """The cases above name every module path registered (a new one needs a case)."""
    registered = {p.name for p in registry.paths() if p.name.split(".")[0] in ("tp", "sp", "loss")}
    assert_all_ranks(registered == MODULE_PATHS, f"registered {registered}, covered {MODULE_PATHS}")
