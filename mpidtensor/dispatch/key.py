"""The dispatcher's entry point: each call's cache key, and the plan cache it looks up.

The key is the op (its C++ entry ``func._op``, which hashes without a Python call), the specs
of the DTensor arguments, the shape and dtype of plain tensors (taken as ``Replicate()``)
and the non-tensor arguments (floats of pointwise, ``_foreach_*`` and fused optimizer ops
by type only, so a changing scalar such as a learning rate or an optimizer's per-parameter
step sizes does not re-plan). A miss makes
a plan (:mod:`.planner`); a hit runs it. ``detach`` of a DTensor (AccumulateGrad detaches
every gradient) skips the key when the plan for its spec is known to keep the spec.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..tensor.dtensor import DTensor
from ..fast import registry as fast_paths
from ..ops.pointwise import placement_ignores_scalars
from ..runtime import caches
from .planner import make_plan
from .kinds import LocalPlan

__all__ = ["dispatch", "torch_dispatch", "plan_for", "moves_nothing"]

_PLANS = caches.cache("dispatch.plans", maxsize=16384)  # key -> a plan of .kinds
_FLOAT_BY_VALUE = caches.cache("dispatch.float_by_value", maxsize=None, holds_meshes=False)  # op._op -> bool
_DETACH_KEEPS = caches.cache("dispatch.detach_keeps_spec", maxsize=16384)  # spec -> bool
_DETACH = torch.ops.aten.detach.default
_INTS = {int}
_make_wrapper = torch.Tensor._make_wrapper_subclass
DETACH = fast_paths.register(
    "dispatch.detach",
    shortcuts="the cache key and plan of aten.detach on a DTensor (AccumulateGrad detaches every gradient)",
    decided_by="the dispatcher's plan for detach on the tensor's spec: a LocalPlan whose output keeps "
               "that spec (asked once per spec)")


def torch_dispatch(cls, func: torch._ops.OpOverload, types, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``DTensor.__torch_dispatch__`` (installed by :mod:`mpidtensor.dispatch`): run ``func``
    on DTensor arguments, the cached plan for the call's key, made on a miss.

    Every DTensor op enters here, so it is one frame (it does not call :func:`dispatch`), its
    key a tuple grown by concatenation (no ``list.append`` call per argument), and whether
    the op keys floats by value is looked up only for an argument that needs it."""
    if func is _DETACH:
        x = args[0]
        if x.__class__ is DTensor and x._not_a_view_of is None:
            spec = x._spec
            try:
                keeps = _DETACH_KEEPS[spec]  # subscripts, not ``get``: one Python call fewer per lookup
            except KeyError:
                keeps = _DETACH_KEEPS[spec] = _detach_keeps_spec(x)
            if keeps:
                DETACH.hits += 1
                local = x._local_tensor.detach()
                # DTensor(local, spec) inline (one Python call fewer per gradient)
                out = _make_wrapper(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local.device,
                                    layout=local.layout)
                out._local_tensor, out._spec = local, spec
                return out
    fid = func._op  # the overload's C++ entry, hashed in C (an OpOverload's __hash__ is a Python call)
    by_value = None  # whether floats key by value: asked when an argument needs it
    key = (fid,)
    for a in args:  # _key's cases, the common ones first without a call (plan_for: the same key)
        kind = a.__class__
        if kind is DTensor:
            key += (a._spec,)
        elif kind is int or kind is bool:
            key += (a,)
        elif kind is list and set(map(type, a)) == _INTS:  # sizes, dims: _key's result, in C calls only
            key += ((list, *a),)
        else:
            if by_value is None:
                by_value = _floats_by_value(fid, func)
            key += (float if kind is float and not by_value else _key(a, by_value),)
    if kwargs:
        if by_value is None:
            by_value = _floats_by_value(fid, func)
        key += (_key(kwargs, by_value),)
    elif kwargs is None:
        kwargs = {}
    try:
        plan = _PLANS[key]  # a subscript, not a ``get`` call: the hit is every call but the first
    except KeyError:
        plan = None
    if plan is None:  # planned outside the except: an op refused shows its error alone, not the cache's KeyError
        plan = _PLANS[key] = make_plan(func, args, kwargs)
    return plan(args, kwargs)


def dispatch(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on DTensor arguments as ``__torch_dispatch__`` does."""
    return torch_dispatch(DTensor, func, (), args, kwargs)


def _floats_by_value(fid, func: torch._ops.OpOverload) -> bool:
    """Whether ``func``'s float arguments key its plans by value (not so for ops whose
    placement ignores scalars: a changing learning rate must not re-plan)."""
    by_value = _FLOAT_BY_VALUE.get(fid)
    if by_value is None:
        by_value = _FLOAT_BY_VALUE[fid] = not placement_ignores_scalars(func)
    return by_value


def plan_for(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None) -> Callable:
    """The plan :func:`dispatch` runs for this call (made and cached if new); nothing runs."""
    kwargs = kwargs or {}
    fid = func._op
    by_value = _floats_by_value(fid, func)
    key = (fid, *(_key(a, by_value) for a in args), *((_key(kwargs, by_value),) if kwargs else ()))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make_plan(func, args, kwargs)
    return plan


def moves_nothing(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether the dispatcher runs this call as a :class:`LocalPlan`: the local op on the
    local tensors, no input moved, outputs of the rule's specs. Fast paths decide from
    this; with ``settings.fast_paths`` off it is always False."""
    return plan_for(func, args, kwargs).__class__ is LocalPlan


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


def _detach_keeps_spec(x: DTensor) -> bool:
    plan = plan_for(_DETACH, (x,))
    return plan.__class__ is LocalPlan and plan.specs[0] is x._spec

