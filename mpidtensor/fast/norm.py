"""``SequenceParallel`` ``nn.RMSNorm`` / ``nn.LayerNorm`` run on the local sequence block, as Megatron does.

A norm normalizes each position on its own, so on an input sharded over the sequence it
is the same norm on this rank's positions. The general path (the module's forward on
DTensors) sends every aten op of it through DTensor dispatch: on CPU ``rms_norm``
decomposes into six ops forward and about fourteen backward, and the weight's gradient
comes out ``Partial``, settled by a hook's ``redistribute``. Here one autograd Function
runs the fused kernel on the local block (``_fused_rms_norm`` / ``native_layer_norm``,
the kernels plain torch runs, so the forward values are one process's), computes the
backward on the local block and all-reduces the parameters' partial gradients over the mesh in
place (Megatron's all-reduce of the norm weights' gradients): they come out ``Replicate``.

Taken per call when nothing needs the general path: fast paths on (``fast.registry``), the
stock forward of ``nn.RMSNorm`` or ``nn.LayerNorm``, the input a DTensor on the style's
mesh sharded, C-contiguous globally; the parameters (if any) DTensors on that mesh in the
input's dtype; the dispatcher's norm rule (asked once per specs, ``fast.rules``) keeping
all of them where they lie (so the shard is of a dim the norm does not normalize, the
parameters replicated); no autocast, not under ``torch.compile``. Every one of these
facts is shared by all ranks, so all ranks take the same path.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from ..tensor.layout import contiguous_strides
from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..comm import collectives
from ..tensor.placements import Shard
from ..runtime import caches
from ..tensor.spec import DTensorSpec
from .functions import compiler, direct_apply, dynamo_compiling, once_differentiable_backward
from .grads import param_grad
from .linear import local_grad
from .registry import register
from ..runtime.settings import settings
from .rules import keeps_layout

aten = torch.ops.aten


def _reduce_partial(ctx, index: int, grad: torch.Tensor | None, param: DTensor | None,
                    sums: collectives.BySignature) -> DTensor | None:
    """This rank's partial sum of the gradient of ``param`` (the Function's ``index``-th tensor
    input), all-reduced in place: the DTensor to return, or None once it is on ``param.grad``
    (``fast.grads``)."""
    if grad is None or param is None:
        return None
    if sums.comm.size > 1:
        grad = sums(grad)
    return param_grad(ctx, index, param, grad, param._spec)


class _LocalRMSNorm(torch.autograd.Function):
    """y = x * rstd * w on this rank's positions; rstd = 1 / sqrt(mean(x^2) + eps)."""

    @staticmethod
    def forward(ctx, x: DTensor, weight: DTensor | None, shape: tuple[int, ...], eps: float | None,
                sums: collectives.BySignature) -> DTensor:
        local = x._local_tensor
        y, rstd = torch._fused_rms_norm(local, shape, None if weight is None else weight._local_tensor, eps)
        ctx.x_spec, ctx.sums, ctx.ndims, ctx.weight = x._spec, sums, len(shape), weight
        ctx.to_save = (local, rstd)
        return DTensor(y, x._spec)

    @staticmethod
    @once_differentiable_backward  # the gradients are built on local tensors: no double backward
    def backward(ctx, gy):
        x, rstd = ctx.saved_tensors
        spec = ctx.x_spec  # (a gradient in the output's own spec, interned: its block without a call)
        gy = gy._local_tensor if type(gy) is DTensor and gy._spec is spec else local_grad(gy, spec)
        weight = ctx.weight
        lead = x.ndim - ctx.ndims
        xhat = x * rstd
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            # (a sum over the leading dims of a C-contiguous product: the reduction reshape(-1, ...).sum(0) is)
            gw = (gy * xhat).sum(tuple(range(lead))) if lead else gy * xhat
            if gw.dtype != weight.dtype:
                gw = gw.to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            g = gy if weight is None else gy * weight._local_tensor
            # d/dx of x * rstd: rstd * g - xhat * mean(g * xhat) over the normalized dims
            mean = (g * xhat).mean(tuple(range(lead, x.ndim)), keepdim=True)
            gx = torch.addcmul(g, xhat, mean, value=-1).mul_(rstd)
            if gx.dtype != x.dtype:
                gx = gx.to(x.dtype)
            gx = DTensor(gx if gx.is_contiguous() else gx.contiguous(), ctx.x_spec)
        return gx, _reduce_partial(ctx, 1, gw, weight, ctx.sums), None, None, None


class _LocalLayerNorm(torch.autograd.Function):
    """``native_layer_norm`` on this rank's positions."""

    @staticmethod
    def forward(ctx, x: DTensor, weight: DTensor | None, bias: DTensor | None, shape: tuple[int, ...], eps: float,
                sums: collectives.BySignature) -> DTensor:
        local = x._local_tensor
        w, b = (None if p is None else p._local_tensor for p in (weight, bias))
        y, mean, rstd = torch.native_layer_norm(local, shape, w, b, eps)
        ctx.x_spec, ctx.sums, ctx.shape, ctx.params = x._spec, sums, shape, (weight, bias)
        ctx.to_save = (local, mean, rstd)
        return DTensor(y, x._spec)

    @staticmethod
    @once_differentiable_backward  # the gradients are built on local tensors: no double backward
    def backward(ctx, gy):
        x, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.params
        gy = local_grad(gy, ctx.x_spec).contiguous()
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        w, b = (None if p is None else p._local_tensor for p in (weight, bias))
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(gy, x, ctx.shape, mean, rstd, w, b, mask)
        gx = DTensor(gx.contiguous(), ctx.x_spec) if mask[0] else None
        return (gx, _reduce_partial(ctx, 1, gw if mask[1] else None, weight, ctx.sums),
                _reduce_partial(ctx, 2, gb if mask[2] else None, bias, ctx.sums), None, None, None)


_local_rms_norm = direct_apply(_LocalRMSNorm, compiling_checked=True)  # (``_applies`` asks)
_local_layer_norm = direct_apply(_LocalLayerNorm, compiling_checked=True)


NORM = register(
    "sp.norm",
    shortcuts="SequenceParallel nn.RMSNorm / nn.LayerNorm: the module's forward on DTensors (rms_norm's "
              "decomposition or native_layer_norm and their backward through dispatch), the weight gradients' "
              "Partial settled by a hook's redistribute",
    decided_by="ops.nn's rule for aten.native_layer_norm / _fused_rms_norm keeps the input's sequence shard "
               "and the replicated parameters in place and gives the output in the input's layout",
)


class LocalNormForward:
    """``forward`` of a ``SequenceParallel`` ``nn.RMSNorm`` / ``nn.LayerNorm`` (installed by the
    style, ``parallel.install``): the local path when it applies (see the module docstring),
    else the module's own forward (``inner``) on DTensors. The style's input and output
    conversions (``prepare_input`` / ``prepare_output``, its hooks otherwise) run here, so
    the module has no hooks and ``nn.Module`` calls it on its fast path."""

    def __init__(self, mesh: DeviceMesh, inner: Callable, prepare_input: Callable | None = None,
                 prepare_output: Callable | None = None) -> None:
        self.mesh, self.inner = mesh, inner
        self.prepare_input, self.prepare_output = prepare_input, prepare_output
        # the parameters' partial gradients summed in place over the mesh (a prepared all-reduce per
        # gradient shape and dtype; a non-contiguous gradient is staged as the general function does)
        self.sums = collectives.BySignature(collectives.prepare_all_reduce, mesh.comm_for((0,)), op="sum", inplace=True)
        self.decided: dict[tuple, bool] = {}  # by the input's and the parameters' specs (``_applies``)
        self.rules: dict[tuple, bool] = {}  # the norm rule's verdict, by layout (``_rule_agrees``)
        self.generation = caches.GENERATION  # of the rules both tables were decided under

    def __deepcopy__(self, memo: dict) -> "LocalNormForward":
        twin = copy.copy(self)  # the mesh and the style's conversions are shared, as the DTensors' specs are
        twin.decided, twin.rules = {}, {}  # (the prepared sums are the mesh's, shared as it is)
        return twin

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.prepare_input is not None:
            args = self.prepare_input(module, args, self.mesh)
        x = args[0] if args and not args[1:] and not kwargs else None  # one argument (``len`` is a call)
        params = self._params(module)
        if x is None or not settings.fast_paths or not self._applies(module, x, params):
            out = self.inner(module, *args, **kwargs)
        else:
            NORM.hits += 1
            if isinstance(module, nn.RMSNorm):
                out = _local_rms_norm(x, params[0], tuple(module.normalized_shape), module.eps, self.sums)
            else:
                out = _local_layer_norm(x, *params, tuple(module.normalized_shape), module.eps, self.sums)
        return out if self.prepare_output is None else self.prepare_output(module, out, self.mesh)

    @staticmethod
    def _params(module: nn.Module) -> tuple[Any, Any]:
        """(weight, bias or None) as the module reads them: from ``_parameters`` by subscript
        (``nn.Module.__getattr__`` is a Python call per read), else by attribute; an RMSNorm's
        bias is None (its forward, and so its local path, reads none)."""
        params = module._parameters
        try:
            weight = params["weight"]
        except KeyError:  # not a registered parameter (a parametrization)
            weight = module.weight
        if "bias" in params:
            return weight, params["bias"]
        return weight, None if isinstance(module, nn.RMSNorm) else getattr(module, "bias", None)

    def _applies(self, module: nn.Module, x: Any, params: tuple[Any, Any]) -> bool:
        if (not isinstance(x, DTensor) or dynamo_compiling() or compiler._is_compiling_flag
                or torch.is_autocast_enabled(x.device.type)):
            return False
        if self.generation != caches.GENERATION:  # the rules changed (caches.clear_all): decide again
            self.decided, self.rules, self.generation = {}, {}, caches.GENERATION
        weight, bias = params
        key = (x._spec, weight._spec if isinstance(weight, DTensor) else weight is None,
               bias._spec if isinstance(bias, DTensor) else bias is None)
        try:  # (a subscript: ``dict.get`` is a call)
            return self.decided[key]
        except KeyError:
            fits = self.decided[key] = self._fits(module, x._spec, params)
            return fits

    def _fits(self, module: nn.Module, spec: DTensorSpec, params: tuple) -> bool:
        """Whether an input of ``spec`` and these parameters take the local path: the input
        sharded (the parameters' gradients are then partial sums, all-reduced) on the style's
        mesh, C-contiguous (its gradient takes its spec), the parameters DTensors on that mesh
        in its dtype, and the dispatcher's norm rule computing it where everything lies."""
        if not self._on_mesh(spec.mesh) or len(spec.placements) != 1 or not isinstance(spec.placements[0], Shard) \
                or spec.stride != contiguous_strides(spec.shape):
            return False
        if not all(p is None or (isinstance(p, DTensor) and self._on_mesh(p._spec.mesh) and p.dtype == spec.dtype)
                   for p in params):
            return False
        weight, bias = (None if p is None else p._spec for p in params)
        key = (spec.placements, len(spec.shape), spec.dtype, weight, bias)
        agreed = self.rules.get(key)
        if agreed is None:
            agreed = self.rules[key] = self._rule_agrees(module, spec, weight, bias)
        return agreed

    def _rule_agrees(self, module: nn.Module, spec: DTensorSpec, weight: DTensorSpec | None,
                     bias: DTensorSpec | None) -> bool:
        """Whether the dispatcher's rule for the norm (``_fused_rms_norm`` /
        ``native_layer_norm``) keeps an input laid out as ``spec`` and the parameters where
        they lie and gives the output in the input's layout. Asked for leading dims of the
        mesh's size: the verdict depends on placements and ranks, not sizes (once per
        layout, not per shape: a rule query costs milliseconds)."""
        shape = list(module.normalized_shape)
        lead = (self.mesh.size(),) * (len(spec.shape) - len(shape))
        full = (*lead, *shape)
        x = DTensorSpec(spec.mesh, spec.placements, full, contiguous_strides(full), spec.dtype)
        if isinstance(module, nn.RMSNorm):
            call = (aten._fused_rms_norm.default, (x, shape, weight, module.eps))
        else:
            call = (aten.native_layer_norm.default, (x, shape, weight, bias, module.eps))
        return keeps_layout(*call, self.mesh, [spec.placements])

    def _on_mesh(self, mesh: DeviceMesh) -> bool:
        return mesh is self.mesh or mesh == self.mesh

