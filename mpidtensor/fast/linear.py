"""``ColwiseParallel`` / ``RowwiseParallel`` ``nn.Linear`` run on the local blocks, as Megatron does.

The general path of a style (input hook, ``nn.Linear.forward`` on DTensors, output hook)
sends every aten op of the forward and of its backward (``t``, ``addmm``, ``mm``, ``sum``,
``view``, ``detach``: about ten per Linear and step) through DTensor dispatch, and adds
``from_local`` / ``redistribute`` / ``to_local`` autograd nodes around them. The local work
is Megatron's, the Python work per op is not. Here one autograd Function does a Linear's
forward and backward on the local tensors, with only the collective its layout needs,
on buffers it made (in place):

* Colwise (input ``Replicate``): the local matmul forward; backward, the input gradient is
  a partial sum, all-reduced (Megatron's ``f``) when the input came in as a plain tensor,
  handed back as a ``Partial`` DTensor when it came as a DTensor (its producer settles it,
  e.g. a sequence-parallel all-gather's backward by one reduce-scatter);
* Rowwise (input sharded on its last dim): the local matmul, then one all-reduce
  (output ``Replicate``, Megatron's ``g``) or reduce-scatter (output ``Shard(d)``,
  sequence parallelism), then the bias; backward, the output gradient is all-gathered
  first for a sharded output.

Parameter gradients are DTensors with the parameters' specs, as the general path gives.
The path is taken per call when nothing needs the general one: fast paths on
(``fast.registry``), a plain ``nn.Linear``, its parameters DTensors on the style's mesh,
C-contiguous, in the input's dtype, the input a plain tensor or a DTensor on that mesh,
no autocast, not under ``torch.compile``, and the dispatcher's rules agreeing (asked once
per parameter specs and input ndim, ``fast.rules``): ``aten.mm`` of the input in the
layout the Function computes on and the weight's transpose moves neither and gives the
Function's output layout, and the bias adds in place. Inputs in another layout are first
moved with the public (differentiable) ``from_local`` / ``redistribute``; a sharded
DTensor input of a Colwise Linear is all-gathered by its Function (``fast.gather``'s
route), its gradient
reduce-scattered back there. An output kept as a DTensor is made
by the Function itself (its backward takes the DTensor gradient, in any layout): one
autograd node per Linear; one wanted in another layout than the Function gives is then
redistributed. Every such decision reads facts all ranks share (placements, global
shapes, dtypes), so all ranks take the same path.
"""
from __future__ import annotations

import copy
from math import prod
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor.layout import contiguous_strides
from ..tensor.dtensor import DTensor
from ..mesh import DeviceMesh
from ..comm import collectives
from ..tensor.placements import Partial, Placement, Replicate, Shard, normalize_placements
from ..tensor.spec import DTensorSpec
from .functions import compiler, direct_apply, dynamo_compiling
from .gather import Route, shard_route
from .grads import param_grad
from ..runtime import caches
from .registry import register
from ..runtime.settings import settings
from .rules import keeps_layout

aten = torch.ops.aten


_GRAD_SPECS: dict = caches.cache("fast.linear.grad_specs")  # (input spec, partial) -> gradient spec


def _grad_spec(s: DTensorSpec, partial: bool) -> DTensorSpec:
    """The spec of a C-contiguous gradient of a DTensor of spec ``s`` on its 1-D mesh:
    ``Partial`` or in ``s``'s placements (cached by the interned spec)."""
    key = (s, partial)
    spec = _GRAD_SPECS.get(key)
    if spec is None:
        placements = (Partial(),) if partial else s.placements
        spec = _GRAD_SPECS[key] = DTensorSpec(s.mesh, placements, s.shape, contiguous_strides(s.shape), s.dtype)
    return spec


def local_grad(gy: Any, spec: DTensorSpec | None) -> torch.Tensor:
    """This rank's block of the gradient of a DTensor output of ``spec`` (Shard or Replicate),
    in that layout: moved there first when it came in another one; a plain gradient (or
    ``spec`` None: the output was handed on local) is taken as the block itself, as
    ``from_local``'s backward takes it."""
    if spec is None or (type(gy) is not DTensor and not isinstance(gy, DTensor)):
        return gy
    if gy._spec.placements != spec.placements:
        gy = gy.redistribute(spec.mesh, spec.placements)
    return gy._local_tensor


def reduce_partial(ctx, y: torch.Tensor, comm, route: Route | None) -> torch.Tensor:
    """The sum over ``comm`` of this rank's partial ``y``: an in-place all-reduce, or the
    reduce-scatter of ``route`` (``shard_route`` of the output's spec: its collectives
    prepared), kept in ``ctx.route`` for the backward."""
    ctx.route = route
    if route is not None:
        return route.reduce(y)
    if comm.size == 1:
        return y
    return collectives.all_reduce(y, comm, "sum", inplace=True)


def gather_reduced_grad(ctx, gy: torch.Tensor) -> torch.Tensor:
    """The backward of :func:`reduce_partial` (``ctx.route``): the gradient of a
    reduce-scatter is all-gathered; that of an all-reduce is already whole."""
    return gy if ctx.route is None else ctx.route.gather(gy)


def wrap_output(y: torch.Tensor, out_spec: DTensorSpec | None) -> Any:
    """The Function's output: the local ``y``, or the DTensor of ``out_spec`` holding it."""
    if out_spec is None:
        return y
    return DTensor(y if y.is_contiguous() else y.contiguous(), out_spec)


def _linear_backward(ctx, gy):
    """The backward of both Linear Functions: the output gradient's block (all-gathered after a
    row Linear's reduce-scatter, ``ctx.route``), the input gradient (a column Linear's partial
    sum reduce-scattered back to its sharded input (``ctx.gather``), handed back as a DTensor,
    or all-reduced over ``ctx.comm`` for a plain input), and the parameter gradients as
    DTensors of the parameters' specs, or None where unneeded or already on ``.grad``
    (``fast.grads``; the weight and bias are the Function's tensor inputs 1 and 2)."""
    spec = ctx.out_spec  # None: the output was handed on local, ``gy`` is its gradient
    if spec is not None:  # (the gradient in the output's own spec, interned: its block without a call)
        gy = gy._local_tensor if type(gy) is DTensor and gy._spec is spec else local_grad(gy, spec)
    x, weight = ctx.saved_tensors
    if ctx.route is not None:
        gy = ctx.route.gather(gy)
    needs, bias = ctx.needs_input_grad, ctx.bias
    gx = gw = gb = None
    if needs[0]:
        gx = gy.matmul(weight._local_tensor)
        if ctx.gather is not None:
            gx = DTensor(ctx.gather.reduce(gx), ctx.gather.in_spec)
        elif ctx.x_spec is not None:
            gx = DTensor(gx, ctx.x_spec)
        elif ctx.comm is not None:
            gx = collectives.all_reduce(gx, ctx.comm, "sum", inplace=True)
    rows = prod(gy.shape[:-1])  # not -1: a rank's block may be empty
    gy2 = gy.reshape(rows, gy.shape[-1])
    if needs[1]:
        gw = param_grad(ctx, 1, weight, gy2.t().mm(x.reshape(rows, x.shape[-1])), weight._spec)
    if bias is not None and needs[2]:
        gb = param_grad(ctx, 2, bias, gy2.sum(0), bias._spec)
    return gx, gw, gb, None, None, None, None


class _ColwiseLinear(torch.autograd.Function):
    """y = x W_r^T + b_r on this rank's output features; the input gradient is a partial sum.
    The output is local, or the DTensor of ``out_spec`` (one autograd node, not two). With a
    ``gather`` route (``fast.gather``), ``x`` is a sharded DTensor all-gathered first and its
    gradient reduce-scattered back (Megatron's sequence-parallel column Linear)."""

    @staticmethod
    def forward(ctx, x, weight: DTensor, bias: DTensor | None, comm, out_spec: DTensorSpec | None,
                x_spec: DTensorSpec | None, gather=None):
        local = x if x_spec is None and gather is None else x._local_tensor
        if gather is not None:
            local = gather.gather(local)
        ctx.comm, ctx.gather, ctx.x_spec, ctx.route = comm if comm.size > 1 else None, gather, x_spec, None
        ctx.bias, ctx.out_spec = bias, out_spec
        ctx.to_save = (local, weight)
        y = F.linear(local, weight._local_tensor, None if bias is None else bias._local_tensor)
        # (``wrap_output`` inline: a frame per Linear)
        return y if out_spec is None else DTensor(y if y.is_contiguous() else y.contiguous(), out_spec)

    backward = staticmethod(_linear_backward)


class _RowwiseLinear(torch.autograd.Function):
    """y = reduce(x_r W_r^T) + b over the mesh: all-reduce, or the reduce-scatter of ``route``.
    The output is local, or the DTensor of ``out_spec`` (one autograd node, not two)."""

    @staticmethod
    def forward(ctx, x, weight: DTensor, bias: DTensor | None, comm, route: Route | None,
                out_spec: DTensorSpec | None, x_spec: DTensorSpec | None):
        local = x if x_spec is None else x._local_tensor
        ctx.bias, ctx.out_spec, ctx.x_spec, ctx.comm, ctx.gather = bias, out_spec, x_spec, None, None
        ctx.to_save = (local, weight)
        y = reduce_partial(ctx, F.linear(local, weight._local_tensor), comm, route)
        if bias is not None:
            y += bias._local_tensor
        return y if out_spec is None else DTensor(y if y.is_contiguous() else y.contiguous(), out_spec)

    backward = staticmethod(_linear_backward)


# (``LocalLinearForward._plan`` rules out torch.compile before either runs)
_colwise_linear = direct_apply(_ColwiseLinear, compiling_checked=True)
_rowwise_linear = direct_apply(_RowwiseLinear, compiling_checked=True)


LINEAR = register(
    "tp.linear",
    shortcuts="ColwiseParallel / RowwiseParallel nn.Linear: the input hook, nn.Linear.forward on DTensors "
              "(t, view, mm / addmm and their backward through dispatch), the output hook",
    decided_by="ops.matrix's rule for aten.mm of (input, weight.t()) keeps both in place and gives Shard(1) "
               "(colwise) or Partial (rowwise); the pointwise rule adds the bias in place",
)
_T = {0: 1, 1: 0}  # a weight dim -> the same dim of its transpose


class LocalLinearForward:
    """``forward`` of a Colwise/Rowwise-parallel ``nn.Linear`` (installed by the style,
    ``parallel.install``): the local path when it applies, else the style's general one
    (``prepare_input``, ``nn.Linear.forward`` on DTensors, ``prepare_output``)."""

    def __init__(self, mesh: DeviceMesh, colwise: bool, given: Placement, wanted: Placement,
                 local_out: bool, prepare_input: Callable, prepare_output: Callable) -> None:
        self.mesh, self.colwise = mesh, colwise
        self.given, self.wanted, self.local_out = given, wanted, local_out
        self.prepare_input, self.prepare_output = prepare_input, prepare_output
        self.comm = mesh.comm_for((0,))
        self.checked: tuple = ()  # the rules' generation and the parameter specs ``plans`` were decided for
        self.plans: dict[tuple, tuple | None] = {}  # by input ndim and dtype (``_decide``)
        self.out_specs: dict[tuple, tuple] = {}  # by input shape and dtype (``_out_spec``)
        self.moves: dict[DTensorSpec, tuple] = {}  # a DTensor input's spec -> ``_input_facts``

    def __deepcopy__(self, memo: dict) -> "LocalLinearForward":
        twin = copy.copy(self)  # the mesh and the style's conversions are shared, as the DTensors' specs are
        twin.checked, twin.plans, twin.out_specs, twin.moves = (), {}, {}, {}
        return twin

    def __call__(self, module: nn.Linear, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args and not args[1:] and not kwargs else None  # one argument (``len`` is a call)
        params = module._parameters
        try:  # (subscripts, not ``module.weight``: ``nn.Module.__getattr__`` is a Python call each)
            weight, bias = params["weight"], params["bias"]
        except KeyError:  # not registered parameters (a parametrization): as the module reads them
            weight, bias = module.weight, module.bias
        plan = None
        # per call (inline: ``_plan`` was a frame per Linear) the facts a cached verdict cannot hold:
        # the input's type and mesh, autocast, compiling; then ``_decide``'s verdict, by the
        # parameters' specs and the input's ndim and dtype
        if (x is not None and settings.fast_paths
                and (type(x) is torch.Tensor or (type(x) is DTensor or isinstance(x, DTensor))
                     and (x._spec.mesh is self.mesh or self._on_mesh(x._spec.mesh)))
                and x.ndim and not (dynamo_compiling() or compiler._is_compiling_flag)
                and not torch.is_autocast_enabled(x.device.type)):
            try:  # (attribute reads and subscripts, not ``getattr`` / ``dict.get``: no calls)
                if (caches.GENERATION, weight._spec, None if bias is None else bias._spec) == self.checked:
                    plan = self.plans[(x.ndim, x.dtype)]
                else:
                    plan = self._plan(x, weight, bias)
            except (AttributeError, KeyError):  # a parameter not a DTensor, or not decided yet
                plan = self._plan(x, weight, bias)
        if plan is None:
            inputs = self.prepare_input(module, args, self.mesh)
            return self.prepare_output(module, nn.Linear.forward(module, *inputs, **kwargs), self.mesh)
        LINEAR.hits += 1
        given, wanted, desired, natural, moves_given, moves_natural = plan
        gather = x_spec = None
        if type(x) is DTensor or isinstance(x, DTensor):
            try:  # (a subscript: ``dict.get`` is a call)
                moves, x_spec = self.moves[x._spec]
            except KeyError:
                moves, x_spec = self._input_facts(x._spec, desired)
            if moves:
                x, gather = self._move(x, desired)
                if gather is None:  # moved by the public path: the gradient spec of what came out
                    x_spec = self._input_facts(x._spec, desired)[1]
                else:  # the Function all-gathers it and hands back its gradient itself
                    x_spec = None
        elif moves_given or x.shape[-1] != weight._local_tensor.shape[-1]:
            x = self.prepare_input(module, (x,), self.mesh)[0]
            x_spec = self._input_facts(x._spec, desired)[1]
        try:
            spec, route = self.out_specs[(x.shape, x.dtype)]
        except KeyError:
            spec, route = self._out_spec(module, x, natural)
        out_spec = None if self.local_out and not moves_natural else spec
        if self.colwise:
            y = _colwise_linear(x, weight, bias, self.comm, out_spec, x_spec, gather)
        else:
            y = _rowwise_linear(x, weight, bias, self.comm, route, out_spec, x_spec)
        if out_spec is None:
            return y
        if moves_natural:
            y = y.redistribute(self.mesh, (wanted,))
        return y.to_local() if self.local_out else y

    def _input_facts(self, spec: DTensorSpec, desired: Placement) -> tuple[bool, DTensorSpec]:
        """(whether a DTensor input of ``spec`` moves to ``desired``, the spec of its gradient
        as the Function hands it back: ``Partial`` for Colwise, in its layout for Rowwise);
        cached by the interned spec (``Placement.__eq__`` is a Python call)."""
        facts = self.moves.get(spec)
        if facts is None:
            facts = self.moves[spec] = (spec.placements != (desired,), _grad_spec(spec, self.colwise))
        return facts

    def _out_spec(self, module: nn.Linear, x: torch.Tensor, natural: Placement) -> tuple[DTensorSpec, Route | None]:
        """(the spec of the Function's DTensor output for the input ``x`` (whose leading dims
        are whole here), C-contiguous in the ``natural`` layout, and a Rowwise Linear's
        reduce-scatter route to it, ``shard_route``'s, or None); cached by shape and dtype."""
        shape = (*x.shape[:-1], module.out_features)
        spec = DTensorSpec(self.mesh, (natural,), shape, contiguous_strides(shape), x.dtype)
        route = shard_route(spec) if not self.colwise and isinstance(natural, Shard) else None
        self.out_specs[(x.shape, x.dtype)] = spec, route
        return spec, route

    def _plan(self, x: Any, weight: Any, bias: Any) -> tuple | None:
        """``_decide``'s plan for an input ``x`` that ``__call__`` found fit (its type, mesh,
        no autocast, not compiling) where the cached verdict is missing: None where the
        parameters are not DTensors; the tables start again for other parameters' specs or
        rules (``caches.clear_all``)."""
        try:  # (attribute reads, not ``getattr(p, "_spec", None)``: no call)
            specs = (caches.GENERATION, weight._spec, None if bias is None else bias._spec)
        except AttributeError:  # a parameter that is not a DTensor: the general path
            return None
        if specs != self.checked:  # other parameters, or the rules changed (caches.clear_all)
            self.checked, self.plans, self.moves, self.out_specs = specs, {}, {}, {}
        key = (x.ndim, x.dtype)
        try:  # (a subscript: ``dict.get`` is a call)
            return self.plans[key]
        except KeyError:
            plan = self.plans[key] = self._decide(weight, bias, x.ndim, x.dtype)
            return plan

    def _decide(self, weight: Any, bias: Any, ndim: int, dtype: torch.dtype) -> tuple | None:
        """(given, wanted, desired, natural, given != desired, wanted != natural) for an input
        of ``ndim`` dims and ``dtype``: the style's input and output layouts, the input layout
        the Function computes on and the output layout it gives, and whether the input and
        output move (decided once: ``Placement.__eq__`` is a Python call); None where the
        local path does not apply: the parameters are
        not DTensors on the style's mesh laid out C-contiguously (the gradients take their
        specs) in the input's dtype, a shard dim is out of range (the general path says why),
        a Rowwise output is wanted sharded on its features (the bias would be sliced), or the
        dispatcher's rules would compute the matmul and the bias add in other layouts."""
        params = (weight,) if bias is None else (weight, bias)
        if not all(isinstance(p, DTensor) and self._on_mesh(p._spec.mesh) and p.dtype == dtype
                   and p._spec.stride == contiguous_strides(p._spec.shape) for p in params):
            return None
        try:
            given, wanted = normalize_placements((self.given, self.wanted), 2, ndim)
        except ValueError:
            return None
        last = Shard(ndim - 1)
        if self.colwise:
            plan = given, wanted, Replicate(), last
        elif wanted == last:
            return None
        else:
            plan = given, wanted, last, wanted  # Replicate, or Shard(d) of a leading dim
        if not self._rules_agree(weight, bias, ndim, dtype, plan[3]):
            return None
        return (*plan, plan[0] != plan[2], plan[1] != plan[3])

    def _rules_agree(self, weight: DTensor, bias: DTensor | None, ndim: int, dtype: torch.dtype,
                     natural: Placement) -> bool:
        """Whether dispatch would run this Linear as the Function does: ``aten.mm`` of the
        flattened input (replicated for Colwise, sharded on its features for Rowwise) and the
        weight's transpose moves neither and gives ``Shard(1)`` (Colwise) or ``Partial``
        (Rowwise), and the bias adds to the output in its ``natural`` layout in place. Asked
        for leading dims of the mesh's size each: the rules' choice among layouts that move
        nothing depends on placements and ranks, not on sizes, so one verdict serves every
        input of this ndim (a rule query costs milliseconds: once, not per shape)."""
        mesh, (n, k) = self.mesh, weight._spec.shape
        lead = (mesh.size(),) * (ndim - 1)
        m = prod(lead)
        x2 = DTensorSpec(mesh, (Replicate(),) if self.colwise else (Shard(1),), (m, k), (k, 1), dtype)
        wt = DTensorSpec(mesh, tuple(Shard(_T[p.dim]) if isinstance(p, Shard) else p for p in weight.placements),
                         (k, n), (1, k), weight.dtype)
        if not keeps_layout(aten.mm.default, (x2, wt), mesh, [(Shard(1),) if self.colwise else (Partial(),)]):
            return False
        if bias is None:
            return True
        out = (*lead, n)
        y = DTensorSpec(mesh, (natural,), out, contiguous_strides(out), dtype)
        return keeps_layout(aten.add.Tensor, (y, bias._spec), mesh, [(natural,)])

    def _on_mesh(self, mesh: DeviceMesh) -> bool:
        return mesh is self.mesh or mesh == self.mesh

    def _move(self, x: DTensor, desired: Placement) -> tuple[DTensor, Any]:
        """(``x`` as the Function takes it, the Colwise Function's gather route or None) for a
        DTensor not laid out as ``desired``: a sharded one that the Colwise Function
        all-gathers itself (``fast.gather``), else moved to the layout by the public path."""
        gather = shard_route(x._spec) if self.colwise else None  # (``__call__`` ruled out compiling)
        return (x, gather) if gather is not None else (x.redistribute(self.mesh, (desired,)), None)
