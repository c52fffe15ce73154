"""Making a plan for one op signature: output metadata from meta tensors, the placements
from the op's rule (:mod:`mpidtensor.ops`), the redistribution of every input; an op
without a rule runs torch's decomposition on the DTensors, else (``settings.strict``
off) on replicated inputs. The plan kind is chosen here (:mod:`.kinds`)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..tensor.dtensor import DTensor
from ..fast import registry as fast_paths
from ..ops import registry
from ..ops.pointwise import is_pointwise, pointwise_rule
from ..runtime.caches import cache
from ..runtime.settings import settings
from ..tensor.spec import DTensorSpec
from .args import common_mesh, converter, make_unwrap, mutated_inputs, replace_tensors, spec_of, tensors
from .kinds import LocalPlan, LocalViewPlan, PerMeshPlan, Plan, per_mesh_groups
from .outside import make_outside_plan
from .writeback import list_writeback, make_inplace_wrap, mark_broken_views, rebase_viewed

__all__ = ["make_plan", "rule_of"]

_NO_META = object()  # the op could not run on meta tensors
_NUMBER_TYPES = {"number", "Scalar", "int", "float", "bool", "complex", "SymInt", "SymFloat", "SymBool"}
_WARNED = cache("dispatch.warned_fallbacks", maxsize=None, holds_meshes=False)  # op -> True: warned once


def make_plan(func, args, kwargs) -> Callable:
    """The plan (a :class:`Plan`, :class:`LocalPlan`, :class:`LocalViewPlan` or :class:`PerMeshPlan`) for this call's
    signature."""
    split = per_mesh_groups(func, args, kwargs, by_mesh=fast_paths.enabled())
    if split is not None:
        return PerMeshPlan(func, *split, counted=fast_paths.enabled())
    found = tensors(args) + tensors(kwargs)
    mesh = common_mesh(func, found)
    specs = [spec_of(t, mesh, func) for t in found]
    if mesh._coord is None:  # this rank is outside a sub-mesh: torch's default results, nothing moves
        return make_outside_plan(func, args, kwargs, specs, mesh,
                                 None if _returns_numbers(func) else _meta_outputs(func, args, kwargs, specs),
                                 rule_of(func))
    if _returns_numbers(func):  # item, _local_scalar_dense...: a number needs the whole tensor
        return _replicated_plan(func, args, kwargs, found, specs, mesh, lambda out, a, k: out)
    out_meta = _meta_outputs(func, args, kwargs, specs)
    rule = rule_of(func)
    if rule is None or out_meta is _NO_META:
        decomposed = _decomposition(func)
        if decomposed is not None:
            return _decomposed_plan(func, decomposed, specs, mesh)
        return _fallback_plan(func, args, kwargs, found, specs, mesh)
    n_args = len(tensors(args))
    call = registry.OpCall(func, replace_tensors(args, specs), replace_tensors(kwargs, specs[n_args:]),
                           mesh, out_meta, specs)
    sharding = rule(call)
    if not _placeable(sharding, specs, call.out_metas()):
        return _fallback_plan(func, args, kwargs, found, specs, mesh)
    return _build_plan(func, args, kwargs, found, specs, mesh, out_meta, sharding)


def _returns_numbers(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(str(r.type) in _NUMBER_TYPES for r in returns)


def _placeable(sharding: registry.Sharding | None, specs, out_metas) -> bool:
    """Whether a rule's decision can run: every ``Shard`` names a dim its tensor has
    (a rule that shards a 0-d tensor could not place the op)."""
    if sharding is None:
        return False
    pairs = [(t, s.ndim) for t, s in zip(sharding.inputs, specs)] + [
        (t, m.ndim) for t, m in zip(sharding.outputs, out_metas)
    ]
    return all(t is None or registry.valid_placements(t, ndim) for t, ndim in pairs)


def rule_of(func: torch._ops.OpOverload) -> Callable | None:
    """The rule the dispatcher uses for ``func`` (the fast paths ask the same one); an
    in-place view op (``squeeze_``, ``t_``…) uses its functional form's. A rule that does
    not place ``_StridedShard`` inputs itself gets them as ``Replicate`` (:func:`registry.strided_safe`)."""
    rule = registry.rule_for(func)
    if rule is None and torch.Tag.inplace_view in func.tags:
        packet = getattr(torch.ops.aten, func._schema.name.split("::")[1].removesuffix("_"), None)
        functional = getattr(packet, func._overloadname, None) if packet is not None else None
        rule = registry.rule_for(functional) if functional is not None else None
    if rule is None and is_pointwise(func):
        rule = pointwise_rule
    return None if rule is None else registry.strided_safe(rule)


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
            fallback.append(_fallback_plan(func, a, k, tensors(a) + tensors(k), specs, mesh))
        return fallback[0](a, k)

    return Plan(lambda a, k: (a, k), run, lambda out, a, k: out)


def _build_plan(func, args, kwargs, found, specs, mesh, out_meta, sharding) -> Callable:
    if len(sharding.inputs) != len(specs):
        raise AssertionError(f"rule for {func} gave {len(sharding.inputs)} input placements for {len(specs)} tensors")
    converters = [
        converter(t, spec, spec if target is None else spec.with_placements(target))
        for t, spec, target in zip(found, specs, sharding.inputs)
    ]
    rebased = rebase_viewed(func, found, specs, sharding.inputs, converters)
    metas = [t for t in registry._flatten(out_meta) if isinstance(t, torch.Tensor)]
    if len(sharding.outputs) != len(metas):
        raise AssertionError(f"rule for {func} gave {len(sharding.outputs)} output placements for {len(metas)} outputs")
    out_specs = [
        DTensorSpec(mesh, placements, m.shape, m.stride(), m.dtype) for m, placements in zip(metas, sharding.outputs)
    ]
    if out_meta is None:
        written_lists = list_writeback(func, args, specs, sharding.inputs)
        if written_lists is not None:
            return Plan(make_unwrap(args, kwargs, converters), *written_lists)
    wrap = mark_broken_views(func, converters, _make_wrap(func, out_meta, out_specs, args), rebased)
    if rebased is None and fast_paths.enabled():
        for kind in (LocalPlan, LocalViewPlan):
            fast = kind.make(func, args, kwargs, converters, out_meta, out_specs, sharding, wrap)
            if fast is not None:
                return fast
    local = sharding.local or (lambda a, k, f=func._op: f(*a, **k))
    return Plan(make_unwrap(args, kwargs, converters), local, wrap)


def _make_wrap(func, out_meta, out_specs, args) -> Callable:
    """The outputs as DTensors of ``out_specs``, or (in place, out=) the written arguments."""
    written = mutated_inputs(func, args)
    if written and len(out_specs) == len(written):
        return make_inplace_wrap(func, written, lambda out: out_specs)
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


def _fallback_plan(func, args, kwargs, found, specs, mesh) -> Plan:
    """No rule: replicate every input, run the op on whole tensors, replicate the outputs."""
    if settings.strict:
        raise NotImplementedError(
            f"mpidtensor has no sharding rule for {func} on inputs placed "
            f"{[tuple(s.placements) for s in specs]} (MPIDTENSOR_STRICT is set)"
        )
    if func not in _WARNED:
        _WARNED[func] = True
        warnings.warn(
            f"mpidtensor: no sharding rule for {func}; running it on replicated inputs "
            f"(correct, but gathers every input)",
            stacklevel=3,
        )
    return _replicated_plan(func, args, kwargs, found, specs, mesh)


def _replicated_plan(func, args, kwargs, found, specs, mesh, wrap: Callable | None = None) -> Plan:
    """Every input replicated, the op run on whole tensors, the outputs replicated
    (or passed through ``wrap``)."""
    rep = registry.replicated(mesh.ndim)
    converters = [converter(t, s, s.with_placements(rep)) for t, s in zip(found, specs)]
    unwrap = make_unwrap(args, kwargs, converters)
    if wrap is not None:
        return Plan(unwrap, lambda a, k: func(*a, **k), wrap)
    written = mutated_inputs(func, args)
    if written:
        def replicated_specs(out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return [DTensorSpec(mesh, rep, t.shape, t.stride(), t.dtype) for t in outs]

        return Plan(unwrap, lambda a, k: func(*a, **k), make_inplace_wrap(func, written, replicated_specs))
    wrap = mark_broken_views(func, converters, lambda out, a, k: _wrap_replicated(out, mesh))
    return Plan(unwrap, lambda a, k: func(*a, **k), wrap)


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


def _meta_outputs(func, args, kwargs, specs):
    metas = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in specs]
    n_args = len(tensors(args))
    try:
        return func(*replace_tensors(args, metas[:n_args]), **replace_tensors(kwargs, metas[n_args:]))
    except NotImplementedError:  # no meta kernel: an op returning nothing (_fused_sgd_...) has no outputs to describe
        return None if not func._schema.returns else _NO_META
    except RuntimeError as err:
        text = str(err).lower()
        if "meta" in text or "data-dependent" in text or "data is not allocated" in text:
            return _NO_META  # the op reads tensor values on the host (tensor_split's indices...)
        raise
