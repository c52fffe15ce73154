"""torchao's quantized-training tensor subclasses under fully_shard (per block + root).

Each rank trains on its own slice of the batch; one process trains the same quantized
model (torchao's own single-process path) on the whole batch. The INT8 weights are
gathered through their ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (int8 rows +
scales), so every all-gather must refill the tensors the unsharded weight is built on.

Tolerances. Step 0 is deterministic: its loss and gradients match to float rounding
(1e-5). Later steps are not bit-comparable: torchao writes every optimizer update back
into the INT8 weight with *stochastic* rounding, drawing ``torch.rand_like`` for the
tensor it rounds, which is the whole weight in one process and one shard per rank; so
each step may put an element on a neighbouring level (one quantization step, ``lsb =
absmax / 127``). The weights then differ slightly, so do the gradients, and AdamW's
normalized update (about ``lr`` in size whatever the gradient's) may point the other
way for an element whose gradient is near zero: ``2 * lr`` more per step. Parameters
are compared to ``STEPS * (2 * LR + lsb)`` (absolute), losses to 2e-2. (Measured at 4
ranks: weights 5.5e-3 of 1.8e-2 allowed, the float parameters 1.4e-5, losses 4.6e-4.)
BitNet and INT8 mixed precision keep float weights and quantize deterministically in
forward: they match to 1e-5 throughout (measured: 3e-8).
"""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor.fsdp import MixedPrecisionPolicy, fully_shard

torchao_quant = pytest.importorskip("torchao.quantization")
qt = pytest.importorskip("torchao.prototype.quantized_training")
from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4  # noqa: E402

WORLD = MPI.COMM_WORLD
STEPS = 3
LR = 2e-3
PER_RANK = 2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Net(nn.Module):
    """Quantizable layers whose dim 0 (20, 10) does not divide by 3 (and 10 not by 4), and a float head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 20), nn.Linear(20, 10)])
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def _model(config) -> Net:
    torch.manual_seed(0)
    net = Net()
    torchao_quant.quantize_(net.layers, config())
    return net


def _batch():
    x = global_tensor((PER_RANK * WORLD.size, 16), seed=5)
    target = torch.randint(0, 5, (PER_RANK * WORLD.size,), generator=torch.Generator().manual_seed(6))
    return x, target


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") else t


def _train(net, x, target, *, losses_over_world: bool, before_forward=None):
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)  # torchao INT8 has no mul_
    losses, grads0 = [], None
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # the stochastic rounding draws
        if before_forward is not None:
            before_forward(net)
        loss = F.cross_entropy(net(x), target)
        loss.backward()
        if step == 0:
            grads0 = [p.grad.full_tensor() if losses_over_world else p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size if losses_over_world else loss.item())
    return torch.tensor(losses), grads0


def _full(p) -> torch.Tensor:
    """A sharded parameter's global value, dequantized (gathered by its local pieces: the
    INT8 subclass has no ``full_tensor`` path of its own)."""
    local = _dequantized(p._local_tensor).detach().float()
    pieces = WORLD.allgather(local)
    return torch.cat(pieces, dim=0)


def _compare(config, mp_policy=None, before_forward=None, stochastic=False):
    x, target = _batch()
    ref = _model(config)
    ref_losses, ref_grads = _train(ref, x, target, losses_over_world=False)

    net = _model(config)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in net.layers:
        fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    rows = slice(WORLD.rank * PER_RANK, (WORLD.rank + 1) * PER_RANK)
    losses, grads = _train(net, x[rows], target[rows], losses_over_world=True, before_forward=before_forward)

    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    assert_all_ranks(finite, "non-finite step-0 gradient under fully_shard")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, atol=1e-5, rtol=1e-4)
    assert_close(losses[0], torch.tensor(ref_losses[0]), atol=1e-5, rtol=1e-5)
    assert_close(losses, ref_losses, atol=2e-2 if stochastic else 1e-5, rtol=0)
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        local = p._local_tensor
        assert_all_ranks(type(local) is type(r.detach()), f"{name}: {type(local).__name__} != {type(r).__name__}")
        flatten = getattr(local, "__tensor_flatten__", None)
        inner = [getattr(local, n) for n in flatten()[0]] if flatten is not None else []
        owned = all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in inner)
        assert_all_ranks(owned, f"{name}: the shard keeps a larger tensor alive")
        expected = _dequantized(r.detach()).float()
        lsb = float(expected.abs().amax()) / 127 if hasattr(r, "dequantize") else 0.0
        assert_close(_full(p), expected, atol=STEPS * (2 * LR + lsb) if stochastic else 1e-5, rtol=0)


def test_int8_weight_only_training_matches_one_process():
    _compare(qt.int8_weight_only_quantized_training, stochastic=True)


def test_int8_weight_only_training_reduce_dtype():
    """Gradients reduced in float64 (a dtype neither the weight nor its gathered pieces have)."""
    _compare(qt.int8_weight_only_quantized_training, MixedPrecisionPolicy(reduce_dtype=torch.float64), stochastic=True)


def _bitnet_scales(net) -> None:
    """What torchao's ``precompute_bitnet_scale_for_fsdp`` does for torch's DTensor (and
    its ``fsdp_pre_all_gather`` otherwise does with ``torch.distributed``): give each
    sharded BitNet weight the abs-mean of the whole weight, here from one all-reduce."""
    weights = [p for p in net.parameters() if isinstance(p._local_tensor, qt.BitNetTrainingLinearWeight)]
    sums = torch.stack([w._local_tensor._data.float().abs().sum() for w in weights])
    totals = torch.from_numpy(WORLD.allreduce(sums.numpy()))
    for w, total in zip(weights, totals):
        w._local_tensor._precomputed_scale = total / w.numel()


def test_bitnet_training_matches_one_process():
    _compare(qt.bitnet_training, before_forward=_bitnet_scales)


def test_int8_mixed_precision_training_matches_one_process():
    _compare(qt.int8_mixed_precision_training)


# --- QLoRA: frozen NF4 base weights, trained LoRA adapters (torchtune's recipe) ------------------
NF4_DIM = 768  # rows split into whole NF4 scaler blocks (64 x 256 values) over 1-4 ranks
LORA_RANK = 8


class QLoRALinear(nn.Module):
    """A frozen NF4 weight plus a trained low-rank adapter, as torchtune's ``LoRALinear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(LORA_RANK, weight.shape[1]) / weight.shape[1] ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(weight.shape[0], LORA_RANK) * 0.01)

    def forward(self, x):
        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


class QLoRABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(NF4_DIM)
        self.up = QLoRALinear(torch.randn(NF4_DIM, NF4_DIM) / NF4_DIM ** 0.5)
        self.down = QLoRALinear(torch.randn(NF4_DIM, NF4_DIM) / NF4_DIM ** 0.5)
        self.norm.weight.requires_grad_(False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


def _qlora_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(QLoRABlock(), QLoRABlock())


def _qlora_train(net, x, *, over_world: bool):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR)
    losses, grads0 = [], None
    for step in range(STEPS):
        loss = net(x).pow(2).mean()
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.full_tensor() if over_world else p.grad.clone()
                      for n, p in net.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size if over_world else loss.item())
    return torch.tensor(losses), grads0


def test_qlora_nf4_training_matches_one_process():
    """torchao's NF4 weights gather as flat quantized data through their FSDP hooks (which
    ask ``mesh.get_group().size()``), are sharded with ``split`` / ``new_zeros`` / ``copy_``
    as torch's FSDP2 shards them (NF4's ``clone`` re-quantizes), and stay frozen; the
    adapters train like one process's."""
    x = global_tensor((PER_RANK * WORLD.size, 3, NF4_DIM), seed=7)
    ref = _qlora_model()
    ref_losses, ref_grads = _qlora_train(ref, x, over_world=False)
    net = _qlora_model()
    for block in net:
        fully_shard(block)
    fully_shard(net)
    rows = slice(WORLD.rank * PER_RANK, (WORLD.rank + 1) * PER_RANK)
    losses, grads = _qlora_train(net, x[rows], over_world=True)
    assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4)
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert_close(p.full_tensor(), r.detach(), atol=1e-5, rtol=1e-5)
        else:
            local = p._local_tensor
            assert_all_ranks(type(local) is type(r.detach()), f"{name}: {type(local).__name__}")
    base = net[0].up.weight._local_tensor
    nf4 = ref[0].up.weight
    part = slice(WORLD.rank * base.quantized_data.numel(), (WORLD.rank + 1) * base.quantized_data.numel())
    assert_all_ranks(torch.equal(base.quantized_data, nf4.quantized_data[part]), "the NF4 shard is not the weight's")


def test_qlora_full_state_dict_as_torchtune_gathers_it():
    """torchtune's final QLoRA checkpoint: ``full_tensor()`` of each sharded parameter, an
    NF4 one dequantized with ``.to(dtype)`` (its ``gather_cpu_state_dict``). NF4 gathers
    itself (its functional all-gather over its inner tensors, carried by MPI): the result is
    the one-process NF4 weight, and so is ``get_model_state_dict(full_state_dict=True)``'s."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from mpidtensor.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ref = _qlora_model()
    net = _qlora_model()
    for block in net:
        fully_shard(block)
    fully_shard(net)
    expected = ref.state_dict()
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "nf4")
    bad = []
    for key, param in net.state_dict().items():
        full = param.full_tensor()
        if isinstance(expected[key], NF4Tensor):
            if not isinstance(full, NF4Tensor) or any(
                    not torch.equal(getattr(full, name), getattr(expected[key], name)) for name in inner):
                bad.append(f"{key}: gathered {type(full).__name__} is not the NF4 weight")
                continue
            full, want = full.to(torch.float32), expected[key].to(torch.float32)
        else:
            want = expected[key]
        if full.shape != want.shape or not torch.equal(full, want):
            bad.append(f"{key}: values differ")
    gathered = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if WORLD.rank == 0:
        bad += [f"full state dict {key}: {type(v).__name__}" for key, v in gathered.items()
                if type(v) is not type(expected[key])]
        bad += [f"full state dict {key}: values differ" for key, v in gathered.items()
                if not torch.equal(v.to(torch.float32), expected[key].to(torch.float32))]
    assert_all_ranks(not bad, "; ".join(bad))


# --- float8 training with float8 all-gathers ----------------------------------------------------
def _float8_model(all_gather: bool) -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 64))
    convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def _float8_train(net, x):
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), [p.full_tensor() for p in net.parameters()]


def test_float8_all_gather_casts_with_the_whole_weights_scale():
    """Each rank casts its shard to float8 before the all-gather, all with the scale of the
    whole weight (torchao reduces the amax through torch.distributed, which an MPI job lacks:
    ``fsdp.float8``); so training matches the same float8 training that gathers float32
    weights and casts them whole, bit for bit (as in torch's FSDP2), at rows that do not
    divide by 3 (128 / 3: padded shards) too. ``full_tensor`` reads the float8 weights'
    values (a wrapper subclass has no memory of its own for MPI)."""
    x = global_tensor((PER_RANK * WORLD.size, 64), seed=8)[WORLD.rank * PER_RANK:(WORLD.rank + 1) * PER_RANK]
    losses, params = _float8_train(_float8_model(all_gather=True), x)
    ref_losses, ref_params = _float8_train(_float8_model(all_gather=False), x)
    assert_close(losses, ref_losses, atol=0, rtol=0)
    for p, r in zip(params, ref_params):
        assert_close(p, r, atol=0, rtol=0)


def test_qlora_load_state_dict_copies_into_the_nf4_shards():
    """``load_state_dict`` copies each value in with ``copy_``, and NF4's ``copy_`` returns
    None: the DTensor keeps its (now overwritten) NF4 shard rather than losing it."""
    net, other = _qlora_model(), _qlora_model()
    with torch.no_grad():
        other[0].up.lora_a.add_(1.0)
    for model in (net, other):
        for block in model:
            fully_shard(block)
        fully_shard(model)
    net.load_state_dict(other.state_dict())
    bad = []
    for (key, mine), theirs in zip(net.state_dict().items(), other.state_dict().values()):
        a, b = mine._local_tensor, theirs._local_tensor
        if type(a) is not type(b):
            bad.append(f"{key}: {type(a).__name__} after loading a {type(b).__name__}")
        elif not torch.equal(a.quantized_data if hasattr(a, "quantized_data") else a,
                             b.quantized_data if hasattr(b, "quantized_data") else b):
            bad.append(f"{key}: values differ")
    assert_all_ranks(not bad, "; ".join(bad))
