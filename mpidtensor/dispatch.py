"""``__torch_dispatch__`` for DTensor: plan once per op signature, then run.

The cache key is the op, the specs of the DTensor arguments, the shape and dtype
of plain tensors (taken as ``Replicate()``) and the non-tensor arguments (floats of
pointwise, ``_foreach_*`` and fused optimizer ops by type only, so a changing scalar
such as a learning rate or an optimizer's per-parameter step sizes does not re-plan).
A miss builds a plan: output metadata from meta tensors, the placements from the op's
rule (``mpidtensor.ops``), the redistribution steps of every input. A hit only
unwraps, redistributes where the plan says so, runs the local op and wraps the outputs;
when nothing moves (an optimizer's ops on same-placed DTensors) a :class:`_LocalPlan`
does that in one frame.
"""
from __future__ import annotations

import operator
import os
import warnings
from typing import Any, Callable

import torch
from torch.utils._mode_utils import no_dispatch

from .dtensor import DTensor
from .ops import registry
from .ops.pointwise import is_pointwise, placement_ignores_scalars, pointwise_rule
from .redistribute import clear_plans as clear_redistribution_plans, plan as plan_redistribution, redistribute_local
from .spec import DTensorSpec

_PLANS: dict[tuple, Callable] = {}  # Plan, _LocalPlan or _PerMeshPlan
_WARNED: set = set()
_FLOAT_BY_VALUE: dict[int, bool] = {}  # by id(func): OpOverload hashes in Python
_NO_META = object()  # the op could not run on meta tensors


_DETACH = torch.ops.aten.detach.default


def dispatch(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    if func is _DETACH:  # AccumulateGrad detaches every DTensor gradient: same spec, no plan to run
        x = args[0]
        if x.__class__ is DTensor and getattr(x, "_not_a_view_of", None) is None:
            return DTensor(x._local_tensor.detach(), x._spec)
    fid = id(func)  # op overloads live for the whole process
    by_value = _FLOAT_BY_VALUE.get(fid)
    if by_value is None:
        by_value = _FLOAT_BY_VALUE[fid] = not placement_ignores_scalars(func)
    key = [fid]
    for a in args:
        kind = a.__class__
        if kind is DTensor:  # the common cases first, without a call
            key.append(a._spec)
        elif kind is float and not by_value:
            key.append(float)
        else:
            key.append(_key(a, by_value))
    if kwargs:
        key.append(_key(kwargs, by_value))
    key = tuple(key)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _make_plan(func, args, kwargs)
    return plan(args, kwargs)


def clear_cache() -> None:
    """Forget every cached dispatch and redistribution plan, so the next calls plan anew."""
    _PLANS.clear()
    clear_redistribution_plans()


def _key(obj, floats_by_value: bool):
    if isinstance(obj, DTensor):
        return obj._spec
    if isinstance(obj, torch.Tensor):
        return ("T", obj.shape, obj.dtype, obj.device)
    if isinstance(obj, (list, tuple)):
        return (type(obj), *[x._spec if x.__class__ is DTensor else _key(x, floats_by_value) for x in obj])
    if isinstance(obj, dict):
        return tuple((k, _key(v, floats_by_value)) for k, v in obj.items())
    if isinstance(obj, (float, complex)) and not floats_by_value:
        return type(obj)
    return obj


# --- planning ----------------------------------------------------------------------------------


class Plan:
    """A cached decision for one op signature; calling it runs the op."""

    __slots__ = ("unwrap", "local", "wrap")

    def __init__(self, unwrap: Callable, local: Callable, wrap: Callable) -> None:
        self.unwrap, self.local, self.wrap = unwrap, local, wrap

    def __call__(self, args, kwargs):
        largs, lkwargs = self.unwrap(args, kwargs)
        return self.wrap(self.local(largs, lkwargs), args, kwargs)


class _LocalPlan:
    """A plan that moves nothing: every DTensor argument (top level, or every tensor of a
    list) is passed as its local tensor, plain tensors and scalars as they are, and the
    output is ``self`` (in place, placements kept), ``None`` (``_foreach_*_``, fused
    optimizers), or new DTensors of fixed specs. The same local op as :class:`Plan`'s,
    in one frame instead of four: an optimizer steps every parameter through it."""

    __slots__ = ("op", "tensors", "lists", "finish", "specs", "fallback")

    def __init__(self, op, tensors: list[int], lists: list[int], finish: str, specs: list, fallback: Callable) -> None:
        self.op, self.tensors, self.lists, self.finish, self.specs = op, tensors, lists, finish, specs
        self.fallback = fallback  # the general wrap, for the cases the fast ones do not cover

    def __call__(self, args, kwargs):
        a = list(args)
        for i in self.tensors:
            a[i] = a[i]._local_tensor
        for i in self.lists:
            a[i] = [x._local_tensor for x in a[i]]
        out = self.op(*a, **kwargs)
        finish = self.finish
        if finish == "self":
            dst = args[0]
            # None: a subclass that returns nothing from its in-place op (torchao NF4's copy_)
            if (out is dst._local_tensor or out is None) and getattr(dst, "_not_a_view_of", None) is None:
                return dst
            return self.fallback(out, args, kwargs)
        if finish == "tensor":
            return DTensor(out, self.specs[0], requires_grad=False)
        if finish == "list":
            return type(out)(DTensor(t, spec, requires_grad=False) for t, spec in zip(out, self.specs))
        return out


def _local_plan(func, args, kwargs, converters, out_meta, out_specs, sharding, wrap) -> _LocalPlan | None:
    """A :class:`_LocalPlan` for a call whose inputs all stay where they are, else None."""
    if (sharding.local is not None or _is_view_op(func) or torch.Tag.inplace_view in func.tags
            or any(c not in (None, _local_of) for c in converters)):
        return None
    if any(isinstance(t, DTensor) for t in _tensors(kwargs)):
        return None
    tensors, lists = [], []
    for i, a in enumerate(args):
        if isinstance(a, DTensor):
            tensors.append(i)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            if not all(isinstance(x, DTensor) for x in a):
                return None
            lists.append(i)
    written = _mutated_inputs(func, args)
    if out_meta is None:
        finish = "none"
    elif (written == [("pos", 0)] and isinstance(out_meta, torch.Tensor) and 0 in tensors
          and out_specs[0] is args[0]._spec):  # in place, self keeps its spec
        finish = "self"
    elif written:
        return None
    elif isinstance(out_meta, torch.Tensor):
        finish = "tensor"
    elif isinstance(out_meta, list) and all(isinstance(m, torch.Tensor) for m in out_meta):
        finish = "list"
    else:
        return None
    return _LocalPlan(func._op, tensors, lists, finish, out_specs, wrap)


class _PerMeshPlan:
    """A ``_foreach_*`` op whose lists hold DTensors on several meshes (FSDP x TP's
    parameters: the (dp, tp) mesh and the dp mesh): one call per mesh on the list positions
    that live there, results put back in order. Each call dispatches (and caches) as usual."""

    __slots__ = ("func", "groups", "length")

    def __init__(self, func, groups: list[list[int]], length: int) -> None:
        self.func, self.groups, self.length = func, groups, length

    def __call__(self, args, kwargs):
        results = [None] * self.length
        returned = None
        for positions in self.groups:
            out = self.func(*(self._pick(a, positions) for a in args),
                            **{k: self._pick(v, positions) for k, v in kwargs.items()})
            if isinstance(out, (list, tuple)):
                returned = type(out)
                for i, value in zip(positions, out):
                    results[i] = value
        return None if returned is None else returned(results)

    def _pick(self, arg, positions):
        """An argument cut to ``positions`` if it is a list as long as the op's tensor lists
        (tensors or scalars per position), else as it is."""
        if isinstance(arg, (list, tuple)) and len(arg) == self.length:
            return type(arg)(arg[i] for i in positions)
        return arg


def _per_mesh_groups(func, args, kwargs) -> tuple[list[list[int]], int] | None:
    """For a ``_foreach_*`` op whose list positions hold DTensors on more than one mesh:
    the positions grouped by mesh (first appearance order) and the list length; else None."""
    if not func._schema.name.startswith("aten::_foreach_"):
        return None
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], torch.Tensor)]
    if not lists:
        return None
    length = len(lists[0])
    meshes: list = []
    groups: list[list[int]] = []
    for i in range(length):
        mesh = next((lst[i]._spec.mesh for lst in lists if len(lst) == length and isinstance(lst[i], DTensor)), None)
        index = next((k for k, m in enumerate(meshes) if m is mesh or (mesh is not None and m == mesh)), None)
        if index is None:
            meshes.append(mesh)
            groups.append([])
            index = len(groups) - 1
        groups[index].append(i)
    real = [m for m in meshes if m is not None]
    if len(real) < 2:
        return None
    if None in meshes:  # positions without a DTensor go with the first mesh's
        plain = groups.pop(meshes.index(None))
        groups[0] = sorted(groups[0] + plain)
    return groups, length


def _make_plan(func, args, kwargs) -> Plan:
    split = _per_mesh_groups(func, args, kwargs)
    if split is not None:
        return _PerMeshPlan(func, *split)
    tensors = _tensors(args) + _tensors(kwargs)
    mesh = _common_mesh(func, tensors)
    specs = [_spec_of(t, mesh, func) for t in tensors]
    if _returns_numbers(func):  # item, _local_scalar_dense...: a number needs the whole tensor
        return _replicated_plan(func, args, kwargs, tensors, specs, mesh, lambda out, a, k: out)
    out_meta = _meta_outputs(func, args, kwargs, specs)
    rule = _rule(func)
    if rule is None or out_meta is _NO_META:
        decomposed = _decomposition(func)
        if decomposed is not None:
            return _decomposed_plan(func, decomposed, specs, mesh)
        return _fallback_plan(func, args, kwargs, tensors, specs, mesh)
    call = registry.OpCall(func, _replace_tensors(args, specs), _replace_tensors(kwargs, specs[len(_tensors(args)):]),
                           mesh, out_meta, specs)
    sharding = rule(call)
    if not _placeable(sharding, specs, call.out_metas()):
        return _fallback_plan(func, args, kwargs, tensors, specs, mesh)
    return _build_plan(func, args, kwargs, tensors, specs, mesh, out_meta, sharding)


def _returns_numbers(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(str(r.type) in _NUMBER_TYPES for r in returns)


_NUMBER_TYPES = {"number", "Scalar", "int", "float", "bool", "complex", "SymInt", "SymFloat", "SymBool"}


def _placeable(sharding: registry.Sharding | None, specs, out_metas) -> bool:
    """Whether a rule's decision can run: every ``Shard`` names a dim its tensor has
    (a rule that shards a 0-d tensor could not place the op)."""
    if sharding is None:
        return False
    pairs = [(t, s.ndim) for t, s in zip(sharding.inputs, specs)] + [
        (t, m.ndim) for t, m in zip(sharding.outputs, out_metas)
    ]
    return all(t is None or registry.valid_placements(t, ndim) for t, ndim in pairs)


def _rule(func):
    """The op's rule; an in-place view op (``squeeze_``, ``t_``…) uses its functional form's."""
    rule = registry.rule_for(func)
    if rule is None and torch.Tag.inplace_view in func.tags:
        packet = getattr(torch.ops.aten, func._schema.name.split("::")[1].removesuffix("_"), None)
        functional = getattr(packet, func._overloadname, None) if packet is not None else None
        rule = registry.rule_for(functional) if functional is not None else None
    if rule is None and is_pointwise(func):
        rule = pointwise_rule
    return rule


def _decomposed_plan(func, decomposed, specs, mesh) -> Plan:
    """Run torch's decomposition on the DTensors. A decomposition may decline a call
    (return ``NotImplemented``, e.g. adaptive max pooling of uneven windows); that
    depends only on global shapes, so every rank then takes the replicated fallback."""
    fallback: list[Plan] = []

    def run(a, k):
        out = decomposed(*a, **k)
        if out is not NotImplemented:
            return out
        if not fallback:
            fallback.append(_fallback_plan(func, a, k, _tensors(a) + _tensors(k), specs, mesh))
        return fallback[0](a, k)

    return Plan(lambda a, k: (a, k), run, lambda out, a, k: out)


def _build_plan(func, args, kwargs, tensors, specs, mesh, out_meta, sharding) -> Plan:
    if len(sharding.inputs) != len(specs):
        raise AssertionError(f"rule for {func} gave {len(sharding.inputs)} input placements for {len(specs)} tensors")
    converters = [
        _converter(t, spec, spec if target is None else spec.with_placements(target))
        for t, spec, target in zip(tensors, specs, sharding.inputs)
    ]
    rebased = _rebase_viewed(func, tensors, specs, sharding.inputs, converters)
    unwrap = _make_unwrap(args, kwargs, converters)
    metas = [t for t in registry._flatten(out_meta) if isinstance(t, torch.Tensor)]
    if len(sharding.outputs) != len(metas):
        raise AssertionError(f"rule for {func} gave {len(sharding.outputs)} output placements for {len(metas)} outputs")
    out_specs = [
        DTensorSpec(mesh, placements, m.shape, m.stride(), m.dtype) for m, placements in zip(metas, sharding.outputs)
    ]
    wrap = _make_wrap(func, out_meta, out_specs, args)
    if rebased is None:
        fast = _local_plan(func, args, kwargs, converters, out_meta, out_specs, sharding, wrap)
        if fast is not None:
            return fast
    local = sharding.local or (lambda a, k, f=func._op: f(*a, **k))
    return Plan(unwrap, local, _mark_broken_views(func, converters, wrap, rebased))


def _is_view_op(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _rebase_viewed(func, tensors, specs, targets, converters) -> list[bool] | None:
    """A view op whose ``self`` must be redistributed first (``diagonal`` of a tensor
    sharded on a diagonal dim...) redistributes that DTensor *in place*: it takes the new
    placements and local block, and the view is taken on that block, so the view aliases
    the caller's tensor and writes through it reach it, as in torch. A ``self`` that is
    itself a view keeps its layout (moving it would cut it off from its own base); its
    view is then computed on a copy and tagged. Returns the per-call flag "rebased"
    that ``_mark_broken_views`` reads, or None when nothing is rebased."""
    if not (_is_view_op(func) and tensors and isinstance(tensors[0], DTensor)):
        return None
    move = converters[0]
    if move in (None, _local_of):
        return None
    target = specs[0].with_placements(targets[0])
    flag = [False]

    def rebase(x: DTensor) -> torch.Tensor:
        flag[0] = not (x._is_view() or getattr(x, "_not_a_view_of", None) is not None)
        if not flag[0]:
            return move(x)
        x._local_tensor = move(x)
        x._spec = target
        return x._local_tensor

    converters[0] = rebase
    return flag


def _fallback_plan(func, args, kwargs, tensors, specs, mesh) -> Plan:
    """No rule: replicate every input, run the op on whole tensors, replicate the outputs."""
    if os.environ.get("MPIDTENSOR_STRICT", "0") not in ("", "0"):
        raise NotImplementedError(
            f"mpidtensor has no sharding rule for {func} on inputs placed "
            f"{[tuple(s.placements) for s in specs]} (MPIDTENSOR_STRICT is set)"
        )
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(
            f"mpidtensor: no sharding rule for {func}; running it on replicated inputs "
            f"(correct, but gathers every input)",
            stacklevel=3,
        )
    return _replicated_plan(func, args, kwargs, tensors, specs, mesh)


def _replicated_plan(func, args, kwargs, tensors, specs, mesh, wrap: Callable | None = None) -> Plan:
    """Every input replicated, the op run on whole tensors, the outputs replicated
    (or passed through ``wrap``)."""
    rep = registry.replicated(mesh.ndim)
    converters = [_converter(t, s, s.with_placements(rep)) for t, s in zip(tensors, specs)]
    unwrap = _make_unwrap(args, kwargs, converters)
    if wrap is not None:
        return Plan(unwrap, lambda a, k: func(*a, **k), wrap)
    written = _mutated_inputs(func, args)
    if written:
        def replicated_specs(out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return [DTensorSpec(mesh, rep, t.shape, t.stride(), t.dtype) for t in outs]

        return Plan(unwrap, lambda a, k: func(*a, **k), _make_inplace_wrap(func, written, replicated_specs))
    wrap = _mark_broken_views(func, converters, lambda out, a, k: _wrap_replicated(out, mesh))
    return Plan(unwrap, lambda a, k: func(*a, **k), wrap)


def _mark_broken_views(func, converters, wrap: Callable, rebased: list[bool] | None = None) -> Callable:
    """For a view op: tag the outputs that do not alias the caller's tensor, because an
    input was redistributed (a copy, unless ``rebased[0]`` says self was moved in place)
    or was itself such an output. An in-place op on a tagged tensor is refused
    (``_make_inplace_wrap``): its write would be lost."""
    if not _is_view_op(func):
        return wrap
    others = converters[1:] if rebased is not None else converters
    copied = any(c not in (None, _local_of) for c in others)

    def marking_wrap(out, a, k):
        out = wrap(out, a, k)
        source = func if copied or (rebased is not None and not rebased[0]) else next(
            (t._not_a_view_of for t in a if getattr(t, "_not_a_view_of", None) is not None), None
        )
        if source is not None:
            for t in _tensors(out):
                t._not_a_view_of = source
        return out

    return marking_wrap


def _wrap_replicated(out, mesh):
    if isinstance(out, torch.Tensor):
        spec = DTensorSpec(mesh, registry.replicated(mesh.ndim), out.shape, out.stride(), out.dtype)
        return DTensor(out, spec, requires_grad=False)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(x, mesh) for x in out)
    return out


def _decomposition(func):
    """torch's Python decomposition of ``func``, else its composite C++ kernel (``reshape``
    called from inside another decomposition reaches the dispatcher undecomposed)."""
    from torch._decomp import decomposition_table

    found = decomposition_table.get(func)
    if found is None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        found = func.decompose
    return found


# --- argument handling -------------------------------------------------------------------------


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _replace_tensors(obj, values: list):
    """``obj`` with its tensors replaced, in flattened order, by ``values``."""
    it = iter(values)

    def go(o):
        if isinstance(o, torch.Tensor):
            return next(it)
        if isinstance(o, (list, tuple)):
            return type(o)(go(x) for x in o)
        if isinstance(o, dict):
            return {k: go(v) for k, v in o.items()}
        return o

    return go(obj)


def _common_mesh(func, tensors):
    meshes = [t._spec.mesh for t in tensors if isinstance(t, DTensor)]
    mesh = meshes[0]
    for other in meshes[1:]:
        if other is not mesh and other != mesh:
            raise ValueError(f"{func}: DTensor arguments live on different meshes ({mesh} and {other})")
    return mesh


def _spec_of(t: torch.Tensor, mesh, func) -> DTensorSpec:
    """A DTensor's spec, or a plain tensor's as ``Replicate()``. A plain tensor on another
    device type than the mesh's is refused from this rank's own argument, a fact no other
    rank sees: when every rank passes such a tensor (the usual SPMD bug) every rank raises;
    a rank alone raises alone and the others end at their next collective through the
    abort hook (:mod:`mpidtensor.mesh.abort`)."""
    if isinstance(t, DTensor):
        return t._spec
    if t.device.type != mesh.device_type and t.ndim > 0:
        raise TypeError(
            f"{func}: a plain {t.device.type} tensor was mixed with DTensors on a {mesh.device_type} mesh"
        )
    return DTensorSpec(mesh, registry.replicated(mesh.ndim), t.shape, t.stride(), t.dtype)


def _meta_outputs(func, args, kwargs, specs):
    metas = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in specs]
    n_args = len(_tensors(args))
    try:
        return func(*_replace_tensors(args, metas[:n_args]), **_replace_tensors(kwargs, metas[n_args:]))
    except NotImplementedError:  # no meta kernel: an op returning nothing (_fused_sgd_...) has no outputs to describe
        return None if not func._schema.returns else _NO_META
    except RuntimeError as err:
        text = str(err).lower()
        if "meta" in text or "data-dependent" in text or "data is not allocated" in text:
            return _NO_META  # the op reads tensor values on the host (tensor_split's indices...)
        raise


def _converter(t, src: DTensorSpec, dst: DTensorSpec) -> Callable | None:
    """A function from the argument to the local tensor the op needs (None: pass as is)."""
    steps = plan_redistribution(src, dst) if src != dst else ()
    mesh = src.mesh
    if not isinstance(t, DTensor):
        if not steps:
            return None

        def plain(a):
            for s in steps:
                a = s.run(a, mesh)
            return a

        return plain
    if not steps:
        return _local_of

    def convert(a):
        a = a._local_tensor
        for s in steps:
            a = s.run(a, mesh)
        return a

    return convert


_local_of = operator.attrgetter("_local_tensor")


def _make_unwrap(args, kwargs, converters) -> Callable:
    """A function mapping (args, kwargs) to local (args, kwargs) following ``converters``."""
    it = iter(converters)

    def build(o):
        if isinstance(o, torch.Tensor):
            return next(it)
        if isinstance(o, (list, tuple)):
            subs = [build(x) for x in o]
            if all(s is None for s in subs):
                return None
            kind = type(o)
            return lambda v: kind(x if s is None else s(x) for s, x in zip(subs, v))
        return None

    arg_convs = [(i, c) for i, c in enumerate(build(a) for a in args) if c is not None]
    kw_convs = [(k, c) for k, c in ((k, build(v)) for k, v in kwargs.items()) if c is not None]

    def unwrap(a, k):
        a = list(a)
        for i, c in arg_convs:
            a[i] = c(a[i])
        if kw_convs:
            k = dict(k)
            for name, c in kw_convs:
                k[name] = c(k[name])
        return a, k

    return unwrap


def _mutated_inputs(func, args) -> list[tuple[str, int | str]]:
    """The arguments an in-place or out= op writes into: ("pos", index) or ("kw", name)."""
    schema = func._schema
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only or i >= len(args):
                written.append(("kw", arg.name))
            else:
                written.append(("pos", i))
    return written


def _make_wrap(func, out_meta, out_specs, args) -> Callable:
    written = _mutated_inputs(func, args)
    if written and len(out_specs) == len(written):
        return _make_inplace_wrap(func, written, lambda out: out_specs)
    specs = iter(out_specs)

    def build(o):
        if isinstance(o, torch.Tensor):
            spec = next(specs)
            return lambda t: DTensor(t, spec, requires_grad=False)
        if isinstance(o, (list, tuple)):
            subs = [build(x) for x in o]
            kind = type(o)
            return lambda v: kind(s(x) for s, x in zip(subs, v))
        return lambda x: x

    if isinstance(out_meta, torch.Tensor):  # the common case, one frame less
        spec = out_specs[0]
        return lambda out, a, k: DTensor(out, spec, requires_grad=False)
    wrap_out = build(out_meta)
    return lambda out, a, k: wrap_out(out)


def _is_inner_tensor(wrapper: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` is one of the inner tensors of the wrapper subclass ``wrapper``: an in-place op
    that a subclass ran on its own data (and returned that data) wrote into ``wrapper``."""
    flatten = getattr(wrapper, "__tensor_flatten__", None)
    return flatten is not None and any(getattr(wrapper, name) is t for name in flatten()[0])


def _make_inplace_wrap(func, written, specs_of: Callable) -> Callable:
    """In-place and out= ops return the tensor they wrote into. A DTensor written
    through a redistributed copy takes the new local tensor and placements, unless it
    is a view of another DTensor: then the values are moved back into its own block,
    which its base shares. A plain tensor written through a moved copy, or given a
    Partial or sharded value, gets the whole result copied in. An in-place view op
    (``squeeze_``…) also changes the wrapper's own shape and strides."""
    inplace_view = torch.Tag.inplace_view in func.tags
    rep = registry.replicated

    def wrap(out, a, k):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        results = []
        for (kind, where), spec, local in zip(written, specs_of(out), outs):
            dst = a[where] if kind == "pos" else k[where]
            if getattr(dst, "_not_a_view_of", None) is not None:
                raise RuntimeError(
                    f"{func} writes into the result of {dst._not_a_view_of}, which mpidtensor computed on a "
                    f"redistributed copy (no sharding rule), so the write would not reach the original tensor"
                )
            if local is None:  # a subclass's in-place op that returned nothing, run on a moved copy
                raise RuntimeError(f"{func} returned None for the tensor it wrote into, which mpidtensor "
                                   f"had redistributed: the write cannot be placed back")
            if isinstance(dst, DTensor):
                if inplace_view:
                    with no_dispatch():
                        func(*a, **k)
                    dst._spec = spec
                    dst._local_tensor = local
                elif dst._local_tensor is not local and not _is_inner_tensor(dst._local_tensor, local):
                    if dst._is_view():  # its block aliases a base: write the values back into it
                        src = dst._spec.with_placements(spec.placements)
                        dst._local_tensor.copy_(redistribute_local(local, src, dst._spec))
                    else:
                        dst._local_tensor = local
                        dst._spec = dst._spec.with_placements(spec.placements)
                elif dst._spec.placements != spec.placements:  # moved with no data step (a one-rank mesh dim)
                    dst._spec = dst._spec.with_placements(spec.placements)
            elif isinstance(dst, torch.Tensor) and (local is not dst or spec.placements != rep(spec.mesh.ndim)):
                # A plain tensor written through a moved copy (a DTensor operand chose the layout),
                # or in place with a value that is not whole yet (out= of a Partial result).
                dst.copy_(redistribute_local(local, spec, spec.with_placements(rep(spec.mesh.ndim))))
            results.append(dst)
        return type(out)(results) if isinstance(out, (tuple, list)) else results[0]

    return wrap
