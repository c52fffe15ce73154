"""The all-gather extension: a tensor subclass gathered in its own (int8 + scales) format."""
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils._pytree import tree_map_only

from helpers import assert_all_ranks, assert_close, global_tensor
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import fully_shard

WORLD = MPI.COMM_WORLD
aten = torch.ops.aten


class Int8Weight(torch.Tensor):
    """A float32 matrix stored as int8 rows with one float32 scale per row."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        return cls(torch.round(weight / scale).to(torch.int8), scale)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.qdata.float() * self.scale).to(dtype)

    def __repr__(self) -> str:
        return f"Int8Weight({tuple(self.shape)})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Weight(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return Int8Weight(func(args[0].qdata), func(args[0].scale))
        if func is aten.slice.Tensor:  # rows only: what sharding needs
            self, dim, *rest = args
            if dim != 0:
                raise NotImplementedError("Int8Weight slices rows only")
            return Int8Weight(func(self.qdata, 0, *rest), func(self.scale, 0, *rest))
        args, kwargs = tree_map_only(Int8Weight, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    # FSDP2's all-gather extension: gather int8 rows and their scales, rebuild after
    def fsdp_pre_all_gather(self, mesh):
        return (self.qdata, self.scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        qdata, scale = outputs
        weight = (qdata.to(param_dtype) * scale.to(param_dtype))
        if out is not None:
            with torch.no_grad():
                out.copy_(weight)
            return None
        return weight, (weight,)


class QuantNet(nn.Module):
    def __init__(self, quantized: bool) -> None:
        super().__init__()
        dims = [(48, 32), (40, 48), (3, 40)]
        self.layers = nn.ModuleList(nn.Linear(i, o) for o, i in dims)
        for k, layer in enumerate(self.layers):
            w = Int8Weight.quantize(global_tensor(layer.weight.shape, seed=20 + k) * 0.3)
            layer.weight = nn.Parameter(w if quantized else w.dequantize(), requires_grad=False)
            layer.bias = nn.Parameter(global_tensor(layer.bias.shape, seed=30 + k) * 0.1)

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def _train(net, x, target, steps=3):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.02)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(net(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size)
    return torch.tensor(losses)


def _shard(net, mesh):
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def test_int8_all_gather_matches_dequantized(mesh1d):
    per = 2
    x = global_tensor((per * WORLD.size, 32), seed=1)
    target = torch.randint(0, 3, (per * WORLD.size,), generator=torch.Generator().manual_seed(2))
    rows = slice(WORLD.rank * per, (WORLD.rank + 1) * per)
    ref = QuantNet(quantized=False)
    ref_out = ref(x[rows]).detach()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02)
    ref_losses = []
    for _ in range(3):
        loss = F.cross_entropy(ref(x), target)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    quant = _shard(QuantNet(quantized=True), mesh1d)
    plain = _shard(QuantNet(quantized=False), mesh1d)
    with CommDebugMode() as q_comm:
        q_out = quant(x[rows])
    with CommDebugMode() as p_comm:
        plain(x[rows])
    assert_close(q_out, ref_out, atol=1e-5, rtol=1e-5)
    q_bytes, p_bytes = q_comm.get_comm_bytes()["all_gather"], p_comm.get_comm_bytes()["all_gather"]
    assert_all_ranks(q_bytes < 0.4 * p_bytes, f"int8 all-gather sent {q_bytes} bytes, fp32 {p_bytes}")

    losses = _train(quant, x[rows], target[rows])
    assert_close(losses, torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    for (name, p), r in zip(quant.named_parameters(), ref.parameters()):
        full = p.full_tensor() if p.requires_grad else None
        if full is not None:
            assert_close(full, r.detach(), atol=1e-5, rtol=1e-5)
        else:
            local = p._local_tensor  # to_local() would make a (dequantizing) view
            assert_all_ranks(isinstance(local, Int8Weight) and local.qdata.dtype == torch.int8, name)
