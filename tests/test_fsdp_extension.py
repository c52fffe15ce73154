"""The all-gather extension: a tensor subclass gathered in its own (int8 + scales) format."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils._pytree import tree_map_only

from helpers import CollectiveLog, assert_all_ranks, assert_close, global_tensor, raises_everywhere
from mpidtensor.debug import CommDebugMode
from mpidtensor.fsdp import MixedPrecisionPolicy, fully_shard

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

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            return cls(func(args[0].qdata), func(args[0].scale))
        if func is aten.slice.Tensor:  # rows only
            self, dim, *rest = args
            if dim != 0:
                raise NotImplementedError("Int8Weight slices rows only")
            return cls(func(self.qdata, 0, *rest), func(self.scale, 0, *rest))
        # what FSDP2 shards with (torch.chunk, then new_zeros and copy_ into a tensor of its own)
        if func is aten.split.Tensor:
            self, size, *dim = args
            if dim and dim[0] != 0:
                raise NotImplementedError("Int8Weight splits rows only")
            return [cls(q, s) for q, s in zip(func(self.qdata, size), func(self.scale, size))]
        if func is aten.new_zeros.default:
            rows = args[1][0]
            return cls(args[0].qdata.new_zeros(args[1]), args[0].scale.new_zeros((rows, 1)))
        if func is aten.copy_.default and isinstance(args[1], Int8Weight):
            args[0].qdata.copy_(args[1].qdata)
            args[0].scale.copy_(args[1].scale)
            return args[0]
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


class FlatInt8Weight(Int8Weight):
    """Int8Weight gathered as flat data with no row dim (as torchao's NF4 weight is), which
    FSDP2 takes for evenly sharded parameters only."""

    def fsdp_pre_all_gather(self, mesh):
        return (self.qdata.flatten(), self.scale.flatten()), self.qdata.shape[1]

    def fsdp_post_all_gather(self, outputs, cols, param_dtype, *, out=None):
        qdata, scale = outputs
        return super().fsdp_post_all_gather((qdata.view(-1, cols), scale.view(-1, 1)), None, param_dtype, out=out)


class QuantNet(nn.Module):
    def __init__(self, quantized: bool, dims=((48, 32), (40, 48), (3, 40)), weight=Int8Weight) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o) for o, i in dims)
        for k, layer in enumerate(self.layers):
            w = weight.quantize(global_tensor(layer.weight.shape, seed=20 + k) * 0.3)
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


# rows that split evenly over 1-4 ranks, for inputs with no row dim
EVEN_DIMS = ((48, 32), (24, 48), (12, 24))


@pytest.mark.parametrize("weight, dims", [(Int8Weight, ((48, 32), (40, 48), (3, 40))), (FlatInt8Weight, EVEN_DIMS)],
                         ids=["rows", "flat"])
def test_int8_all_gather_matches_dequantized(mesh1d, weight, dims):
    """Inputs with the shard's rows on dim 0 (uneven shards padded), or flat ones of even shards."""
    per = 2
    x = global_tensor((per * WORLD.size, 32), seed=1)
    classes = dims[-1][0]
    target = torch.randint(0, classes, (per * WORLD.size,), generator=torch.Generator().manual_seed(2))
    rows = slice(WORLD.rank * per, (WORLD.rank + 1) * per)
    ref = QuantNet(quantized=False, dims=dims, weight=weight)
    ref_out = ref(x[rows]).detach()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02)
    ref_losses = []
    for _ in range(3):
        loss = F.cross_entropy(ref(x), target)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    quant = _shard(QuantNet(quantized=True, dims=dims, weight=weight), mesh1d)
    plain = _shard(QuantNet(quantized=False, dims=dims, weight=weight), mesh1d)
    with CommDebugMode() as q_comm:
        q_out = quant(x[rows])
    with CommDebugMode() as p_comm:
        plain(x[rows])
    assert_close(q_out, ref_out, atol=1e-5, rtol=1e-5)
    q_bytes, p_bytes = q_comm.get_comm_bytes()["all_gather"], p_comm.get_comm_bytes()["all_gather"]
    if WORLD.size == 1:  # a one-rank mesh gathers nothing (as torch's FSDP)
        assert_all_ranks(q_bytes == p_bytes == 0, f"one rank: all-gathers sent {q_bytes} and {p_bytes} bytes")
    else:
        assert_all_ranks(q_bytes < 0.4 * p_bytes, f"int8 all-gather sent {q_bytes} bytes, fp32 {p_bytes}")

    losses = _train(quant, x[rows], target[rows])
    assert_close(losses, torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    for (name, p), r in zip(quant.named_parameters(), ref.parameters()):
        full = p.full_tensor() if p.requires_grad else None
        if full is not None:
            assert_close(full, r.detach(), atol=1e-5, rtol=1e-5)
        else:
            local = p._local_tensor  # to_local() would make a (dequantizing) view
            assert_all_ranks(type(local) is weight and local.qdata.dtype == torch.int8, name)


def test_flat_inputs_of_uneven_shards_refused_on_every_rank(mesh1d):
    """5 rows over 2-4 ranks: flat inputs cannot say where a shard's padding goes (torch's
    FSDP2 refuses them too); the first forward raises on every rank, no rank waits."""
    if WORLD.size == 1:
        pytest.skip("one rank shards evenly")
    net = _shard(QuantNet(quantized=True, dims=((5, 8),), weight=FlatInt8Weight), mesh1d)
    raises_everywhere(ValueError, lambda: net(global_tensor((2, 8), seed=1)), "differ across ranks")


class FailsOnLastRank(FlatInt8Weight):
    """A subclass whose own code fails on the last rank only: at ``copy_`` (while
    ``fully_shard`` shards it) or in ``fsdp_pre_all_gather`` (the first forward)."""

    fail_in = ""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if cls.fail_in == "copy_" and func is aten.copy_.default and WORLD.rank == WORLD.size - 1:
            raise RuntimeError("copy_ failed on the last rank")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def fsdp_pre_all_gather(self, mesh):
        if type(self).fail_in == "pre_all_gather" and WORLD.rank == WORLD.size - 1:
            raise RuntimeError("pre_all_gather failed on the last rank")
        return super().fsdp_pre_all_gather(mesh)


@pytest.mark.parametrize("fail_in", ["copy_", "pre_all_gather"])
def test_subclass_failing_on_one_rank_raises_on_every_rank(mesh1d, fail_in, monkeypatch):
    monkeypatch.setattr(FailsOnLastRank, "fail_in", fail_in)
    net = QuantNet(quantized=True, dims=EVEN_DIMS, weight=FailsOnLastRank)
    if fail_in == "copy_":
        raises_everywhere(RuntimeError, lambda: _shard(net, mesh1d), "failed on the last rank")
        return
    net = _shard(net, mesh1d)
    raises_everywhere(RuntimeError, lambda: net(global_tensor((2, 32), seed=1)), "failed on the last rank")


# --- a trainable subclass gathered as two tensors of other dtypes ---------------------------------
class QWeight(torch.Tensor):
    """A weight stored as int8 rows and float64 per-row scales, shown as float32 (or the
    ``param_dtype`` it was gathered in). Trainable: an in-place update re-quantizes (to
    the nearest level, so one process and FSDP round alike). All-gathered as (int8,
    float64): two inputs, neither in the parameter's dtype. With ``grad_as_subclass`` its
    linear's backward returns the weight gradient as a ``WrappedGrad``."""

    @staticmethod
    def __new__(cls, qdata, scale, grad_as_subclass=False, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata, scale, grad_as_subclass=False, dtype=torch.float32) -> None:
        self.qdata, self.scale, self.grad_as_subclass = qdata, scale, grad_as_subclass

    @staticmethod
    def levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = weight.detach().double().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return torch.round(weight.detach().double() / scale).to(torch.int8), scale

    @classmethod
    def quantize(cls, weight, grad_as_subclass=False) -> "QWeight":
        return cls(*cls.levels(weight), grad_as_subclass)

    def dequantize(self, dtype=None) -> torch.Tensor:
        return (self.qdata.double() * self.scale).to(dtype or self.dtype)

    def __repr__(self) -> str:
        return f"QWeight({tuple(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], (self.grad_as_subclass, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QWeight(inner["qdata"], inner["scale"], *meta)

    def _rewrap(self, qdata, scale) -> "QWeight":
        return QWeight(qdata, scale, self.grad_as_subclass, self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], QWeight):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _QLinear.apply(args[0], args[1], bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0]
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            return self._rewrap(func(self.qdata), func(self.scale))
        if func is aten.slice.Tensor:
            if args[1] != 0:
                raise NotImplementedError("QWeight slices rows only")
            return self._rewrap(func(self.qdata, *args[1:]), func(self.scale, *args[1:]))
        # what FSDP2 shards with (torch.chunk, then new_zeros and copy_ into a tensor of its own)
        if func is aten.split.Tensor:
            if args[2:] and args[2] != 0:
                raise NotImplementedError("QWeight splits rows only")
            return [self._rewrap(q, s) for q, s in zip(func(self.qdata, args[1]), func(self.scale, args[1]))]
        if func is aten.new_zeros.default:
            return self._rewrap(self.qdata.new_zeros(args[1]), self.scale.new_zeros((args[1][0], 1)))
        if func is aten.copy_.default and isinstance(args[1], QWeight):
            self.qdata.copy_(args[1].qdata)
            self.scale.copy_(args[1].scale)
            return self
        plain_args, plain_kwargs = tree_map_only(QWeight, lambda t: t.dequantize(), (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable and isinstance(self, QWeight):  # an optimizer update
            qdata, scale = QWeight.levels(plain_args[0])
            self.qdata.copy_(qdata)
            self.scale.copy_(scale)
            return self
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.qdata, self.scale), (self.grad_as_subclass,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # built on the persistent outputs, which the all-gather refilled
            return None
        qdata, scale = outputs
        return QWeight(qdata, scale, *metadata, dtype=param_dtype), (qdata, scale)


class WrappedGrad(torch.Tensor):
    """A gradient that comes back as a tensor subclass (losslessly: ``dequantize`` returns it)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data) -> None:
        self.data_ = data

    def dequantize(self) -> torch.Tensor:
        return self.data_

    def __tensor_flatten__(self):
        return ["data_"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return WrappedGrad(inner["data_"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:
            return WrappedGrad(args[0].data_)
        args, kwargs = tree_map_only(WrappedGrad, lambda t: t.data_, (args, kwargs or {}))
        return func(*args, **kwargs)


class _QLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        w = weight.dequantize(x.dtype)
        ctx.save_for_backward(x, w)
        ctx.wrap = weight.grad_as_subclass
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.size(-1)).T @ x.reshape(-1, x.size(-1))
        return grad @ w, WrappedGrad(grad_w) if ctx.wrap else grad_w, grad.reshape(-1, grad.size(-1)).sum(0)


class QNet(nn.Module):
    """Rows 10, 7, 3: uneven at 3 and 4 ranks; at 4 ranks one rank holds none of the 3."""

    def __init__(self, grad_as_subclass: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in [(8, 10), (10, 7), (7, 3)])
        for k, layer in enumerate(self.layers):
            w = global_tensor(layer.weight.shape, seed=40 + k) * 0.3
            layer.weight = nn.Parameter(QWeight.quantize(w, grad_as_subclass))
            layer.bias = nn.Parameter(global_tensor(layer.bias.shape, seed=50 + k) * 0.1)

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def _qtrain(net, x, target, steps=3):
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(net(x).float(), target)
        loss.backward()
        for p in net.parameters():  # what FSDP reduces: the gradient's plain values
            if isinstance(p.grad, WrappedGrad):
                p.grad = p.grad.dequantize()
        opt.step()
        opt.zero_grad()
        losses.append(WORLD.allreduce(loss.item()) / WORLD.size)
    return torch.tensor(losses)


def _qbatch():
    x = global_tensor((2 * WORLD.size, 8), seed=3)
    target = torch.randint(0, 3, (2 * WORLD.size,), generator=torch.Generator().manual_seed(4))
    return x, target, slice(2 * WORLD.rank, 2 * WORLD.rank + 2)


def _qshard(net, mesh, **kwargs):
    for layer in net.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(net, mesh=mesh, **kwargs)


@pytest.mark.parametrize("grad_as_subclass", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [True, 2])
def test_trainable_two_dtype_extension_matches_one_process(mesh1d, grad_as_subclass, reshard_after_forward):
    if reshard_after_forward == 2 and WORLD.size != 4:
        pytest.skip("reshard_after_forward=2 is a non-trivial subgroup at 4 ranks")
    x, target, rows = _qbatch()
    ref = QNet(grad_as_subclass)
    ref_losses = _qtrain(ref, x, target)  # identical on every rank: the mean is itself
    net = _qshard(QNet(grad_as_subclass), mesh1d, reshard_after_forward=reshard_after_forward)
    losses = _qtrain(net, x[rows], target[rows])
    assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        local = p._local_tensor
        if isinstance(r, QWeight):
            full = torch.cat(WORLD.allgather(local.dequantize().detach()))
            lsb = float(r.scale.max())  # round-to-nearest may fall the other way on a tie-close value
            assert_all_ranks(isinstance(local, QWeight) and local.qdata.dtype == torch.int8, name)
            assert_close(full, r.dequantize().detach(), atol=lsb + 1e-6, rtol=0)
        else:
            assert_close(p.full_tensor(), r.detach(), atol=1e-5, rtol=1e-5)


def test_extension_gradient_dtype_and_reduce_dtype(mesh1d):
    """param_dtype bfloat16: the subclass builds a bfloat16 weight, its gradient comes back in
    bfloat16 (as a subclass), is reduce-scattered in float64 and lands as float32."""
    x, target, rows = _qbatch()
    ref = QNet(grad_as_subclass=False)
    F.cross_entropy(ref(x), target).backward()
    net = _qshard(QNet(grad_as_subclass=True), mesh1d, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float64))
    seen = []
    net.layers[1].register_forward_pre_hook(lambda m, a: seen.append((type(m.weight), m.weight.dtype)))
    with CollectiveLog() as log:
        F.cross_entropy(net(x[rows]).float(), target[rows]).backward()
    assert_all_ranks(seen == [(QWeight, torch.bfloat16)], f"{seen}")
    assert_all_ranks("reduce_scatter" in log.calls or WORLD.size == 1, f"{log.calls}")
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        grad = p.grad
        assert_all_ranks(grad.dtype == torch.float32 and type(grad._local_tensor) is torch.Tensor, name)
        assert_close(grad.full_tensor(), r.grad, atol=2e-2, rtol=2e-2)  # bfloat16 compute
