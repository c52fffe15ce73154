"""An op call's arguments as the planner sees them: its tensors in flattened order, their
specs (a plain tensor is ``Replicate()``), the arguments it writes into, and the
functions that turn DTensor arguments into the local tensors the op needs."""
from __future__ import annotations

import operator
from typing import Callable

import torch

from ..tensor.dtensor import DTensor
from ..ops import registry
from ..tensor.redistribute import plan as plan_redistribution
from ..tensor.spec import DTensorSpec

__all__ = [
    "tensors", "replace_tensors", "common_mesh", "spec_of", "converter", "local_of", "make_unwrap",
    "mutated_inputs", "is_view_op",
]

local_of = operator.attrgetter("_local_tensor")
"""The converter of a DTensor argument that stays where it is."""


def tensors(obj) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested lists, tuples and dicts), in flattened order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors(x)]
    return []


def replace_tensors(obj, values: list):
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


def common_mesh(func, found: list[torch.Tensor]):
    """The one mesh of the DTensors in ``found`` (``ValueError`` if they live on several:
    decided from the specs, alike on every rank)."""
    meshes = [t._spec.mesh for t in found if isinstance(t, DTensor)]
    mesh = meshes[0]
    for other in meshes[1:]:
        if other is not mesh and other != mesh:
            raise ValueError(f"{func}: DTensor arguments live on different meshes ({mesh} and {other})")
    return mesh


def spec_of(t: torch.Tensor, mesh, func) -> DTensorSpec:
    """A DTensor's spec, or a plain tensor's as ``Replicate()``. A plain tensor on another
    device type than the mesh's is refused from this rank's own argument, a fact no other
    rank sees: when every rank passes such a tensor (the usual SPMD bug) every rank raises;
    a rank alone raises alone and the others end at their next collective through the
    abort hook (:mod:`mpidtensor.runtime.abort`)."""
    if isinstance(t, DTensor):
        return t._spec
    if t.device.type != mesh.device_type and t.ndim > 0:
        raise TypeError(
            f"{func}: a plain {t.device.type} tensor was mixed with DTensors on a {mesh.device_type} mesh"
        )
    return DTensorSpec(mesh, registry.replicated(mesh.ndim), t.shape, t.stride(), t.dtype)


def converter(t, src: DTensorSpec, dst: DTensorSpec) -> Callable | None:
    """A function from the argument to the local tensor the op needs: None (a plain tensor
    passed as it is), :data:`local_of` (a DTensor that stays where it is), or the
    redistribution from ``src`` to ``dst``."""
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
        return local_of

    def convert(a):
        a = a._local_tensor
        for s in steps:
            a = s.run(a, mesh)
        return a

    return convert


def make_unwrap(args, kwargs, converters) -> Callable:
    """A function mapping (args, kwargs) to local (args, kwargs) following ``converters``
    (one per tensor, in flattened order)."""
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


def mutated_inputs(func, args) -> list[tuple[str, int | str]]:
    """The arguments an in-place or out= op writes into: ("pos", index) or ("kw", name)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only or i >= len(args):
                written.append(("kw", arg.name))
            else:
                written.append(("pos", i))
    return written


def is_view_op(func) -> bool:
    """The op returns an alias of an input (``view``, ``detach``, ``split``...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
